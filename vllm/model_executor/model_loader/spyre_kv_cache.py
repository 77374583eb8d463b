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
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

#: Name under which the op is registered with FMS.
ATTN_NAME = "spyre_static_kv"
#: The same op, with decode steps on the C++ kernel
#: ``spyre_cpu::decode_attention`` (float32 or bfloat16, CPU ``inductor``
#: path; the kernel must be loaded, see ``spyre_cpu_linear.available``).
ATTN_NAME_CPU_KERNEL = "spyre_static_kv_cpu_kernel"


def _store(keys: torch.Tensor, values: torch.Tensor,
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


def _compute(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
             nheads: int, kvheads: int, p_dropout: float,
             scale_factor, **attn_kwargs) -> torch.Tensor:
    """query: [B, L, heads, head_dim]; keys/values: [B, kv_heads, S,
    head_dim]; mask: [B, L, S] bool.  Returns [B, L, heads, head_dim]."""
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


def decode_op(attend):
    """An FMS decode compute op around ``attend``.  The query heads sharing
    a key/value head are stacked, so the cache is read once per key/value
    head: ``attend(q, keys, values, scale, attn_kwargs)`` gets q as [B,
    kv_heads, L * group, head_dim], rows (query position, head in group),
    and returns [B, kv_heads, L * group, v_head_dim].

    The op takes query: [B, L, heads, head_dim] and the keys/values the
    store op returned, and returns [B, L, heads, v_head_dim].  Here keys/
    values are [B, kv_heads, T, head_dim] with mask: [B, L, T] bool;
    ``spyre_paged_kv`` uses the same op over a block pool."""

    def compute(query: torch.Tensor, keys: torch.Tensor,
                values: torch.Tensor, nheads: int, kvheads: int,
                p_dropout: float, scale_factor,
                **attn_kwargs) -> torch.Tensor:
        B, L, H, D = query.shape
        group = H // kvheads
        scale = scale_factor if scale_factor is not None else D**-0.5
        q = query.reshape(B, L, kvheads, group, D).transpose(1, 2).reshape(
            B, kvheads, L * group, D)
        out = attend(q, keys, values, scale, attn_kwargs)
        Dv = values.shape[-1]
        return out.view(B, kvheads, L, group, Dv).transpose(1, 2).reshape(
            B, L, H, Dv)

    return compute


def attend_matmul(q: torch.Tensor, keys: torch.Tensor,
                  values: torch.Tensor, mask: torch.Tensor,
                  scale: float) -> torch.Tensor:
    """Written out so that inductor fuses it into the graph (the CPU
    flash-attention kernel costs ~0.6 ms per layer at batch 8 for one
    query row)."""
    B, kvheads, rows, _ = q.shape
    L, T = mask.shape[1], keys.shape[2]
    keys, values = keys.to(q.dtype), values.to(q.dtype)
    scores = torch.matmul(q, keys.transpose(2, 3)) * scale
    visible = mask[:, None, :, None, :]  # [B, 1, L, 1, T]
    scores = scores.view(B, kvheads, L, rows // L, T).masked_fill(
        ~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1).view(B, kvheads, rows, T)
    return torch.matmul(probs, values)


def _attend_kernel(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                   mask: torch.Tensor, scale: float) -> torch.Tensor:
    """One C++ call per layer.  Through MKL and inductor the two small
    matrix products and the softmax between them cost about 70 us per layer
    at batch 1 (profiled in the graph); the kernel, with leaner linear-layer
    calls added at the same time, made a SmolLM2 batch-1 step 1.7 ms
    shorter."""
    return torch.ops.spyre_cpu.decode_attention(q, keys, values, mask, scale)


#: Decode attention in torch ops, and the same on the C++ kernel.
_compute_decode = decode_op(
    lambda q, k, v, scale, kw: attend_matmul(q, k, v, kw["mask"], scale))
_compute_decode_kernel = decode_op(
    lambda q, k, v, scale, kw: _attend_kernel(q, k, v, kw["mask"], scale))


def _is_prefill(**attn_kwargs) -> bool:
    return bool(attn_kwargs.get("spyre_prefill", False))


def register() -> None:
    """Registers the ops with FMS once per process."""
    from fms.modules import attention
    for name, decode in ((ATTN_NAME, _compute_decode),
                         (ATTN_NAME_CPU_KERNEL, _compute_decode_kernel)):
        try:
            attention.get_attention_type(attn_name=name)
        except KeyError:
            attention.register_attention_op(name,
                                            _store,
                                            _compute,
                                            is_prefill_op=_is_prefill,
                                            compute_decode_op=decode)


@dataclass(frozen=True)
class CacheLayout:
    """Per-layer cache geometry, read off the (possibly sharded) model."""

    layers: int
    kv_heads: int
    k_head_dim: int
    v_head_dim: int

    @classmethod
    def of(cls, model: nn.Module) -> "CacheLayout":
        from fms.modules.attention import MultiHeadAttention
        attn = [m for m in model.modules()
                if isinstance(m, MultiHeadAttention)]
        if not attn:
            raise ValueError(f"{type(model).__name__} has no FMS attention "
                             "layers")
        first = attn[0]
        return cls(layers=len(attn),
                   kv_heads=first.kvheads,
                   k_head_dim=first.emb_kq_per_head,
                   v_head_dim=first.emb_v_per_head)

    def allocate(self, batch_size: int, length: int,
                 dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Zeroed caches, one (keys, values) pair per layer."""
        return [(torch.zeros(batch_size, self.kv_heads, length,
                             self.k_head_dim, dtype=dtype),
                 torch.zeros(batch_size, self.kv_heads, length,
                             self.v_head_dim, dtype=dtype))
                for _ in range(self.layers)]

    def nbytes(self, batch_size: int, length: int,
               dtype: torch.dtype) -> int:
        item = torch.empty((), dtype=dtype).element_size()
        per_pos = self.kv_heads * (self.k_head_dim + self.v_head_dim)
        return self.layers * batch_size * length * per_pos * item
