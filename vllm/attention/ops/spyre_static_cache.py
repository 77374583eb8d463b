"""A key/value cache allocated once per warm-up shape and written in place.

Fixed-shape hardware keeps the cache of a batch in one buffer of the
shape's full length, ``prompt_len + new_tokens``, and writes each step's
keys and values into their slots.  This module does the same on the CPU
through FMS's attention-op registry (``register_attention_op``), so FMS's
own model code runs unchanged:

* the *store* op writes this step's keys/values into the cache at the
  slots given by ``cache_slots`` (``index_copy_``, no new allocation);
* a prefill attends over its own keys only (mask ``[B, P, P]``);
* a decode step attends over the whole cache (mask ``[B, 1, P + G]``),
  slots not written yet being masked out.

Every decode step of a shape therefore has the same tensor shapes: one
compiled decode graph serves all of them, and nothing is concatenated or
re-allocated per token.

A model-wide sliding window is in the step's mask already
(``spyre_static_inputs``): it is built once per batch, not in every layer of
every step.  A layer's own window (FMS's ``sliding_window``, GPT-OSS's
alternating layers) narrows the mask in that layer's op, and a layer's
attention sinks (``sinks``) send a prefill through the written-out
attention too (SDPA has no sinks).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from vllm.attention.ops.spyre_fms_registry import register_ops
from vllm.attention.ops.spyre_torch_ops import (attend_matmul, decode_op,
                                                sinks_of, windowed)

#: Name under which the op is registered with FMS.
ATTN_NAME = "spyre_static_kv"
#: The same op, with decode steps on the C++ kernel
#: ``spyre_kernels::decode_attention`` (float32 or bfloat16, CPU ``inductor``
#: path; the kernel must be loaded, see ``native.available``).
ATTN_NAME_CPU_KERNEL = "spyre_static_kv_cpu_kernel"
#: The same under ``eager``, which runs each op of the graph one by one:
#: the cache write one C++ call (``store_kernel``) and a decode step's
#: attention another (``_compute_decode_heads``), in place of six and seven
#: dispatched ops; the same values (``cached_attention.cpp``).
ATTN_NAME_EAGER_KERNEL = "spyre_static_kv_eager_kernel"


def store(keys: torch.Tensor, values: torch.Tensor,
          key_cache: torch.Tensor, value_cache: torch.Tensor,
          **attn_kwargs):
    """keys, values: [B, L, kv_heads, head_dim]; caches: [B, kv_heads, T,
    head_dim].  Returns (keys to attend over, values to attend over, cache
    keys to return, cache values to return)."""
    keys = keys.transpose(1, 2)
    values = values.transpose(1, 2)
    slots = attn_kwargs["cache_slots"]  # [L] int64
    # A bfloat16 cache under a float32 model rounds what it keeps.
    key_cache.index_copy_(2, slots, keys.to(key_cache.dtype))
    value_cache.index_copy_(2, slots, values.to(value_cache.dtype))
    if _is_prefill(**attn_kwargs):
        return keys, values, key_cache, value_cache
    return key_cache, value_cache, key_cache, value_cache


def store_kernel(keys: torch.Tensor, values: torch.Tensor,
                 key_cache: torch.Tensor, value_cache: torch.Tensor,
                 **attn_kwargs):
    """``store`` in one C++ call: the same cache values, the same
    returns."""
    torch.ops.spyre_kernels.store_static_kv(keys, values, key_cache,
                                            value_cache,
                                            attn_kwargs["cache_slots"])
    if _is_prefill(**attn_kwargs):
        return (keys.transpose(1, 2), values.transpose(1, 2), key_cache,
                value_cache)
    return key_cache, value_cache, key_cache, value_cache


def layer_mask(attn_kwargs) -> torch.Tensor:
    """The step's mask ([B, L, T] bool), narrowed to the layer's own
    sliding window (FMS's ``sliding_window``; none: as it is).  The query
    positions are in the columns this step writes (``cache_slots``)."""
    mask = attn_kwargs["mask"]
    window = int(attn_kwargs.get("sliding_window") or 0)
    if window <= 0:
        return mask
    return windowed(mask, attn_kwargs["cache_slots"], window)


def compute_prefill(query: torch.Tensor, keys: torch.Tensor,
                    values: torch.Tensor, nheads: int, kvheads: int,
                    p_dropout: float, scale_factor,
                    **attn_kwargs) -> torch.Tensor:
    """query: [B, L, heads, head_dim]; keys/values: [B, kv_heads, S,
    head_dim]; mask: [B, L, S] bool.  Returns [B, L, heads, head_dim]."""
    if sinks_of(attn_kwargs) is not None or attn_kwargs.get(
            "sliding_window"):
        return _compute_decode(query, keys, values, nheads, kvheads,
                               p_dropout, scale_factor, **attn_kwargs)
    out = F.scaled_dot_product_attention(
        query.transpose(1, 2),
        keys,
        values,
        attn_mask=attn_kwargs["mask"].unsqueeze(1),
        dropout_p=p_dropout,
        scale=scale_factor,
        enable_gqa=nheads != kvheads,
    )
    return out.transpose(1, 2).contiguous()


def _attend_kernel(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                   mask: torch.Tensor, scale: float,
                   sinks=None) -> torch.Tensor:
    """One C++ call per layer, in place of two small matrix products and
    the softmax between them through MKL and inductor (what that saved:
    docs/performance.md, "Costs behind the design")."""
    return torch.ops.spyre_kernels.decode_attention(q, keys, values, mask,
                                                    scale, sinks)


#: Decode attention in torch ops, and the same on the C++ kernel.
_compute_decode = decode_op(
    lambda q, k, v, scale, kw: attend_matmul(q, k, v, layer_mask(kw), scale,
                                             sinks_of(kw)))
_compute_decode_kernel = decode_op(
    lambda q, k, v, scale, kw: _attend_kernel(q, k, v, layer_mask(kw), scale,
                                              sinks_of(kw)))


def store_and_attend(query: torch.Tensor, key: torch.Tensor,
                     value: torch.Tensor, key_cache: torch.Tensor,
                     value_cache: torch.Tensor, heads: int, scale: float,
                     **attn_kwargs) -> torch.Tensor:
    """A decode step of vLLM's model code in one C++ call: ``store`` and
    the kernel's compute op, the same ops in the same order (query:
    [B * L, heads * head_dim]; key, value: [B * L, kv_heads * head_dim];
    returns [B * L, heads * v_head_dim])."""
    return torch.ops.spyre_kernels.store_decode_attention(
        query, key, value, key_cache, value_cache, attn_kwargs["cache_slots"],
        layer_mask(attn_kwargs), heads, scale)


def _compute_decode_heads(query: torch.Tensor, keys: torch.Tensor,
                          values: torch.Tensor, nheads: int, kvheads: int,
                          p_dropout: float, scale_factor,
                          **attn_kwargs) -> torch.Tensor:
    """``_compute_decode_kernel`` in one C++ call (the query heads stacked
    and the output unstacked there)."""
    scale = (scale_factor if scale_factor is not None else
             query.shape[-1]**-0.5)
    return torch.ops.spyre_kernels.decode_attention_heads(
        query, keys, values, layer_mask(attn_kwargs), scale,
        sinks_of(attn_kwargs))


def compute_op(prefill: bool, on_kernel: bool):
    """The compute op of a prefill or a decode step, on the C++ kernel
    (decode only: a prefill attends through SDPA, or the written-out
    attention with sinks or a layer's window) or in torch ops."""
    if prefill:
        return compute_prefill
    return _compute_decode_kernel if on_kernel else _compute_decode


def _is_prefill(**attn_kwargs) -> bool:
    return bool(attn_kwargs.get("spyre_prefill", False))


def register() -> None:
    """Registers the ops with FMS once per process."""
    register_ops({
        name: dict(store_op=store_op, compute_op=compute_prefill,
                   is_prefill_op=_is_prefill, compute_decode_op=decode)
        for name, store_op, decode in (
            (ATTN_NAME, store, _compute_decode),
            (ATTN_NAME_CPU_KERNEL, store, _compute_decode_kernel),
            (ATTN_NAME_EAGER_KERNEL, store_kernel, _compute_decode_heads))
    })
