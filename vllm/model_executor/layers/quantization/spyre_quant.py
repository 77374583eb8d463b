"""Quantized checkpoints on Spyre's CPU backends: GPTQ and compressed-tensors.

A checkpoint whose ``config.json`` has a ``quantization_config`` loads by
it, as with vLLM elsewhere; ``--quantization`` may name its method
(``gptq``, ``compressed-tensors``), and a different name is vLLM's own
mismatch error.  The formats:

* **GPTQ** (``quant_method: gptq``): 4 or 8 bits, symmetric or not, group
  size 128 (or any other; a last group may be shorter) or -1 (one scale
  per output channel), ``desc_act: false``; checkpoint format ``gptq``
  (zero points stored minus one) or ``gptq_v2``; ``lm_head: true``
  quantizes the output head too.
* **compressed-tensors** (``quant_method: compressed-tensors``), as
  llm-compressor and fms-model-optimizer write it:
  ``float-quantized`` FP8 (``float8_e4m3fn`` weights with a per-tensor or
  per-channel ``weight_scale``; inputs quantized with a static per-tensor
  ``input_scale``, dynamically per token, or not at all) and
  ``pack-quantized`` int8 or int4 weight-only (symmetric, per channel or
  per group).

``SpyreQuantConfig`` is registered as vLLM quantization method ``spyre``
(``install``, a ``vllm.general_plugins`` entry point): its
``override_quantization_method`` claims those checkpoints, so vLLM's model
code is built with ``SpyreQuantLinearMethod`` in every quantized linear
layer.  That method creates the checkpoint's tensors with vLLM's parameter
classes, so the layers' own weight loaders shard codes and scales under
tensor parallelism and fill the fused q/k/v and gate/up layers shard by
shard.  After loading it turns them into one ``QuantWeight`` per layer
(codes ``[N, K]``, scales and zero points per group and output), and
``finish`` puts it on the quantized kernel (``spyre_quant_linear``) or,
off the kernels, dequantizes it once.  Anything else (another bit width,
``desc_act``, int8 activations, a quantized KV cache, ...) is refused when
the config is read, with the value and what is supported.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from vllm.logger import init_logger
from vllm.model_executor.layers import linear as vllm_linear
from vllm.model_executor.layers.linear import (LinearBase,
                                               UnquantizedLinearMethod)
from vllm.model_executor.layers.quantization.base_config import (
    QuantizationConfig, QuantizeMethodBase)
from vllm.model_executor.layers.quantization.spyre_quant_method import (
    SpyreQuantLinearMethod)
from vllm.model_executor.layers.quantization.spyre_quant_schemes import (
    METHODS, NAME, SUPPORTED, Scheme, UnsupportedQuantization,
    compressed_tensors_schemes, gptq_scheme)
from vllm.model_executor.layers.vocab_parallel_embedding import (
    ParallelLMHead)

logger = init_logger(__name__)

__all__ = ["METHODS", "NAME", "SUPPORTED", "Scheme", "SpyreQuantConfig",
           "SpyreQuantLinearMethod", "UnsupportedQuantization",
           "finish_quantized_layers", "install"]


# ---- the vLLM quantization method -------------------------------------------
class SpyreQuantConfig(QuantizationConfig):
    """vLLM quantization method ``spyre``: GPTQ and compressed-tensors
    checkpoints on the Spyre CPU backends."""

    def __init__(self, method: str, config: dict[str, Any]) -> None:
        super().__init__()
        self.method = method
        self.config = config
        self.gptq: Optional[Scheme] = None
        self.targets: dict[str, Scheme] = {}
        self.ignore: list[str] = []
        if method == "gptq":
            self.gptq = gptq_scheme(config)
            self.head_quantized = bool(config.get("lm_head", False))
        elif method == "compressed-tensors":
            self.targets, self.ignore = compressed_tensors_schemes(config)
            from vllm.model_executor.layers.quantization \
                .compressed_tensors.utils import should_ignore_layer
            self.head_quantized = not should_ignore_layer(
                "lm_head", ignore=self.ignore) and any(
                    t in ("Linear", "lm_head") for t in self.targets)
        else:
            raise UnsupportedQuantization(f"quant_method {method!r}")
        #: ``SpyreQuantLinearMethod.finish``'s ``(native, round_inputs)``
        #: for each layer as soon as its tensors are loaded, or None: each
        #: waits for ``finish_quantized_layers``.
        self.finish_options: Optional[tuple[bool, bool]] = None

    def finish_on_load(self, native: bool, round_inputs: bool) -> None:
        """Puts each layer on the kernel (``finish``) as soon as its
        tensors are loaded, so that the model never holds every layer's
        unpacked codes and their packed copies at once."""
        self.finish_options = (native, round_inputs)

    def __repr__(self) -> str:
        return f"SpyreQuantConfig({self.method}: {self.describe()})"

    def describe(self) -> str:
        schemes = [self.gptq] if self.gptq else list(self.targets.values())
        return "; ".join(sorted({s.describe() for s in schemes}))

    def get_name(self) -> str:
        return NAME

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        # The served dtype (spyre_dtypes) is float32 or bfloat16; float16,
        # what GPTQ checkpoints declare, is served in float32.
        return [torch.float32, torch.bfloat16, torch.float16]

    @classmethod
    def get_min_capability(cls) -> int:
        return 0

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "SpyreQuantConfig":
        method = str(config.get("quant_method", "")).lower().replace(
            "compressed_tensors", "compressed-tensors")
        return cls(method, config)

    @classmethod
    def override_quantization_method(cls, hf_quant_cfg,
                                     user_quant) -> Optional[str]:
        """Claims GPTQ and compressed-tensors checkpoints on Spyre, unless
        ``--quantization`` names another method (vLLM then reports the
        mismatch)."""
        from vllm.platforms import current_platform
        from vllm.config.spyre import PLATFORM_QUALNAME
        platform = type(current_platform)
        if f"{platform.__module__}.{platform.__qualname__}" != \
                PLATFORM_QUALNAME:
            return None
        method = str(hf_quant_cfg.get("quant_method", "")).lower()
        if method in METHODS and user_quant in (None, NAME, method):
            return NAME
        return None

    def scheme_for(self, layer: nn.Module, prefix: str) -> Optional[Scheme]:
        """The scheme of the layer named ``prefix``; None: unquantized."""
        if isinstance(layer, ParallelLMHead):
            if not self.head_quantized or _tied_embeddings():
                # A tied head is the (float) token embedding: vLLM loads no
                # lm_head tensors for it.
                return None
            if self.gptq:
                return self.gptq
            return self.targets.get("lm_head") or self.targets.get("Linear")
        if self.gptq:
            return self.gptq
        from vllm.model_executor.layers.quantization.compressed_tensors \
            .utils import find_matched_target, should_ignore_layer
        mapping = self.packed_modules_mapping
        if should_ignore_layer(prefix, ignore=self.ignore,
                               fused_mapping=mapping):
            return None
        try:
            target = find_matched_target(prefix, layer, self.targets,
                                         fused_mapping=mapping)
        except ValueError:
            return None
        return self.targets[target]

    def get_quant_method(self, layer: nn.Module,
                         prefix: str) -> Optional[QuantizeMethodBase]:
        if not isinstance(layer, (LinearBase, ParallelLMHead)):
            return None
        scheme = self.scheme_for(layer, prefix)
        if scheme is None:
            return (None if isinstance(layer, ParallelLMHead) else
                    UnquantizedLinearMethod())
        return SpyreQuantLinearMethod(self, scheme)


def _tied_embeddings() -> bool:
    """Whether the model being built ties its output head to its token
    embedding."""
    from vllm.config import get_current_vllm_config
    model_config = get_current_vllm_config().model_config
    return model_config is not None and bool(
        getattr(model_config.hf_text_config, "tie_word_embeddings", False))


def finish_quantized_layers(model: nn.Module, native: bool,
                            round_inputs: bool = False) -> int:
    """``SpyreQuantLinearMethod.finish`` on every quantized layer of
    ``model`` not finished as it was loaded (``finish_on_load``); returns
    how many quantized layers the model has."""
    done = 0
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if not isinstance(method, SpyreQuantLinearMethod):
            continue
        if hasattr(module, "spyre_quant"):
            method.finish(module, native, round_inputs)
        done += int(method.finished(module))
    return done


_installed = False


def install() -> None:
    """The ``vllm.general_plugins`` entry point: registers ``spyre`` as a
    vLLM quantization method (once per process), and loads its layers'
    tensors with the parameter-aware loaders."""
    global _installed
    if _installed:
        return
    from vllm.model_executor.layers.quantization import (
        QUANTIZATION_METHODS, register_quantization_config)
    if NAME not in QUANTIZATION_METHODS:
        register_quantization_config(NAME)(SpyreQuantConfig)
    if SpyreQuantLinearMethod.__name__ not in \
            vllm_linear.WEIGHT_LOADER_V2_SUPPORTED:
        vllm_linear.WEIGHT_LOADER_V2_SUPPORTED.append(
            SpyreQuantLinearMethod.__name__)
    _installed = True

