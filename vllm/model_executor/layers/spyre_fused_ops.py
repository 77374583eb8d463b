"""An FMS decoder's norms and rotary embedding on one kernel each, for
``eager``.

``inductor`` fuses the small ops of every layer into generated loops.
``eager`` has no compiler: FMS's RMS norm runs as seven PyTorch ops, and
its rotary embedding as a 6-dimensional broadcast multiply and a sum
that PyTorch runs slowly (measured: docs/performance.md, "Costs behind
the design").  ``use_fused_ops`` gives those modules a forward on the
project's kernels (``spyre_kernels::rms_norm`` and
``spyre_kernels::rotary_qk``, in ``vllm/spyre_kernels/elementwise.cpp``) by
changing their class to a subclass, so their parameters, names and state
stay as they were (weight updates and checkpoints see the same model).

The subclasses fall back to FMS's own code for what the kernels do not
take (inputs other than float32, a query and key of different lengths,
no position ids); FMS modules of other configurations (a norm with a mean
or a shift, a partial or YaRN rotary embedding) are left as they are.
"""
from __future__ import annotations

from typing import Optional

import torch
from fms.modules.layernorm import LayerNormParameterized
from fms.modules.positions import RotaryEmbedding
from torch import nn


class KernelRMSNorm(LayerNormParameterized):
    """FMS's RMS norm (no mean, a scale, no shift) on
    ``spyre_kernels::rms_norm``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32 or self.weight.dtype != torch.float32:
            return super().forward(x)
        return torch.ops.spyre_kernels.rms_norm(x, self.weight, self.eps)


class KernelRotaryEmbedding(RotaryEmbedding):
    """FMS's rotary embedding on ``spyre_kernels::rotary_qk``, reading FMS's
    own table of rotations (so every scaling FMS computes it for, but
    YaRN's, holds)."""

    def adjusted_qk(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        position_ids: Optional[torch.Tensor] = None,
        past_kv_state=None,
        use_cache: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if (position_ids is None or q.dtype != torch.float32
                or k.dtype != torch.float32 or q.size(1) != k.size(1)):
            return super().adjusted_qk(q, k, position_ids, past_kv_state,
                                       use_cache)
        alpha = self.compute_freqs_cis(
            q.device, torch.max(position_ids[:, 0]) + q.size(1))
        table = self.cached_freqs[q.device.index][alpha]
        return torch.ops.spyre_kernels.rotary_qk(q, k, table, position_ids)


def _takes_norm(module: nn.Module) -> bool:
    return (type(module) is LayerNormParameterized and not module.use_mean
            and module.elementwise_scale and not module.elementwise_shift)


def _takes_rotary(encoder: object) -> bool:
    return (type(encoder) is RotaryEmbedding and encoder.rope_type != "yarn"
            and encoder.partial_rope == 1.0)


def use_fused_ops(model: nn.Module) -> tuple[int, int]:
    """Moves the RMS norms and rotary embeddings of ``model`` that the
    kernels take onto them; returns how many of each."""
    norms = 0
    for module in model.modules():
        if _takes_norm(module):
            module.__class__ = KernelRMSNorm
            norms += 1
    # FMS's position encoders are plain objects, shared by the attention
    # modules that hold them, not submodules.
    encoders = {id(e): e for e in (getattr(m, "position_encoder", None)
                                   for m in model.modules())
                if _takes_rotary(e)}
    for encoder in encoders.values():
        encoder.__class__ = KernelRotaryEmbedding
    return norms, len(encoders)
