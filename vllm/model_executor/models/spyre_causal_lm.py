"""SpyreCausalLM: what every Spyre decoder LM shares, whatever its cache.

A Spyre causal LM is composed of its model code (``spyre_model_code``:
FMS's or vLLM's own, as ``--model-impl`` chose), its cache and its compiled
graphs.  This base holds the model code and the graphs: the dtype served,
the model code's module compiled with ``torch.compile``
(``vllm.compilation.spyre_compile``, through this rank's entry of the
graph cache when it is on), the strict-cache check, in-place weight
updates, a whole prompt's hidden states and logits, and vLLM's
``LogitsProcessor`` and sampler (``SpyreSampler`` takes all-greedy steps on
a shorter path with the same result).  Each mode adds its cache, its
graphs' names and its step: ``SpyreStaticCausalLM`` (a cache per warm-up
shape) and ``SpyreCBCausalLM`` (continuous batching's block pool).
"""
from __future__ import annotations

from types import ModuleType

import torch
from torch import nn

from vllm.compilation import spyre_graph_cache
from vllm.compilation.spyre_compile import compile_graphs
from vllm.config import VllmConfig
from vllm.config.spyre import SpyreConfig
from vllm.config.spyre_model_facts import VLLM, SpyreModelFacts
from vllm.logger import init_logger
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.sampler import SamplerOutput
from vllm.model_executor.layers.spyre_sampler import SpyreSampler
from vllm.model_executor.models.spyre_dtypes import (precision_of,
                                                     serving_dtype)
from vllm.model_executor.models.spyre_fms_model_code import FmsModelCode
from vllm.model_executor.models.spyre_model_code import ModelCode
from vllm.model_executor.models.spyre_vllm_model_code import VllmModelCode
from vllm.model_executor.sampling_metadata import SamplingMetadata
from vllm.spyre_kernels import ops as native

logger = init_logger(__name__)


def model_code_for(facts: SpyreModelFacts) -> type[ModelCode]:
    """The model code the platform chose (``SpyreModelFacts.model_impl``)."""
    if facts.model_impl == VLLM:
        return VllmModelCode
    return FmsModelCode


class SpyreCausalLM(nn.Module):
    """A decoder's model code, compiled for the configured backend."""

    #: The FMS attention ops of the mode's cache (``spyre_static_cache``
    #: or ``spyre_paged_cache``).
    attention: ModuleType

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
        facts = SpyreModelFacts.from_vllm_config(vllm_config)
        #: The sliding window every attention layer applies (0: none): in
        #: the static steps' masks (``spyre_static_inputs``), given to the
        #: paged ops as ``spyre_window``, and in a whole prompt's mask.
        self.window = facts.sliding_window
        #: Whether the graphs hold the weights as constants (inductor
        #: freezing) rather than reading them as inputs.
        self.frozen = False
        #: Whether the model runs on the project's C++ kernels.
        self.native, why = native.in_use(spyre_config.dynamo_backend,
                                         spyre_config.native_kernels)
        logger.info("Spyre native CPU kernels %s (%s)",
                    "in use" if self.native else "not in use", why)
        #: The model code (FMS's or vLLM's), which holds the weights.
        self.code = model_code_for(facts)(vllm_config, spyre_config,
                                          self.precision, self.native,
                                          self.attention)
        module = self.code.build()
        #: The LoRA adapters (``--enable-lora``), else None.
        self.lora = self.code.lora
        #: Every attention layer's cache geometry; a hybrid model's Mamba-2
        #: state geometry (None without such layers) and which of its
        #: layers they are (``spyre_mamba``).
        self.cache_layout = self.code.cache_layout
        self.state_layout = self.code.state_layout
        self.is_ssm = self.code.is_ssm
        #: The compiled graphs.
        self.model = self._compile(module)

    def _compile(self, model: nn.Module):
        """The compiled model (``compile_graphs``): each warm-up shape needs
        two graphs (prefill, decode), with room for every configured shape.
        With ``inductor`` the weights are frozen into the graphs unless the
        graph cache is on (a cached graph cannot hold them),
        ``VLLM_SPYRE_INDUCTOR_FREEZING=0`` keeps them graph inputs (for
        weights updated in place), or LoRA adapters are on (freezing would
        fold the adapters' tensors, which change while serving, into
        constants)."""
        backend = self.spyre_config.dynamo_backend
        cache = self._graph_cache(backend)
        self.frozen = (backend == "inductor" and cache is None
                       and self.spyre_config.inductor_freezing
                       and self.lora is None)
        limit = max(64, 8 * len(self.spyre_config.warmup_shapes))
        return compile_graphs(model, backend, cache_size_limit=limit,
                              freeze=self.frozen, cache=cache,
                              fullgraph=self.code.whole_graphs)

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
                     "attention": self.code.attn_name,
                     "lora": self.lora.slots if self.lora else None,
                     **({"hidden": True} if self.code.keeps_hidden else {})},
            tp_size=self.tp_size,
            dtype=self.served_dtype)
        return spyre_graph_cache.GraphCache(
            directory, parts, rank=get_tensor_model_parallel_rank())

    # ---- weights, and a whole prompt (``spyre_prompt_logprobs``) -------
    def update_weights_in_place(self, state_dict) -> int:
        """New weights (Hugging Face naming, full tensors; this rank keeps
        its shard) into the compiled model without recompiling; how many
        tensors were loaded (``ModelCode.update_weights_in_place``)."""
        return self.code.update_weights_in_place(state_dict, self.frozen)

    def prompt_hidden(self, ids: torch.Tensor) -> torch.Tensor:
        return self.code.prompt_hidden(ids)

    def prompt_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.code.prompt_logits(hidden)

    # ---- graphs ---------------------------------------------------------
    def expected_graphs(self) -> dict[str, str]:
        """Every graph warm-up will run: name -> what it serves."""
        raise NotImplementedError

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

    def compute_logits(self, hidden_states: torch.Tensor,
                       sampling_metadata: SamplingMetadata) -> torch.Tensor:
        return self.logits_processor(None, hidden_states, sampling_metadata)

    def sample(self, logits: torch.Tensor,
               sampling_metadata: SamplingMetadata) -> SamplerOutput:
        return self.sampler(logits, sampling_metadata)
