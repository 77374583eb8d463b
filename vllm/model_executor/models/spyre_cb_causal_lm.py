"""SpyreCBCausalLM: a Spyre decoder under continuous batching.

The same model code (FMS's or vLLM's) and ``torch.compile`` as every
``SpyreCausalLM``, with attention through ``paged_cache``'s block pools
instead of a cache per warm-up shape.  Two graphs serve every step:

* a prefill, ``[1, L]``: on the paged C++ kernel (CPU ``inductor``), the
  whole sequence in one pass, its length marked dynamic (``L >=
  MIN_PREFILL_LEN``), so one graph serves every prompt length; elsewhere
  (the card, whose graphs have static shapes, and the torch ops, which
  hold a ``[heads, L, context]`` score tensor) a chunk of ``block_size``
  positions (``L = 64``);
* a decode step, ``[B, 1]``, its batch dimension marked dynamic
  (``B >= MIN_DECODE_BATCH``), so one graph serves every batch size;
* with speculative decoding, a verify step, ``[B, k + 1]``: each running
  sequence's last token and up to ``k`` proposed tokens, the logits of
  every position kept, its batch dimension dynamic as a decode step's.

The block table always has the width of a ``max_model_len`` sequence and
the pools never change size, so nothing recompiles while serving.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from vllm.attention.ops import spyre_paged_cache as paged_cache
from vllm.attention.ops.spyre_kv_layout import PoolLayout
from vllm.attention.ops.spyre_paged_inputs import (MIN_DECODE_BATCH,
                                               MIN_PREFILL_LEN, PagedInputs)
from vllm.config import VllmConfig
from vllm.config.spyre import CB_BLOCK_SIZE, SpyreConfig
from vllm.logger import init_logger
from vllm.model_executor.layers import spyre_mamba
from vllm.model_executor.models.spyre_causal_lm import SpyreCausalLM

logger = init_logger(__name__)


class SpyreCBCausalLM(SpyreCausalLM):
    """A decoder reading and writing a block pool."""

    attention = paged_cache

    def __init__(self, *, vllm_config: VllmConfig,
                 spyre_config: SpyreConfig) -> None:
        super().__init__(vllm_config=vllm_config, spyre_config=spyre_config)
        self.pool_layout = PoolLayout(self.cache_layout)
        #: Per layer (keys, values), allocated by ``allocate_pool``.
        self.kv_pool: Optional[list] = None
        self.num_blocks = 0
        #: A hybrid model's Mamba-2 state slots (``spyre_mamba``): one per
        #: sequence the scheduler may run, and the spare one.
        self.state_slot_count = vllm_config.scheduler_config.max_num_seqs
        #: Range of the dynamic decode batch (dynamo wants a bounded one).
        self.decode_batch_range = (MIN_DECODE_BATCH, max(
            vllm_config.scheduler_config.max_num_seqs, MIN_DECODE_BATCH + 1))
        self.max_model_len = vllm_config.scheduler_config.max_model_len
        #: Range of the dynamic prefill length on the paged C++ kernel, or
        #: None where a prefill runs in static chunks of ``CB_BLOCK_SIZE``.
        #: A chunk pays for its padding and for the LM head, read whole
        #: per chunk to keep one row of logits; the kernel scores one query
        #: position at a time, so a whole prompt costs it no more memory
        #: than a chunk.  A hybrid model's Mamba-2 scan cuts its positions
        #: into chunks, which a dynamic length would specialise (one chunk
        #: or several): it prefills in static chunks, its state carried
        #: from one to the next.
        self.prefill_len_range = (MIN_PREFILL_LEN, max(
            self.max_model_len, MIN_PREFILL_LEN + 1)) if (
                self.native and self.state_layout is None) else None
        spec = vllm_config.speculative_config
        #: Positions of a speculative verify step (``k + 1``), or None.
        self.verify_len = (spec.num_speculative_tokens + 1
                           if spec is not None else None)

    def block_bytes(self) -> int:
        """Bytes one block of the pool takes on this rank."""
        return self.pool_layout.block_bytes(self.precision.kv)

    def state_bytes(self) -> int:
        """Bytes the Mamba-2 state slots take (0 without such layers)."""
        if self.state_layout is None:
            return 0
        return spyre_mamba.cb_state_slots(
            self.state_slot_count) * self.state_layout.slot_bytes()

    def allocate_pool(self, num_blocks: int) -> None:
        """Allocates the pools once; they are written in place ever after."""
        if self.kv_pool is not None:
            raise RuntimeError("the key/value pool is allocated already")
        self.kv_pool = self.pool_layout.allocate(num_blocks,
                                                self.precision.kv)
        self.num_blocks = num_blocks
        logger.info(
            "Allocated the key/value pool: %d blocks of %d tokens (%.1f MiB)",
            num_blocks, CB_BLOCK_SIZE,
            num_blocks * self.block_bytes() / 2**20)
        if self.state_layout is not None:
            self.state_pool = self.state_layout.allocate(
                spyre_mamba.cb_state_slots(self.state_slot_count))
            logger.info(
                "Allocated the Mamba-2 states of %d layers: %d slots, one "
                "per sequence and a spare (%.1f MiB)",
                self.state_layout.layers, self.state_pool.slots,
                self.state_bytes() / 2**20)

    def paged_graph_name(self, is_prompt: bool, max_blocks: int,
                         verify: bool = False) -> str:
        """Names the graphs by what fixes their shapes: the block table's
        width, the pool's size, and the prefill length range (none for
        static chunks), or the decode batch range (and a verify step's
        length)."""
        sizes = f"w{max_blocks}-n{self.num_blocks}"
        if is_prompt and self.prefill_len_range is None:
            return f"cb-prefill-{sizes}"
        if is_prompt:
            low, high = self.prefill_len_range
            return f"cb-prefill-l{low}to{high}-{sizes}"
        low, high = self.decode_batch_range
        if verify:
            return f"cb-verify-l{self.verify_len}-b{low}to{high}-{sizes}"
        return f"cb-decode-b{low}to{high}-{sizes}"

    def expected_graphs(self) -> dict[str, str]:
        max_blocks = -(-self.max_model_len // CB_BLOCK_SIZE)
        limits = (f"(max_model_len={self.max_model_len}, max_num_seqs="
                  f"{self.decode_batch_range[1]}, "
                  f"{self.num_blocks} blocks)")
        graphs = {
            self.paged_graph_name(True, max_blocks):
            f"continuous-batching prefill {limits}",
            self.paged_graph_name(False, max_blocks):
            f"continuous-batching decode {limits}",
        }
        if self.verify_len is not None:
            graphs[self.paged_graph_name(False, max_blocks, True)] = (
                f"speculative verify of {self.verify_len} positions "
                f"{limits}")
        return graphs

    def forward(self, step: PagedInputs,
                states: Optional[spyre_mamba.StateRows] = None
                ) -> torch.Tensor:
        """One prefill ([1, L]) or one decode step ([B, 1]); ``states``:
        the rows' Mamba-2 state slots, for a hybrid model.  Returns the
        logits of each row's last position: [B, vocab].  A model that
        takes images prefills on embeddings: the step's, or its ids'."""
        if (self.code.embeds_prompts and step.input_ids.shape[1] > 1
                and step.inputs_embeds is None):
            step = dataclasses.replace(
                step, inputs_embeds=self.code.embed(step.input_ids))
        is_decode = self._mark_dynamic(step, states)
        return self.code.paged_step(
            self.model,
            self.paged_graph_name(not is_decode, step.block_table.shape[1]),
            step, self._pool_caches(states), self.window)

    def verify(self, step: PagedInputs) -> torch.Tensor:
        """One speculative verify step, ``[B, verify_len]``: the logits of
        every position, ``[B, verify_len, vocab]``."""
        if self.verify_len is None or \
                step.input_ids.shape[1] != self.verify_len:
            raise RuntimeError(
                f"a verify step of {step.input_ids.shape[1]} positions; "
                f"the verify graph takes {self.verify_len}")
        if self.kv_pool is None:
            raise RuntimeError("a step before the key/value pool exists")
        self._mark_batch_dynamic(step)
        return self.code.paged_step(
            self.model,
            self.paged_graph_name(False, step.block_table.shape[1], True),
            step, self.kv_pool, self.window, self.verify_len)

    @property
    def last_hidden(self) -> Optional[torch.Tensor]:
        """The last step's hidden states where the model code keeps them
        (an MLP speculator's; ``ModelCode.keeps_hidden``)."""
        return self.code.last_hidden

    def _pool_caches(self, states: Optional[spyre_mamba.StateRows]) -> list:
        """The pools as the model takes them; a hybrid model's Mamba-2
        layers get their steps over the rows' state slots."""
        if self.state_layout is None:
            return self.kv_pool
        if states is None:
            raise RuntimeError("a hybrid model's step needs its rows' "
                               "Mamba-2 state slots")
        steps = self.state_pool.steps(states.slots, states.fresh,
                                      states.valid)
        return spyre_mamba.layer_caches(self.is_ssm, self.kv_pool, steps)

    def _mark_dynamic(self, step: PagedInputs,
                      states: Optional[spyre_mamba.StateRows] = None) -> bool:
        """Marks the step's dynamic dimension (the decode batch, or the
        prefill length on the kernel) within its range; whether the step
        is a decode step."""
        if self.kv_pool is None:
            raise RuntimeError("a step before the key/value pool exists")
        is_decode = step.input_ids.shape[1] == 1
        rows = ((states.slots, states.fresh, states.valid)
                if states is not None else ())
        if is_decode:
            self._mark_batch_dynamic(step, rows)
        elif self.prefill_len_range is not None:
            # Prefill: one graph for every prompt length.
            low, high = self.prefill_len_range
            embeds = () if step.inputs_embeds is None else (
                step.inputs_embeds, )
            for t in (step.input_ids, step.position_ids, step.cache_slots,
                      step.ctx_lens, *embeds, *rows[2:]):
                torch._dynamo.mark_dynamic(t, 1, min=low, max=high)
        return is_decode

    def _mark_batch_dynamic(self, step: PagedInputs, rows: tuple = ()) -> None:
        """A decode or verify step: one graph for every batch size."""
        low, high = self.decode_batch_range
        for t in (step.input_ids, step.position_ids, step.cache_slots,
                  step.block_table, step.ctx_lens, *rows):
            torch._dynamo.mark_dynamic(t, 0, min=low, max=high)
