"""SpyreCausalLM: an FMS decoder, compiled with torch.compile, for vLLM.

The model is loaded by
``vllm.model_executor.model_loader.spyre_fms_loader`` and compiled by
``vllm.compilation.spyre_compile``.  The model runner calls
``forward`` once per engine step with the fixed-shape tensors built by
``vllm.worker.spyre_inputs``: a prefill over a whole padded batch fills the
first ``prompt_len`` slots of the batch's key/value cache, each decode step
writes one more slot.  The caches belong to this module: one per warm-up
shape, allocated when the shape is first run (at warm-up) and written in
place ever after (``vllm.attention.ops.spyre_static_cache``).
``forward`` returns the next-token logits of every row; vLLM's own ``LogitsProcessor`` and
``Sampler`` then run on the rows that are still live, as in vLLM's Neuron
backend (``SpyreSampler`` takes all-greedy steps on a shorter path with the
same result).
"""
from __future__ import annotations

import time
from typing import Optional

import torch
from torch import nn

from vllm.attention.ops import spyre_static_cache as static_cache
from vllm.attention.ops.spyre_kv_layout import CacheLayout
from vllm.attention.ops.spyre_torch_ops import causal_mask
from vllm.compilation import spyre_graph_cache
from vllm.compilation.spyre_compile import compile_graphs
from vllm.config import VllmConfig
from vllm.config.spyre import SpyreConfig
from vllm.logger import init_logger
from vllm.model_executor.layers import (spyre_fused_ops, spyre_linear,
                                        spyre_mamba)
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.sampler import SamplerOutput
from vllm.model_executor.layers.spyre_sampler import SpyreSampler
from vllm.model_executor.model_loader import spyre_weight_update
from vllm.model_executor.model_loader import (
    spyre_fms_loader as spyre_loader)
from vllm.model_executor.models import spyre_families
from vllm.model_executor.models.spyre_dtypes import (precision_of,
                                                     serving_dtype)
from vllm.model_executor.sampling_metadata import SamplingMetadata
from vllm.spyre_kernels import ops as native

logger = init_logger(__name__)


