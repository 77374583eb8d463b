"""SpyreStaticCausalLM: a Spyre decoder under static batching.

The model runner (``vllm.worker.spyre_static_model_runner``) calls
``forward`` once per engine step with the fixed-shape tensors built by
``vllm.worker.spyre_static_inputs``: a prefill over a whole padded batch
fills the first ``prompt_len`` slots of the batch's key/value cache, each
decode step writes one more slot.  The caches belong to this module: one
per warm-up shape, allocated when the shape is first run (at warm-up) and
written in place ever after (``vllm.attention.ops.spyre_static_cache``).
``forward`` returns the next-token logits of every row; vLLM's own
``LogitsProcessor`` and ``Sampler`` then run on the rows that are still
live, as in vLLM's Neuron backend.
"""
from __future__ import annotations

from typing import Optional

import torch

from vllm.attention.ops import spyre_static_cache as static_cache
from vllm.config import VllmConfig
from vllm.config.spyre import SpyreConfig
from vllm.logger import init_logger
from vllm.model_executor.layers import spyre_mamba
from vllm.model_executor.models.spyre_causal_lm import SpyreCausalLM

logger = init_logger(__name__)


class SpyreStaticCausalLM(SpyreCausalLM):
    """A decoder with a key/value cache per warm-up shape."""

    attention = static_cache

    def __init__(self, *, vllm_config: VllmConfig,
                 spyre_config: SpyreConfig) -> None:
        super().__init__(vllm_config=vllm_config, spyre_config=spyre_config)
        #: One key/value cache per (batch size, cache length).
        self.kv_caches: dict[tuple[int, int], list] = {}
        #: The cache of the running batch.
        self.kv_cache: Optional[list] = None
        #: A hybrid model's Mamba-2 states, one slot per row, per batch
        #: size; those of the running batch.
        self.state_pools: dict[int, spyre_mamba.StatePool] = {}
        self.state_pool: Optional[spyre_mamba.StatePool] = None

    # ---- graphs ---------------------------------------------------------
    @staticmethod
    def graph_name(is_prompt: bool, batch_size: int, length: int,
                   cache_len: int) -> str:
        if is_prompt:
            return f"prefill-b{batch_size}-p{length}-c{cache_len}"
        return f"decode-b{batch_size}-c{cache_len}"

    def expected_graphs(self) -> dict[str, str]:
        """Every graph warm-up will run: name -> what it serves."""
        graphs = {}
        for s in self.spyre_config.warmup_shapes:
            graphs[self.graph_name(True, s.batch_size, s.prompt_len,
                                   s.max_len)] = f"prefill of shape {s}"
            if s.new_tokens > 1:
                graphs[self.graph_name(False, s.batch_size, 1,
                                       s.max_len)] = f"decode of shape {s}"
        return graphs

    def _cache_for(self, batch_size: int, cache_len: int) -> list:
        key = (batch_size, cache_len)
        cache = self.kv_caches.get(key)
        if cache is None:
            cache = self.cache_layout.allocate(batch_size, cache_len,
                                               self.precision.kv)
            self.kv_caches[key] = cache
            logger.info(
                "Allocated the key/value cache of batch size %d x %d slots "
                "(%.1f MiB)", batch_size, cache_len,
                self.cache_layout.nbytes(batch_size, cache_len,
                                         self.precision.kv) /
                2**20)
        return cache

    def _layer_caches(self, is_prompt: bool,
                      positions: torch.Tensor) -> list:
        """The running batch's caches as the model takes them: the
        key/value caches, and for a hybrid model its Mamba-2 layers' steps
        over the batch's state slots (one per row; a prefill starts from
        zero states; a row of ``n`` real tokens, the last at position
        ``n - 1``, is left-padded to the prompt length)."""
        if self.state_layout is None:
            return self.kv_cache
        B, L = positions.shape
        if is_prompt:
            pool = self.state_pools.get(B)
            if pool is None:
                pool = self.state_layout.allocate(B)
                self.state_pools[B] = pool
            self.state_pool = pool
            real = positions[:, -1:] + 1  # [B, 1]
            valid = torch.arange(L).unsqueeze(0) >= L - real
        else:
            valid = torch.ones(B, 1, dtype=torch.bool)
        fresh = torch.full((B, ), is_prompt, dtype=torch.bool)
        steps = self.state_pool.steps(torch.arange(B), fresh, valid)
        return spyre_mamba.layer_caches(self.is_ssm, self.kv_cache, steps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                mask: torch.Tensor, cache_slots: torch.Tensor,
                cache_len: int, is_prompt: bool,
                inputs_embeds: Optional[torch.Tensor] = None
                ) -> torch.Tensor:
        """Runs one step of the whole padded batch.

        input_ids, positions: [B, L]; mask: [B, L, kv_len] (True = attend);
        cache_slots: [L], the cache slots this step writes; inputs_embeds:
        [B, L, hidden], a prefill's embeddings with its images.
        Returns the next-token logits of every row: [B, vocab].  A model
        that takes images prefills on embeddings: the step's, or its
        ids'.
        """
        if is_prompt:
            self.kv_cache = self._cache_for(input_ids.shape[0], cache_len)
        elif self.kv_cache is None:
            raise RuntimeError("decode step without a prefill")
        extra = {}
        if self.code.embeds_prompts and is_prompt:
            extra["inputs_embeds"] = (self.code.embed(input_ids)
                                      if inputs_embeds is None else
                                      inputs_embeds)
        return self.code.static_step(
            self.model,
            self.graph_name(is_prompt, input_ids.shape[0],
                            input_ids.shape[1], cache_len), input_ids,
            positions, self._layer_caches(is_prompt, positions), mask,
            cache_slots, is_prompt, **extra)
