"""Loading vLLM's own model class for Spyre (``--model-impl vllm``).

vLLM's model loader builds the model class of the checkpoint's
architecture (``LlamaForCausalLM``, ``Qwen2ForCausalLM``, ...) under the
current vLLM config, so its attention layers take the platform's backend
(``spyre_attn``) and its parallel layers this rank's shards, then loads
the weights with the class's own ``load_weights``.  The model is built in
the dtype its tensors are held in on Spyre (``spyre_dtypes``), which on
the CPU may differ from the dtype served.

Safetensors files are read one tensor at a time, each file mapped only
while its tensor is copied out (``SpyreModelLoader``): vLLM's own
iterator keeps a file mapped while it walks all of its tensors, and every
page it touched stays resident until the file is done, a whole
checkpoint file on top of the model being built.
"""
from __future__ import annotations

import copy
import time
from typing import Generator

import torch
from torch import nn

from vllm.config import VllmConfig
from vllm.logger import init_logger
from vllm.model_executor.model_loader.default_loader import \
    DefaultModelLoader

logger = init_logger(__name__)


def tensor_by_tensor(
        files: list[str]) -> Generator[tuple[str, torch.Tensor], None, None]:
    """Every tensor of the safetensors ``files``, each read from a file
    mapped only while it is copied out."""
    from safetensors import safe_open
    for file in files:
        with safe_open(file, framework="pt") as f:
            names = list(f.keys())
        for name in names:
            with safe_open(file, framework="pt") as f:
                tensor = f.get_tensor(name)
            yield name, tensor


class SpyreModelLoader(DefaultModelLoader):
    """vLLM's default loader, reading safetensors checkpoints with
    ``tensor_by_tensor``, timing the weights' read for the load's log
    line (``weights_seconds``)."""

    #: Seconds the last ``load_weights`` took: each tensor read and put
    #: in its parameter (a quantized layer finished as it is loaded, where
    #: its method does so).
    weights_seconds: float = 0.0

    def load_weights(self, model: nn.Module, model_config) -> None:
        start = time.perf_counter()
        super().load_weights(model, model_config)
        self.weights_seconds = time.perf_counter() - start

    def _get_weights_iterator(
            self, source: DefaultModelLoader.Source
    ) -> Generator[tuple[str, torch.Tensor], None, None]:
        """Upstream's, but for safetensors files: they are read one tensor
        at a time (the module docstring says why)."""
        if self.load_config.load_format not in ("auto", "safetensors"):
            yield from super()._get_weights_iterator(source)
            return
        _, files, use_safetensors = self._prepare_weights(
            source.model_or_path, source.revision, source.fall_back_to_pt,
            source.allow_patterns_overrides)
        if not use_safetensors:
            yield from super()._get_weights_iterator(source)
            return
        if self.counter_before_loading_weights == 0.0:
            self.counter_before_loading_weights = time.perf_counter()
        prefix = source.prefix
        for name, tensor in tensor_by_tensor(files):
            yield prefix + name, tensor


def load_vllm_decoder(vllm_config: VllmConfig,
                      dtype: torch.dtype) -> nn.Module:
    """vLLM's model of the configured checkpoint, its tensors in
    ``dtype``, this rank's shard under tensor parallelism, frozen."""
    from vllm.model_executor.model_loader import get_model_loader
    model_config = copy.copy(vllm_config.model_config)
    model_config.dtype = dtype
    model_config.model_impl = "vllm"
    start = time.perf_counter()
    load_config = vllm_config.load_config
    loader = (SpyreModelLoader(load_config)
              if load_config.load_format in ("auto", "safetensors") else
              get_model_loader(load_config))
    model = loader.load_model(vllm_config=vllm_config,
                              model_config=model_config)
    model.requires_grad_(False)
    total = time.perf_counter() - start
    weights = getattr(loader, "weights_seconds", None)
    if weights is None:
        logger.info("Loaded vLLM model %s from %s in %.1f s",
                    type(model).__name__, model_config.model, total)
    else:
        logger.info(
            "Loaded vLLM model %s from %s in %.1f s (reading the weights: "
            "%.1f s; building the model and finishing its layers, "
            "quantized codes packed: %.1f s)",
            type(model).__name__, model_config.model, total, weights,
            total - weights)
    return model
