"""Attention written in torch ops, shared by the static and paged caches.

``decode_op`` turns an ``attend`` function into an FMS compute op that
stacks the query heads sharing a key/value head, so each key/value head is
read once; ``attend_matmul`` is the masked attention of that stacked form
in plain torch ops, which inductor fuses into the graph.  The static cache
(``spyre_static_cache``) and the block pool (``spyre_paged_cache``) both build their
compute ops from these two.

Sliding windows: a model whose attention slides over its last ``window``
tokens (Mistral) has the ops read ``spyre_window`` from the attention
keyword arguments (0 or absent: whole context); a model whose layers
slide differently (GPT-OSS) gives each layer's through FMS's
``sliding_window`` argument instead (``window_of``).  ``windowed``
narrows a static mask to it, ``causal_mask`` builds the mask of a whole
prompt.

Attention sinks (GPT-OSS): FMS's attention gives a layer's learned
per-head logits as ``sinks``; each is one more column of the softmax,
with no value, which takes its share of the probability and is dropped
(``attend_matmul``'s ``sinks``).
"""
from __future__ import annotations

from typing import Optional

import torch


def decode_op(attend):
    """An FMS decode compute op around ``attend``.  The query heads sharing
    a key/value head are stacked, so the cache is read once per key/value
    head: ``attend(q, keys, values, scale, attn_kwargs)`` gets q as [B,
    kv_heads, L * group, head_dim], rows (query position, head in group),
    and returns [B, kv_heads, L * group, v_head_dim].

    The op takes query: [B, L, heads, head_dim] and the keys/values the
    store op returned, and returns [B, L, heads, v_head_dim].  Here keys/
    values are [B, kv_heads, T, head_dim] with mask: [B, L, T] bool;
    ``spyre_paged_cache`` uses the same op over a block pool."""

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
                  scale: float,
                  sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Written out so that inductor fuses it into the graph (the CPU
    flash-attention kernel is slow for one query row: docs/performance.md,
    "Costs behind the design").  ``sinks``: none, or one attention-sink logit per query
    head ([kv_heads * group])."""
    B, kvheads, rows, _ = q.shape
    L, T = mask.shape[1], keys.shape[2]
    group = rows // L
    keys, values = keys.to(q.dtype), values.to(q.dtype)
    scores = torch.matmul(q, keys.transpose(2, 3)) * scale
    visible = mask[:, None, :, None, :]  # [B, 1, L, 1, T]
    scores = scores.view(B, kvheads, L, group, T).masked_fill(
        ~visible, float("-inf"))
    if sinks is None:
        probs = torch.softmax(scores, dim=-1)
    else:
        sink = sinks.to(scores.dtype).view(1, kvheads, 1, group, 1)
        probs = torch.softmax(
            torch.cat([scores, sink.expand(B, -1, L, -1, -1)], dim=-1),
            dim=-1)[..., :T]
    return torch.matmul(probs.reshape(B, kvheads, rows, T), values)


def window_of(attn_kwargs) -> int:
    """The sliding window of a step's attention, 0 for none: the model's
    (``spyre_window``), else this layer's (FMS's ``sliding_window``)."""
    return int(attn_kwargs.get("spyre_window")
               or attn_kwargs.get("sliding_window") or 0)


def sinks_of(attn_kwargs) -> Optional[torch.Tensor]:
    """A layer's attention sinks, None for none."""
    return attn_kwargs.get("sinks")


def windowed(mask: torch.Tensor, query_cols: torch.Tensor,
             window: int) -> torch.Tensor:
    """``mask`` ([B, L, T] bool, over the columns of a cache whose real
    tokens are contiguous) narrowed to the last ``window`` tokens before
    each query position, itself included; ``query_cols``: the column of
    each query position ([L]).  Token ``j`` stays visible from position
    ``i`` when ``i - j < window``, as in transformers."""
    if window <= 0:
        return mask
    cols = torch.arange(mask.shape[-1], device=mask.device)
    return mask & ((query_cols.view(-1, 1) - cols.view(1, -1)) < window)


def causal_mask(length: int, window: int = 0) -> torch.Tensor:
    """The [1, L, L] bool mask of one whole prompt, causal and, with
    ``window``, sliding."""
    mask = torch.ones(length, length, dtype=torch.bool).tril()
    return windowed(mask.unsqueeze(0), torch.arange(length), window)
