"""Attention ops of the encoders (BERT, RoBERTa) that pooling models run.

An encoder pass keeps no cache: each packed row of texts attends over its
own keys and values, every text to its own tokens only.  FMS's
``sdpa_bidirectional`` op does that with a ``[B, L, L]`` block-diagonal
mask; this module adds the same in bfloat16 (``--dtype bfloat16`` on the
CPU backends) and on the C++ kernel ``spyre_kernels::encoder_attention`` (CPU
``inductor``), which reads each text's first slot (``text_starts``)
instead of a mask.
"""
from __future__ import annotations

import functools

import torch

from vllm.attention.ops.spyre_fms_registry import register_ops

#: FMS attention op of an encoder: SDPA with the given mask, not causal.
ATTN_NAME = "sdpa_bidirectional"
#: The same in bfloat16 (``--dtype bfloat16`` on the CPU backends).
ATTN_NAME_BF16 = "spyre_encoder_bf16"
#: The C++ kernel (``spyre_kernels::encoder_attention``) of the CPU
#: ``inductor`` path, float32 and with bfloat16 products.
ATTN_NAME_CPU = "spyre_encoder_cpu"
ATTN_NAME_CPU_BF16 = "spyre_encoder_cpu_bf16"


def _store(keys: torch.Tensor, values: torch.Tensor, key_cache, value_cache,
           **attn_kwargs):
    """No cache: a pass attends over its own keys and values."""
    return keys, values, keys, values


def _compute_bf16(query: torch.Tensor, keys: torch.Tensor,
                  values: torch.Tensor, nheads: int, kvheads: int,
                  p_dropout: float, scale_factor, **attn_kwargs):
    """Bidirectional attention of ``[B, L, H, D]`` queries, keys and values
    under the ``[B, L, L]`` mask, its two products in bfloat16 (float32
    accumulation in PyTorch's CPU kernel); returns float32
    ``[B, L, H, D]`` as FMS expects."""
    bf16 = torch.bfloat16
    out = torch.nn.functional.scaled_dot_product_attention(
        *(t.transpose(2, 1).to(bf16) for t in (query, keys, values)),
        attn_mask=attn_kwargs["mask"].unsqueeze(1), scale=scale_factor)
    return out.transpose(2, 1).contiguous().to(query.dtype)


def _compute_kernel(query: torch.Tensor, keys: torch.Tensor,
                    values: torch.Tensor, nheads: int, kvheads: int,
                    p_dropout: float, scale_factor, *, bf16_products: bool,
                    **attn_kwargs):
    """The C++ kernel: each text of a packed row attends to its own
    tokens only (``text_starts``), read straight from FMS's ``[B, L, H,
    D]`` projections, so the masked-out pairs cost nothing.  SDPA with the
    block-diagonal mask computes every pair of slots of a row, and in
    bfloat16 it runs no faster than in float32 here."""
    scale = query.shape[-1]**-0.5 if scale_factor is None else scale_factor
    return torch.ops.spyre_kernels.encoder_attention(
        query, keys, values, attn_kwargs["text_starts"], scale,
        bf16_products)


def register() -> None:
    """Registers the encoder attention ops with FMS once per process."""
    computes = {
        ATTN_NAME_BF16: _compute_bf16,
        ATTN_NAME_CPU: functools.partial(_compute_kernel,
                                         bf16_products=False),
        ATTN_NAME_CPU_BF16: functools.partial(_compute_kernel,
                                              bf16_products=True),
    }
    register_ops({
        name: dict(store_op=_store, compute_op=compute)
        for name, compute in computes.items()
    })
