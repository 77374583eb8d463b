"""Loading vLLM's own model class for Spyre (``--model-impl vllm``).

vLLM's model loader builds the model class of the checkpoint's
architecture (``LlamaForCausalLM``, ``Qwen2ForCausalLM``, ...) under the
current vLLM config, so its attention layers take the platform's backend
(``spyre_attn``) and its parallel layers this rank's shards, then loads
the weights with the class's own ``load_weights``.  The model is built in
the dtype its tensors are held in on Spyre (``spyre_dtypes``), which on
the CPU may differ from the dtype served.
"""
from __future__ import annotations

import copy
import time

import torch
from torch import nn

from vllm.config import VllmConfig
from vllm.logger import init_logger

logger = init_logger(__name__)


def load_vllm_decoder(vllm_config: VllmConfig,
                      dtype: torch.dtype) -> nn.Module:
    """vLLM's model of the configured checkpoint, its tensors in
    ``dtype``, this rank's shard under tensor parallelism, frozen."""
    from vllm.model_executor.model_loader import get_model_loader
    model_config = copy.copy(vllm_config.model_config)
    model_config.dtype = dtype
    model_config.model_impl = "vllm"
    start = time.perf_counter()
    loader = get_model_loader(vllm_config.load_config)
    model = loader.load_model(vllm_config=vllm_config,
                              model_config=model_config)
    model.requires_grad_(False)
    logger.info("Loaded vLLM model %s from %s in %.1f s",
                type(model).__name__, model_config.model,
                time.perf_counter() - start)
    return model
