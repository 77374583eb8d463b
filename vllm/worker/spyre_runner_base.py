"""What every Spyre model runner shares: ``SpyreRunnerBase`` and the
helpers of a step.

The static-batching, continuous-batching and pooling runners each subclass
``SpyreRunnerBase``, which holds the settings, loads the runner's
``model_cls`` under the vLLM config, keeps per-request generators and the
start-up timings, says where the graphs came from (compiled or the graph
cache), and takes vLLM's ``execute_model`` call (one step, rebuilt from
the broadcast on other ranks) to the runner's ``run_step``.
``SpyreModelInputBase`` is every runner's step input, sent from the driver
to the other ranks as one flat dict.  ``pad_token_id``, ``sample`` (vLLM's
logits processor and sampler over the live rows) and ``only_seq`` serve
their steps.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, ClassVar, Optional

import torch
from torch import nn

from vllm.config import VllmConfig, set_current_vllm_config
from vllm.config.spyre import SpyreConfig, WarmupShape
from vllm.config.spyre_model_facts import VLLM, SpyreModelFacts
from vllm.logger import init_logger
from vllm.model_executor.layers.sampler import SamplerOutput
from vllm.model_executor.sampling_metadata import SamplingMetadata
from vllm.platforms import current_platform
from vllm.sequence import IntermediateTensors, SequenceGroupMetadata
from vllm.worker.model_runner_base import (ModelRunnerBase,
                                           ModelRunnerInputBase, T)

logger = init_logger(__name__)


@dataclasses.dataclass(frozen=True)
class SpyreModelInputBase(ModelRunnerInputBase):
    """A step's input (a frozen dataclass), broadcast by the driver as one
    flat dict: each field under its name, except those in ``LOCAL`` (the
    sampling or pooling metadata, which only the driver uses) and those
    that are None (the default on the other ranks).  A field in ``NESTED``
    holds a dataclass of tensors, or with ``(cls, )`` a tuple of them:
    each of its fields goes under ``field.name`` (``field.i.name``), but
    those that are None; with ``dict`` a mapping of names to tensors, each
    under ``field.name.key``."""

    NESTED: ClassVar[dict[str, Any]] = {}
    LOCAL: ClassVar[tuple[str, ...]] = ()

    def as_broadcastable_tensor_dict(self) -> dict[str, Any]:
        flat: dict[str, Any] = {}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name in self.LOCAL or value is None:
                continue
            kind = self.NESTED.get(field.name)
            if kind is None:
                flat[field.name] = value
            elif kind is dict:
                flat[field.name] = len(value)
                flat.update({f"{field.name}.{key}": tensor
                             for key, tensor in value.items()})
            elif isinstance(kind, tuple):
                flat[field.name] = len(value)
                for i, item in enumerate(value):
                    flat.update(_flat(item, f"{field.name}.{i}."))
            else:
                flat.update(_flat(value, f"{field.name}."))
        return flat

    @classmethod
    def from_broadcasted_tensor_dict(cls, tensor_dict: dict[str, Any],
                                     attn_backend=None):
        kwargs: dict[str, Any] = {}
        for field in dataclasses.fields(cls):
            kind = cls.NESTED.get(field.name)
            if kind is None:
                if field.name in tensor_dict:
                    kwargs[field.name] = tensor_dict[field.name]
            elif kind is dict:
                if field.name in tensor_dict:
                    prefix = f"{field.name}."
                    kwargs[field.name] = {
                        key[len(prefix):]: value
                        for key, value in tensor_dict.items()
                        if key.startswith(prefix)}
            elif isinstance(kind, tuple):
                if field.name in tensor_dict:
                    kwargs[field.name] = tuple(
                        _unflat(kind[0], tensor_dict, f"{field.name}.{i}.")
                        for i in range(tensor_dict[field.name]))
            else:
                kwargs[field.name] = _unflat(kind, tensor_dict,
                                             f"{field.name}.")
        return cls(**kwargs)


def _flat(value, prefix: str) -> dict[str, Any]:
    return {prefix + f.name: getattr(value, f.name)
            for f in dataclasses.fields(value)
            if getattr(value, f.name) is not None}


def _unflat(cls, tensor_dict: dict[str, Any], prefix: str):
    """``cls`` from its fields under ``prefix``, or None if it was not
    sent."""
    names = [f.name for f in dataclasses.fields(cls)]
    if prefix + names[0] not in tensor_dict:
        return None
    return cls(**{name: tensor_dict[prefix + name] for name in names
                  if prefix + name in tensor_dict})


class SpyreRunnerBase(ModelRunnerBase[T]):
    """What every Spyre runner shares: the settings, the model load (of
    ``model_cls``), per-request generators and start-up timings."""

    #: The model class each runner loads (``SpyreStaticCausalLM``, ...).
    model_cls: type
    #: Whether that class runs vLLM's own model code too (``--model-impl
    #: vllm``; ``spyre_model_code``), not only FMS's.
    runs_vllm_model_code = False
    #: Whether it runs speculative decoding (``--speculative-config``).
    speculates = False
    #: The runner's model input, rebuilt on every other rank from the
    #: driver's broadcast (``from_broadcasted_tensor_dict``).
    input_cls: type

    def __init__(self, vllm_config: VllmConfig,
                 spyre_config: SpyreConfig) -> None:
        super().__init__(vllm_config)
        self.spyre_config = spyre_config
        #: The model code and sliding window the platform resolved.
        self.model_facts = SpyreModelFacts.from_vllm_config(vllm_config)
        self.generators: dict[str, torch.Generator] = {}
        self.model: Optional[nn.Module] = None
        self.pad_id = 0
        #: Seconds spent in each start-up phase ("load", "warmup ...").
        self.startup_timings: dict[str, float] = {}

    def load_model(self) -> None:
        if self.model_facts.model_impl == VLLM and \
                not self.runs_vllm_model_code:
            raise NotImplementedError(
                f"{type(self).__name__} does not run vLLM's model code")
        start = time.perf_counter()
        with set_current_vllm_config(self.vllm_config):
            self.model = self.model_cls(vllm_config=self.vllm_config,
                                        spyre_config=self.spyre_config)
        self.pad_id = pad_token_id(self.model_config)
        self.startup_timings["load"] = time.perf_counter() - start
        logger.info("Spyre model load took %.1f s",
                    self.startup_timings["load"])

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

    def warm_up_shapes(self, kind: str,
                       label: Callable[[WarmupShape], str]) -> None:
        """Runs ``_run_shape`` once per configured shape (``kind``, e.g.
        "shape" or "pooling shape", in the log; ``label`` names a shape)
        on random full-length prompts, logging and timing each: what
        serving will run, compiled (or loaded) before it starts."""
        from tqdm import tqdm
        assert self.model is not None
        shapes = self.spyre_config.warmup_shapes
        logger.info("Spyre warm-up: compiling %d %s(s) with backend %s",
                    len(shapes), kind, self.spyre_config.dynamo_backend)
        total = time.perf_counter()
        vocab = self.model_config.get_vocab_size()
        gen = torch.Generator().manual_seed(0)
        bar = tqdm(shapes, desc="Spyre warm-up", unit="shape")
        for done, shape in enumerate(bar, 1):
            start = time.perf_counter()
            before = self.model.graph_cache_stats()
            prompts = torch.randint(0, vocab,
                                    (shape.batch_size, shape.prompt_len),
                                    generator=gen).tolist()
            self._run_shape(shape, prompts)
            seconds = time.perf_counter() - start
            how, name = self.graph_source(before), label(shape)
            bar.set_postfix_str(f"{name}: {how}")
            self.startup_timings[f"warmup {name}"] = seconds
            logger.info(
                "Spyre warm-up of %s %s (%d/%d) took %.1f s (%s); "
                "%.1f s elapsed", kind, name, done, len(shapes), seconds,
                how, time.perf_counter() - total)
        logger.info("Spyre warm-up of %d shape(s) took %.1f s", len(shapes),
                    time.perf_counter() - total)

    def _run_shape(self, shape: WarmupShape,
                   prompts: list[list[int]]) -> None:
        """Warm-up of one shape (``warm_up_shapes``)."""
        raise NotImplementedError

    def sampling_metadata(self, metas: list[SequenceGroupMetadata],
                          seq_lens: Optional[list[int]],
                          query_lens: Optional[list[int]],
                          finished_requests_ids: Optional[list[str]]
                          ) -> SamplingMetadata:
        """vLLM's sampling metadata of a step's groups, with this runner's
        per-request generators."""
        return SamplingMetadata.prepare(
            metas,
            seq_lens,
            query_lens,
            self.device_config.device,
            pin_memory=False,
            generators=self.get_generators(finished_requests_ids))

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
