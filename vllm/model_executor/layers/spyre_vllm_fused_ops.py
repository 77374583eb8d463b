"""vLLM's RMS norms, rotary embeddings and gated activations on one kernel
each, for ``eager``, in vLLM's own model code (``--model-impl vllm``, and
the quantized checkpoints, which load through it).

On a platform that is not CUDA's, vLLM runs these custom ops' native
forwards, each a chain of PyTorch ops: an ``RMSNorm`` with its residual
is eleven (casts, the add, pow, mean, rsqrt, multiplies), a
``RotaryEmbedding`` about forty for a query and key (a gather, views,
slices, eight multiplies, adds and concatenations), ``SiluAndMul``
four.  ``eager`` has no compiler to fuse them, and at batch 1 their
dispatch is a share of the step beside the weights' reads.
``use_kernel_ops`` gives each such layer of a model its one-pass kernel
(``vllm/spyre_kernels/vllm_elementwise.cpp``), which takes the native
forward's steps in its order and dtypes, rounding where it rounds
(norms: only the order of the squares' sum differs; ``SiluAndMul``: the
exponential may differ in float32's last bit).  Layers of other kinds
(another activation, a subclass with its own forward, a norm without a
weight or with a variance size override) and calls the kernels do not
take (another dtype, offsets, heads not in rows) keep the native forward.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
from torch import nn
from vllm.model_executor.layers.activation import SiluAndMul
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.rotary_embedding import RotaryEmbedding

_FLOATS = (torch.float32, torch.bfloat16)


def _norm(norm: RMSNorm, x: torch.Tensor,
          residual: Optional[torch.Tensor] = None):
    if (x.dtype != norm.weight.dtype
            or (residual is not None and residual.dtype != x.dtype)):
        return norm.forward_native(x, residual)
    out, total = torch.ops.spyre_kernels.add_rms_norm(
        x, residual, norm.weight, norm.variance_epsilon)
    return out if residual is None else (out, total)


def _rotary(rope: RotaryEmbedding, positions: torch.Tensor,
            query: torch.Tensor, key: Optional[torch.Tensor] = None,
            offsets: Optional[torch.Tensor] = None):
    cache = rope.cos_sin_cache
    tokens = positions.numel()
    if (offsets is not None or positions.dtype != torch.long
            or query.dtype not in _FLOATS
            or cache.dtype not in _FLOATS or cache.device != query.device
            or query.dim() != 2 or query.size(0) != tokens
            or (key is not None and (key.dim() != 2
                                     or key.dtype != query.dtype))):
        return rope.forward_native(positions, query, key, offsets)
    q, k = torch.ops.spyre_kernels.rotary_cos_sin(
        positions.reshape(-1), query, key, cache, rope.head_size,
        rope.rotary_dim, rope.is_neox_style)
    return q, (k if key is not None else None)


def _silu_and_mul(act: SiluAndMul, x: torch.Tensor) -> torch.Tensor:
    if x.dtype not in _FLOATS:
        return act.forward_native(x)
    return torch.ops.spyre_kernels.silu_and_mul(x)


def _takes_norm(module: nn.Module) -> bool:
    return (type(module) is RMSNorm and module.has_weight
            and module.variance_size_override is None
            and module.weight.dtype in _FLOATS)


def _takes_rotary(module: nn.Module) -> bool:
    # Subclasses that only compute another table (Llama 3's, linear or
    # dynamic scaling) keep the base forward; the others have their own.
    return (isinstance(module, RotaryEmbedding)
            and type(module).forward_native is RotaryEmbedding.forward_native
            and type(module).forward is RotaryEmbedding.forward)


def use_kernel_ops(model: nn.Module) -> tuple[int, int, int]:
    """Puts the RMS norms, rotary embeddings and ``SiluAndMul`` layers of
    ``model`` that the kernels take on them; returns how many of each
    (a rotary embedding shared by several layers counts once)."""
    counts = [0, 0, 0]
    for module in model.modules():
        # CustomOp.forward calls the method it chose at construction.
        if _takes_norm(module):
            module._forward_method = functools.partial(_norm, module)
            counts[0] += 1
        elif _takes_rotary(module):
            module._forward_method = functools.partial(_rotary, module)
            counts[1] += 1
        elif type(module) is SiluAndMul:
            module._forward_method = functools.partial(_silu_and_mul, module)
            counts[2] += 1
    return counts[0], counts[1], counts[2]
