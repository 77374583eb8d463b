"""vLLM's RMS norms on one kernel each, for ``eager``, in vLLM's own model
code (``--model-impl vllm``, and the quantized checkpoints, which load
through it).

On a platform that is not CUDA's, vLLM runs ``RMSNorm``'s native forward:
a cast, the residual add, a cast back, pow, mean, add, rsqrt, multiply,
cast and the weight's multiply, each a PyTorch op, twice per decoder
layer.  ``eager`` has no compiler to fuse them, and at batch 1 their
dispatch is a share of the step beside the weights' reads.
``use_kernel_norms`` gives every plain ``RMSNorm`` of a model (a weight of
the activations' dtype, no variance size override) the one-pass
``spyre_kernels::add_rms_norm`` (``vllm/spyre_kernels/elementwise.cpp``),
which computes the native forward's steps in its order and dtypes: the
sum in float32, the new residual rounded to the input's dtype, the norm in
float32 rounded to it, then the weight's product rounded again (only the
order of the squares' sum differs, in the last bit).  Other norms, and
inputs of another dtype than their weight's, keep the native forward.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
from torch import nn
from vllm.model_executor.layers.layernorm import RMSNorm


def _kernel_forward(norm: RMSNorm, x: torch.Tensor,
                    residual: Optional[torch.Tensor] = None):
    if (x.dtype != norm.weight.dtype
            or (residual is not None and residual.dtype != x.dtype)):
        return norm.forward_native(x, residual)
    out, total = torch.ops.spyre_kernels.add_rms_norm(
        x, residual, norm.weight, norm.variance_epsilon)
    return out if residual is None else (out, total)


def _takes(module: nn.Module) -> bool:
    return (type(module) is RMSNorm and module.has_weight
            and module.variance_size_override is None
            and module.weight.dtype in (torch.float32, torch.bfloat16))


def use_kernel_norms(model: nn.Module) -> int:
    """Puts the plain ``RMSNorm`` layers of ``model`` on the kernel;
    returns how many."""
    moved = 0
    for module in model.modules():
        if _takes(module):
            # CustomOp.forward calls the method it chose at construction.
            module._forward_method = functools.partial(_kernel_forward,
                                                       module)
            moved += 1
    return moved
