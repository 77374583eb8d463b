"""What every Spyre model runner shares: ``SpyreRunnerBase`` and the
helpers of a step.

The static-batching, continuous-batching and pooling runners each subclass
``SpyreRunnerBase``, which holds the settings, loads the runner's
``model_cls`` under the vLLM config, keeps per-request generators and the
start-up timings, says where the graphs came from (compiled or the graph
cache), and takes vLLM's ``execute_model`` call (one step, rebuilt from
the broadcast on other ranks) to the runner's ``run_step``.  ``pad_token_id``, ``sample`` (vLLM's logits processor and
sampler over the live rows) and ``only_seq`` serve their steps.
"""
from __future__ import annotations

import time
from typing import Any, Optional

import torch
from torch import nn

from vllm.config import VllmConfig, set_current_vllm_config
from vllm.config.spyre import SpyreConfig
from vllm.logger import init_logger
from vllm.model_executor.layers.sampler import SamplerOutput
from vllm.model_executor.models import spyre_model_impl
from vllm.model_executor.sampling_metadata import SamplingMetadata
from vllm.platforms import current_platform
from vllm.sequence import IntermediateTensors, SequenceGroupMetadata
from vllm.worker.model_runner_base import ModelRunnerBase, T

logger = init_logger(__name__)


class SpyreRunnerBase(ModelRunnerBase[T]):
    """What every Spyre runner shares: the settings, the model load (of
    ``model_cls``), per-request generators and start-up timings."""

    #: The model class each runner loads (``SpyreCausalLM``, ...).
    model_cls: type
    #: Its twin on vLLM's own model code (``--model-impl vllm``), if the
    #: mode has one.
    vllm_model_cls: Optional[type] = None
    #: The runner's model input, rebuilt on every other rank from the
    #: driver's broadcast (``from_broadcasted_tensor_dict``).
    input_cls: type

    def __init__(self, vllm_config: VllmConfig,
                 spyre_config: SpyreConfig) -> None:
        super().__init__(vllm_config)
        self.spyre_config = spyre_config
        self.generators: dict[str, torch.Generator] = {}
        self.model: Optional[nn.Module] = None
        self.pad_id = 0
        #: Seconds spent in each start-up phase ("load", "warmup ...").
        self.startup_timings: dict[str, float] = {}

    def load_model(self) -> None:
        start = time.perf_counter()
        with set_current_vllm_config(self.vllm_config):
            self.model = self.model_class()(vllm_config=self.vllm_config,
                                            spyre_config=self.spyre_config)
        self.pad_id = pad_token_id(self.model_config)
        self.startup_timings["load"] = time.perf_counter() - start
        logger.info("Spyre model load took %.1f s",
                    self.startup_timings["load"])

    def model_class(self) -> type:
        """``model_cls``, or its twin on vLLM's model code when the
        platform chose that (``SpyreConfig.model_impl``)."""
        if self.spyre_config.model_impl == spyre_model_impl.VLLM:
            if self.vllm_model_cls is None:
                raise NotImplementedError(
                    f"{type(self).__name__} does not run vLLM's model code")
            return self.vllm_model_cls
        return self.model_cls

    def get_model(self) -> nn.Module:
        assert self.model is not None
        return self.model

    def make_model_input_from_broadcasted_tensor_dict(
            self, tensor_dict: dict[str, Any]) -> T:
        return self.input_cls.from_broadcasted_tensor_dict(tensor_dict)

    @current_platform.inference_mode()
    def execute_model(
        self,
        model_input: T,
        kv_caches: Optional[list[torch.Tensor]] = None,
        intermediate_tensors: Optional[IntermediateTensors] = None,
        num_steps: int = 1,
        **kwargs,
    ) -> Optional[list]:
        """vLLM's entry to a step.  A Spyre runner runs one step per call
        (no multi-step scheduling) on the caches its model owns, so vLLM's
        ``kv_caches`` and ``intermediate_tensors`` are unused; the step is
        the runner's ``run_step``."""
        if num_steps > 1:
            raise NotImplementedError(
                "Multi-step scheduling is not supported on Spyre")
        return self.run_step(model_input)

    def run_step(self, model_input: T) -> Optional[list]:
        """One step of ``model_input``: the driver's outputs (sampled
        tokens or pooled vectors), ``[]`` on every other rank."""
        raise NotImplementedError

    def graph_source(self, before: dict[str, int]) -> str:
        """How the graphs run since ``before`` (the model's cache stats
        then) came to be: loaded from the graph cache, or compiled."""
        assert self.model is not None
        after = self.model.graph_cache_stats()
        if not after:
            return "compiled"
        compiled = after.get("compiled", 0) - before.get("compiled", 0)
        loaded = after.get("loaded", 0) - before.get("loaded", 0)
        if compiled and loaded:
            return f"{loaded} graph(s) cached, {compiled} compiled"
        return "compiled, now cached" if compiled else "cached"


def pad_token_id(model_config) -> int:
    """The token that fills padding positions: the model's pad token, else
    its end-of-sequence token, else 0."""
    hf = model_config.hf_text_config
    pad = getattr(hf, "pad_token_id", None)
    if pad is None:
        pad = getattr(hf, "eos_token_id", None)
    if isinstance(pad, list):
        pad = pad[0]
    return int(pad or 0)


def sample(model: nn.Module, logits: torch.Tensor,
           sampling_metadata: SamplingMetadata) -> SamplerOutput:
    """vLLM's logits processor and sampler over the live rows' logits
    ([N, vocab], in the order of the step's sequence groups)."""
    logits = model.compute_logits(logits, sampling_metadata)
    return model.sample(logits, sampling_metadata)


def only_seq(meta: SequenceGroupMetadata):
    if len(meta.seq_data) != 1:
        raise NotImplementedError(
            "Sequence groups of more than one sequence (beam search) are "
            "not supported on Spyre")
    return next(iter(meta.seq_data.values()))
