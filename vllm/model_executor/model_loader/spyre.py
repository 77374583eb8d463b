"""SpyreCausalLM: an FMS decoder, compiled with torch.compile, for vLLM.

The model runner calls ``forward`` once per engine step with the fixed-shape
tensors built by ``vllm.worker.spyre_inputs``: a prefill over a whole padded
batch starts a new KV cache, each decode step extends it by one position.
The cache of the running batch belongs to this module (``kv_cache``); it is
replaced at every prefill.  ``forward`` returns the next-token logits of
every row; vLLM's own ``LogitsProcessor`` and ``Sampler`` then run on the
rows that are still live, as in vLLM's Neuron backend.
"""
from __future__ import annotations

import time
from typing import Optional

import torch
from torch import nn

from vllm.config import VllmConfig
from vllm.logger import init_logger
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.sampler import Sampler, SamplerOutput
from vllm.model_executor.sampling_metadata import SamplingMetadata
from vllm.platforms.spyre_config import SpyreConfig

logger = init_logger(__name__)

_DTYPES_ON_CPU = (torch.float32, torch.bfloat16)


class SpyreCausalLM(nn.Module):
    """FMS causal LM, compiled for the configured backend."""

    def __init__(self, *, vllm_config: VllmConfig,
                 spyre_config: SpyreConfig) -> None:
        super().__init__()
        self.spyre_config = spyre_config
        model_config = vllm_config.model_config
        self.dtype = model_config.dtype
        if spyre_config.dynamo_backend != "sendnn" and \
                self.dtype not in _DTYPES_ON_CPU:
            logger.warning(
                "dtype %s is slow or unsupported on the CPU; using float32",
                self.dtype)
            self.dtype = torch.float32
        vocab_size = model_config.hf_text_config.vocab_size
        self.logits_processor = LogitsProcessor(vocab_size,
                                                logits_as_input=True)
        self.sampler = Sampler()
        self.tp_size = vllm_config.parallel_config.tensor_parallel_size
        self.fms_model = self._load(model_config.model)
        self.model = self._compile(self.fms_model)
        #: Keys and values of the running batch, one pair per layer.
        self.kv_cache: Optional[list] = None

    def _load(self, path: str) -> nn.Module:
        from fms.models import get_model
        start = time.perf_counter()
        parallel = {}
        if self.tp_size > 1:
            import torch.distributed as dist
            if self.spyre_config.dynamo_backend != "sendnn":
                _keep_embedding_whole()
            parallel = dict(distributed_strategy="tp", group=dist.group.WORLD)
        model = get_model("hf_pretrained", model_path=path,
                          data_type=self.dtype, device_type="cpu", **parallel)
        model.eval()
        model.requires_grad_(False)
        logger.info("Loaded FMS model %s from %s in %.1f s",
                    type(model).__name__, path,
                    time.perf_counter() - start)
        return model

    def _compile(self, model: nn.Module) -> nn.Module:
        backend = self.spyre_config.dynamo_backend
        if backend == "sendnn":
            import torch_sendnn  # noqa: F401  registers the backend
        # Each shape needs a few graphs (prefill, first decode, later
        # decodes); leave room for every configured shape.
        n = len(self.spyre_config.warmup_shapes)
        limit = max(64, 8 * n)
        torch._dynamo.config.cache_size_limit = max(
            torch._dynamo.config.cache_size_limit, limit)
        torch._dynamo.config.accumulated_cache_size_limit = max(
            torch._dynamo.config.accumulated_cache_size_limit, 4 * limit)
        return torch.compile(model, backend=backend)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                mask: torch.Tensor, is_prompt: bool) -> torch.Tensor:
        """Runs one step of the whole padded batch.

        input_ids, positions: [B, L]; mask: [B, L, kv_len] (True = attend).
        Returns the next-token logits of every row: [B, vocab].
        """
        past = None if is_prompt else self.kv_cache
        if not is_prompt:
            if past is None:
                raise RuntimeError("decode step without a prefill")
            _mark_kv_len_dynamic(past, mask)
        logits, self.kv_cache = self.model(
            input_ids,
            position_ids=positions,
            past_key_value_states=past,
            use_cache=True,
            last_n_tokens=1,
            mask=mask,
        )
        return logits[:, -1, :]  # [B, vocab]

    def compute_logits(self, hidden_states: torch.Tensor,
                       sampling_metadata: SamplingMetadata) -> torch.Tensor:
        return self.logits_processor(None, hidden_states, sampling_metadata)

    def sample(self, logits: torch.Tensor,
               sampling_metadata: SamplingMetadata) -> SamplerOutput:
        return self.sampler(logits, sampling_metadata)


def _keep_embedding_whole() -> None:
    """gloo (the CPU process group) lacks all_gather_into_tensor, which
    FMS's tensor-parallel word embedding needs: keep that module whole on
    every rank.  FMS reads DISTRIBUTED_STRATEGY_IGNORE_MODULES when
    fms.distributed.strategy is first imported, so a process that imported
    it already gets the module name added to the parsed list as well."""
    import os

    from fms.distributed import strategy
    names = [n for n in os.environ.get("DISTRIBUTED_STRATEGY_IGNORE_MODULES",
                                       "").split(",") if n]
    if "WordEmbedding" not in names:
        os.environ["DISTRIBUTED_STRATEGY_IGNORE_MODULES"] = ",".join(
            names + ["WordEmbedding"])
    ignored = strategy._distributed_strategy_ignore_modules
    if "WordEmbedding" not in ignored:
        ignored.append("WordEmbedding")


def _mark_kv_len_dynamic(past: list, mask: torch.Tensor) -> None:
    """The cache grows by one position per decode step: compile the decode
    graph for any cache length at once, instead of a first graph for one
    length and a recompile at the next.  [B, kv_heads, kv_len, head_dim]"""
    for keys, values in past:
        torch._dynamo.maybe_mark_dynamic(keys, 2)
        torch._dynamo.maybe_mark_dynamic(values, 2)
    torch._dynamo.maybe_mark_dynamic(mask, 2)  # [B, 1, kv_len]