class SpyreCausalLM(nn.Module):
    """FMS causal LM, compiled for the configured backend."""

    #: FMS attention ops: in torch ops, and on the CPU kernels.
    ATTN_NAMES = (static_cache.ATTN_NAME,
                  static_cache.ATTN_NAME_CPU_KERNEL)
    #: Whether a break in a graph is an error (``compile_graphs``'s
    #: ``fullgraph``) where the graph cache is off.
    whole_graphs = False

    def __init__(self, *, vllm_config: VllmConfig,
                 spyre_config: SpyreConfig) -> None:
        super().__init__()
        self.spyre_config = spyre_config
        model_config = vllm_config.model_config
        #: The dtype served, and where it is held.
        self.served_dtype = serving_dtype(model_config.dtype,
                                          spyre_config.dynamo_backend)
        self.precision = precision_of(model_config.dtype,
                                      spyre_config.dynamo_backend)
        #: The dtype the FMS model is loaded in.
        self.dtype = self.precision.model
        if self.served_dtype != model_config.dtype:
            logger.warning(
                "dtype %s is slow or unsupported on the CPU; using float32",
                model_config.dtype)
        vocab_size = model_config.hf_text_config.vocab_size
        self.logits_processor = LogitsProcessor(vocab_size,
                                                logits_as_input=True)
        self.sampler = SpyreSampler()
        self.tp_size = vllm_config.parallel_config.tensor_parallel_size
        self.model_path = model_config.model
        self.hf_config = model_config.hf_config
        #: The sliding window every attention layer applies (0: none): in
        #: the static steps' masks (``spyre_inputs``), given to the paged
        #: ops as ``spyre_window``, and in a whole prompt's mask.
        self.window = spyre_config.sliding_window
        #: Whether the graphs hold the weights as constants (inductor
        #: freezing) rather than reading them as inputs.
        self.frozen = False
        #: Whether the model runs on the project's C++ kernels.
        self.native, why = native.in_use(spyre_config.dynamo_backend,
                                         spyre_config.native_kernels)
        logger.info("Spyre native CPU kernels %s (%s)",
                    "in use" if self.native else "not in use", why)
        #: A hybrid model's Mamba-2 state geometry (None without such
        #: layers) and which of its layers they are (``spyre_mamba``);
        #: ``_build`` reads them off an FMS model.
        self.state_layout: Optional[spyre_mamba.StateLayout] = None
        self.is_ssm: list[bool] = []
        self.model = self._compile(self._build(vllm_config))
        #: One key/value cache per (batch size, cache length).
        self.kv_caches: dict[tuple[int, int], list] = {}
        #: The cache of the running batch.
        self.kv_cache: Optional[list] = None
        #: A hybrid model's Mamba-2 states, one slot per row, per batch
        #: size; those of the running batch.
        self.state_pools: dict[int, spyre_mamba.StatePool] = {}
        self.state_pool: Optional[spyre_mamba.StatePool] = None

    def _build(self, vllm_config: VllmConfig) -> nn.Module:
        """Loads the FMS model (``fms_model``), puts it on the kernels or
        oneDNN, registers its attention ops and reads its cache layout;
        returns the module to compile."""
        model_config = vllm_config.model_config
        self.fms_model = spyre_loader.load_fms_decoder(
            model_config.model, model_config.hf_config, self.precision,
            self.tp_size, self.spyre_config.dynamo_backend)
        logger.info("Spyre model implementation: FMS (%s)",
                    type(self.fms_model).__name__)
        #: FMS attention op of every forward.
        self.attn_name = self.ATTN_NAMES[0]
        if self.native:
            self._use_cpu_kernels()
        else:
            self._bf16_products()
        # Linear layers read in a narrower dtype that neither took.
        spyre_linear.widen_linears(self.fms_model, self.dtype)
        self._register_attention()
        self.cache_layout = CacheLayout.of(self.fms_model)
        self.state_layout = spyre_mamba.StateLayout.of(self.fms_model)
        self.is_ssm = (spyre_mamba.layer_kinds(self.fms_model)
                       if self.state_layout else [])
        return self.fms_model

    def _use_cpu_kernels(self) -> None:
        """The CPU backends: linear layers go to the packed CPU kernel
        (``spyre_linear``), their weights packed in ``precision.linear``,
        and decode attention to its companion kernel.  Under ``eager``,
        which fuses nothing, the norms and rotary embeddings run on
        kernels too (``spyre_fused_ops``); ``inductor`` fuses them
        itself."""
        start = time.perf_counter()
        n = spyre_linear.pack_linears(self.fms_model, self.precision.linear)
        self.attn_name = self.ATTN_NAMES[1]
        logger.info("Packed the weights of %d linear layers in %s in %.1f s",
                    n, str(self.precision.linear).removeprefix("torch."),
                    time.perf_counter() - start)
        if self.spyre_config.dynamo_backend == "eager":
            norms, rotaries = spyre_fused_ops.use_fused_ops(self.fms_model)
            logger.info("Norms (%d) and rotary embeddings (%d) on the CPU "
                        "kernels", norms, rotaries)

    def _bf16_products(self) -> None:
        """bfloat16 products under a float32 model off the kernels
        (``VLLM_SPYRE_NATIVE_KERNELS=0``, or no C++ compiler): through
        oneDNN (``Bf16Linear``, whose outputs are rounded to bfloat16)."""
        if self.precision.linear != torch.bfloat16 or \
                self.precision.model == torch.bfloat16:
            return
        spyre_linear.bf16_linears(self.fms_model)

    @staticmethod
    def _register_attention() -> None:
        static_cache.register()

    def _compile(self, model: nn.Module):
        """The compiled model (``compile_graphs``): each warm-up shape needs
        two graphs (prefill, decode), with room for every configured shape.
        With ``inductor`` the weights are frozen into the graphs unless the
        graph cache is on (a cached graph cannot hold them) or
        ``VLLM_SPYRE_INDUCTOR_FREEZING=0`` keeps them graph inputs (for
        weights updated in place)."""
        backend = self.spyre_config.dynamo_backend
        cache = self._graph_cache(backend)
        self.frozen = (backend == "inductor" and cache is None
                       and self.spyre_config.inductor_freezing)
        limit = max(64, 8 * len(self.spyre_config.warmup_shapes))
        return compile_graphs(model, backend, cache_size_limit=limit,
                              freeze=self.frozen, cache=cache,
                              fullgraph=self.whole_graphs)

    def _graph_cache(self, backend: str):
        """This rank's entry of the graph cache, or None when it is off
        (or the backend is sendnn, whose cache is torch_sendnn's)."""
        directory = self.spyre_config.graph_cache_dir
        if directory is None or backend == "sendnn":
            return None
        from vllm.distributed import get_tensor_model_parallel_rank
        parts = spyre_graph_cache.key_parts(
            model=self.model_path,
            hf_config=self.hf_config,
            backend=backend,
            options={"freezing": False, "cpp_wrapper": backend == "inductor",
                     "attention": self.attn_name},
            tp_size=self.tp_size,
            dtype=self.served_dtype)
        return spyre_graph_cache.GraphCache(
            directory, parts, rank=get_tensor_model_parallel_rank())

    # ---- weights ---------------------------------------------------------
    def update_weights_in_place(self, state_dict) -> int:
        """Loads new weights (Hugging Face naming, full tensors; this rank
        keeps its shard) into the compiled model without recompiling
        (``spyre_weight_update``); returns how many tensors were loaded.
        A state dict that does not match the checkpoint is refused with the
        old weights kept."""
        backend = self.spyre_config.dynamo_backend
        family = spyre_families.family_of(self.hf_config)
        if backend == "sendnn":
            raise NotImplementedError(
                "In-place weight updates with the sendnn backend are not "
                "supported on Spyre")
        if not family.serves_checkpoint_layout:
            raise NotImplementedError(
                f"In-place weight updates of {family.hf_architecture} "
                "models are not supported on Spyre")
        if self.frozen:
            raise NotImplementedError(
                "In-place weight updates of a model compiled with its "
                "weights frozen into the graphs (inductor freezing) are not "
                "supported on Spyre: start the engine with "
                "VLLM_SPYRE_INDUCTOR_FREEZING=0 (or the graph cache on, "
                "TORCH_SENDNN_CACHE_ENABLE=1), which keep the weights graph "
                "inputs")
        layout = spyre_weight_update.CheckpointLayout.read(
            self.model_path, self.hf_config)
        spyre_weight_update.check_state_dict(state_dict, layout)
        return spyre_weight_update.load_in_place(
            self.fms_model, state_dict, layout,
            architecture=family.fms_architecture, source=family.source,
            tensor_parallel=self.tp_size > 1)

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

    def require_precompiled(self) -> None:
        """Strict mode (``VLLM_SPYRE_REQUIRE_PRECOMPILED=1``): refuses to
        start, listing every graph the cache lacks, before compiling any."""
        if not self.spyre_config.require_precompiled:
            return
        cache = self.model.cache
        missing = [
            what for name, what in self.expected_graphs().items()
            if not cache.has(name)
        ]
        if missing:
            raise RuntimeError(
                f"VLLM_SPYRE_REQUIRE_PRECOMPILED=1: {len(missing)} graph(s) "
                f"are missing from the graph cache {cache.dir} "
                f"(rank {cache.rank}): {'; '.join(missing)}. Start once "
                "without VLLM_SPYRE_REQUIRE_PRECOMPILED (same model, "
                "backend, shapes and tensor parallel size) to fill it.")

    def graph_cache_stats(self) -> dict[str, int]:
        """Graphs loaded, compiled and rejected by the cache since start
        (empty when it is off)."""
        cache = getattr(self.model, "cache", None)
        return dict(cache.stats) if cache is not None else {}

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
                cache_len: int, is_prompt: bool) -> torch.Tensor:
        """Runs one step of the whole padded batch.

        input_ids, positions: [B, L]; mask: [B, L, kv_len] (True = attend);
        cache_slots: [L], the cache slots this step writes.
        Returns the next-token logits of every row: [B, vocab].
        """
        if is_prompt:
            self.kv_cache = self._cache_for(input_ids.shape[0], cache_len)
        elif self.kv_cache is None:
            raise RuntimeError("decode step without a prefill")
        logits, _ = self.model(
            self.graph_name(is_prompt, input_ids.shape[0],
                            input_ids.shape[1], cache_len),
            input_ids,
            position_ids=positions,
            past_key_value_states=self._layer_caches(is_prompt, positions),
            use_cache=True,
            last_n_tokens=1,
            mask=mask,
            attn_name=self.attn_name,
            cache_slots=cache_slots,
            spyre_prefill=is_prompt,
        )
        return logits[:, -1, :]  # [B, vocab]

    # ---- prompt log-probabilities (``spyre_prompt_logprobs``) -----------
    def prompt_hidden(self, ids: torch.Tensor) -> torch.Tensor:
        """The last hidden states of one whole prompt (``[1, L]``), run
        uncompiled and without a cache: ``[1, L, hidden]``."""
        hidden, _ = self.fms_model.base_model(
            ids, torch.arange(ids.shape[1]).unsqueeze(0), None, False,
            **self._prompt_mask(ids.shape[1]))
        return hidden

    def _prompt_mask(self, length: int) -> dict:
        """FMS's attention is causal over the whole prompt; a sliding
        window needs its own mask."""
        return ({"mask": causal_mask(length, self.window)} if self.window
                else {})

    def prompt_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits of ``[1, n, hidden]`` hidden states: ``[n,
        vocab]``."""
        logits = self.fms_model.head(hidden)[0].float()
        scale = getattr(self.fms_model.config, "logits_scaling", 1.0)
        return logits / scale if scale != 1.0 else logits

    def compute_logits(self, hidden_states: torch.Tensor,
                       sampling_metadata: SamplingMetadata) -> torch.Tensor:
        return self.logits_processor(None, hidden_states, sampling_metadata)

    def sample(self, logits: torch.Tensor,
               sampling_metadata: SamplingMetadata) -> SamplerOutput:
        return self.sampler(logits, sampling_metadata)
