"""vLLM's linear layers on the Spyre CPU kernels (``--model-impl vllm``).

vLLM's model code multiplies through each layer's ``quant_method``
(``UnquantizedLinearMethod`` for the linear layers, including the
tensor-parallel ones, and ``UnquantizedEmbeddingMethod`` for the output
head).  ``use_spyre_linears`` swaps those for the methods below once the
weights are loaded, so the vLLM path reads its weights as the FMS path
does (``spyre_linear``):

* ``PackedLinearMethod``: the weight packed once for
  ``spyre_kernels::packed_linear``, in the precision's linear dtype (float32,
  or bfloat16 under ``--dtype bfloat16``; the kernel multiplies prompts
  on AMX tiles from the same packed weight where the CPU has them);
* ``Bf16LinearMethod``: off the kernels (``VLLM_SPYRE_NATIVE_KERNELS=0``,
  no C++ compiler), bfloat16 products on oneDNN where the precision asks
  for them.

The output head (the model's ``lm_head``: a ``ParallelLMHead``, or the
token embedding itself where the model ties them) gets
``PackedHeadMethod`` / ``Bf16HeadMethod``.  Each layer's own weight is
dropped once packed, except a weight the token embedding looks tokens up
in.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from vllm.model_executor.layers.linear import (LinearMethodBase,
                                               UnquantizedLinearMethod)
from vllm.model_executor.layers.spyre_linear import (onednn_bf16_linear,
                                                     pack_held)
from vllm.model_executor.layers.vocab_parallel_embedding import (
    ParallelLMHead, UnquantizedEmbeddingMethod, VocabParallelEmbedding)


def _packed(layer: nn.Module, x: torch.Tensor,
            bias: Optional[torch.Tensor]) -> torch.Tensor:
    return torch.ops.spyre_kernels.packed_linear(
        x, layer.spyre_packed, layer.spyre_out_features, bias)


def _bf16(layer: nn.Module, x: torch.Tensor,
          bias: Optional[torch.Tensor]) -> torch.Tensor:
    return onednn_bf16_linear(x, layer.spyre_bf16, bias)


class _AfterLoading(LinearMethodBase):
    """A method installed on a layer whose weights are loaded already."""

    def create_weights(self, layer, *args, **kwargs) -> None:
        raise RuntimeError(
            f"{type(self).__name__} is installed after the weights are "
            "loaded (use_spyre_linears), not at model construction")


class PackedLinearMethod(_AfterLoading):
    """The layer's weight packed for ``spyre_kernels::packed_linear``
    (buffer ``spyre_packed``, ``spyre_out_features`` columns)."""

    def apply(self, layer: nn.Module, x: torch.Tensor,
              bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        return _packed(layer, x, bias)


class Bf16LinearMethod(_AfterLoading):
    """The layer's weight in bfloat16 (buffer ``spyre_bf16``), its
    products on oneDNN."""

    def apply(self, layer: nn.Module, x: torch.Tensor,
              bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        return _bf16(layer, x, bias)


class PackedHeadMethod(UnquantizedEmbeddingMethod):
    """An output head's logits on the packed kernel.  The head may be the
    token embedding itself (a tied Qwen2 head), whose lookups keep reading
    its weight (``embedding``, inherited)."""

    def apply(self, layer: nn.Module, x: torch.Tensor,
              bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        return _packed(layer, x, bias)


class Bf16HeadMethod(UnquantizedEmbeddingMethod):
    """An output head's logits in bfloat16 products on oneDNN."""

    def apply(self, layer: nn.Module, x: torch.Tensor,
              bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        return _bf16(layer, x, bias)


def _heads(model: nn.Module) -> set[int]:
    """The output head the logits processor multiplies by: the model's
    ``lm_head``, a ``ParallelLMHead`` or, tied, the token embedding."""
    head = getattr(model, "lm_head", None)
    return {id(head)} if head is not None else set()


def use_spyre_linears(model: nn.Module, dtype: torch.dtype,
                      native: bool) -> int:
    """Puts every unquantized float32 linear layer of ``model`` and its
    output head on the packed kernel (``native``) with weights held in
    ``dtype``, or, off the kernels, on oneDNN's bfloat16 products when
    ``dtype`` is bfloat16.  Returns how many layers moved."""
    if not native and dtype != torch.bfloat16:
        return 0
    heads = _heads(model)
    looked_up = _embedding_weights(model)
    moved = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        method = getattr(module, "quant_method", None)
        is_head = id(module) in heads and \
            type(method) is UnquantizedEmbeddingMethod
        if not (is_head or type(method) is UnquantizedLinearMethod) or \
                weight is None or weight.dtype != torch.float32:
            continue
        if native and dtype == torch.bfloat16 and weight.shape[1] % 2:
            continue  # the bfloat16 kernel reads input features in pairs
        with torch.no_grad():
            if native:
                module.register_buffer("spyre_packed",
                                       pack_held(weight, dtype),
                                       persistent=False)
                module.spyre_out_features = weight.shape[0]
            if not native:
                module.register_buffer("spyre_bf16",
                                       weight.detach().to(torch.bfloat16),
                                       persistent=False)
        if is_head:
            module.quant_method = (PackedHeadMethod()
                                   if native else Bf16HeadMethod())
        else:
            module.quant_method = (PackedLinearMethod()
                                   if native else Bf16LinearMethod())
        if weight.data_ptr() not in looked_up:
            module.weight = nn.Parameter(weight.new_empty(0),
                                         requires_grad=False)
        moved += 1
    return moved


def _embedding_weights(model: nn.Module) -> set[int]:
    """Storage of every weight a token embedding looks tokens up in."""
    return {
        m.weight.data_ptr()
        for m in model.modules()
        if isinstance(m, VocabParallelEmbedding)
        and not isinstance(m, ParallelLMHead)
    }
