"""A paged key/value cache for continuous batching: one pool of blocks.

Under continuous batching sequences join and leave the running batch at
every step, so no cache can belong to a batch.  Each layer instead owns one
pool of fixed-size blocks, allocated once at start-up, and vLLM's V0 block
manager hands the blocks out: a sequence's token ``t`` lives in block
``block_table[t // block_size]`` at offset ``t % block_size``, its *slot*
being ``block * block_size + offset``.

This module plugs that pool into FMS's attention-op registry, so FMS's own
model code runs unchanged:

* the *store* op writes a step's keys and values into their slots of the
  flattened pool (``index_copy_``, in place);
* the *compute* op lets every query position attend to the first
  ``ctx_lens[b, l]`` tokens of its sequence, read through the block table
  (with a sliding window, ``spyre_window`` or a layer's own, to the last
  ``window`` of them: each position's own start), with a layer's attention
  sinks where it has them.

Both a prefill (one sequence, whole or a ``block_size`` chunk) and a decode
step (one position of each running sequence) are the same op with other
shapes.  On the CPU ``inductor`` path the compute op is the C++ kernel
``spyre_kernels::paged_attention``, which reads keys and values straight from
the blocks, each sequence up to its own length; elsewhere the blocks are
gathered into a contiguous tensor and attended with torch ops.
"""
from __future__ import annotations

import torch

from vllm.attention.ops.spyre_fms_registry import register_ops
from vllm.attention.ops.spyre_torch_ops import (attend_matmul, decode_op,
                                                sinks_of, window_of)
from vllm.config.spyre import CB_BLOCK_SIZE

#: Name under which the op is registered with FMS.
ATTN_NAME = "spyre_paged"
#: The same op on the C++ kernel (float32 or bfloat16 pools, CPU
#: ``inductor`` path).
ATTN_NAME_CPU_KERNEL = "spyre_paged_cpu_kernel"
#: The same under ``eager``: the cache write one C++ call and the attention
#: another (``store_kernel``, ``compute_heads``; ``cached_attention.cpp``).
ATTN_NAME_EAGER_KERNEL = "spyre_paged_eager_kernel"


def store(keys: torch.Tensor, values: torch.Tensor, key_pool: torch.Tensor,
          value_pool: torch.Tensor, **attn_kwargs):
    """keys, values: [B, L, kv_heads, head_dim]; pools: [slots, kv_heads,
    head_dim]; ``cache_slots``: [B, L] int64.  The compute op reads the
    pools, so they are returned in place of this step's keys/values."""
    slots = attn_kwargs["cache_slots"].flatten()
    key_pool.index_copy_(0, slots, keys.flatten(0, 1).to(key_pool.dtype))
    value_pool.index_copy_(0, slots,
                           values.flatten(0, 1).to(value_pool.dtype))
    return key_pool, value_pool, key_pool, value_pool


def store_kernel(keys: torch.Tensor, values: torch.Tensor,
                 key_pool: torch.Tensor, value_pool: torch.Tensor,
                 **attn_kwargs):
    """``store`` in one C++ call: the same pool values, the same returns."""
    torch.ops.spyre_kernels.store_paged_kv(keys, values, key_pool,
                                           value_pool,
                                           attn_kwargs["cache_slots"])
    return key_pool, value_pool, key_pool, value_pool


def _attend_gather(q: torch.Tensor, key_pool: torch.Tensor,
                   value_pool: torch.Tensor, scale: float,
                   attn_kwargs) -> torch.Tensor:
    """Torch ops: gathers every block of the table (``[B, T]`` slots, ``T =
    max_blocks * block_size``) and masks each query position to its
    context length."""
    block_table = attn_kwargs["block_table"]  # [B, MB]
    ctx_lens = attn_kwargs["ctx_lens"]  # [B, L]
    B, MB = block_table.shape
    offsets = torch.arange(CB_BLOCK_SIZE, device=block_table.device)
    slots = (block_table.unsqueeze(2) * CB_BLOCK_SIZE + offsets).view(B, -1)
    keys = key_pool[slots].transpose(1, 2)  # [B, kv_heads, T, D]
    values = value_pool[slots].transpose(1, 2)  # [B, kv_heads, T, Dv]
    col = torch.arange(MB * CB_BLOCK_SIZE, device=block_table.device)
    mask = col.view(1, 1, -1) < ctx_lens.unsqueeze(2)  # [B, L, T]
    window = window_of(attn_kwargs)
    if window > 0:
        mask = mask & (col.view(1, 1, -1) >= ctx_lens.unsqueeze(2) - window)
    return attend_matmul(q, keys, values, mask, scale, sinks_of(attn_kwargs))


def _attend_kernel(q: torch.Tensor, key_pool: torch.Tensor,
                   value_pool: torch.Tensor, scale: float,
                   attn_kwargs) -> torch.Tensor:
    return torch.ops.spyre_kernels.paged_attention(q, key_pool, value_pool,
                                                   attn_kwargs["block_table"],
                                                   attn_kwargs["ctx_lens"],
                                                   CB_BLOCK_SIZE, scale,
                                                   window_of(attn_kwargs),
                                                   sinks_of(attn_kwargs))


def store_and_attend(query: torch.Tensor, key: torch.Tensor,
                     value: torch.Tensor, key_pool: torch.Tensor,
                     value_pool: torch.Tensor, heads: int, scale: float,
                     **attn_kwargs) -> torch.Tensor:
    """A step of vLLM's model code in one C++ call: ``store`` and
    ``compute_kernel``, the same ops in the same order (query: [B * L,
    heads * head_dim]; key, value: [B * L, kv_heads * head_dim]; returns
    [B * L, heads * v_head_dim]).  No attention sinks."""
    return torch.ops.spyre_kernels.store_paged_attention(
        query, key, value, key_pool, value_pool, attn_kwargs["cache_slots"],
        attn_kwargs["block_table"], attn_kwargs["ctx_lens"], CB_BLOCK_SIZE,
        heads, scale, window_of(attn_kwargs))


def compute_heads(query: torch.Tensor, key_pool: torch.Tensor,
                  value_pool: torch.Tensor, nheads: int, kvheads: int,
                  p_dropout: float, scale_factor,
                  **attn_kwargs) -> torch.Tensor:
    """``compute_kernel`` in one C++ call (the query heads stacked and the
    output unstacked there)."""
    scale = (scale_factor if scale_factor is not None else
             query.shape[-1]**-0.5)
    return torch.ops.spyre_kernels.paged_attention_heads(
        query, key_pool, value_pool, attn_kwargs["block_table"],
        attn_kwargs["ctx_lens"], CB_BLOCK_SIZE, scale,
        window_of(attn_kwargs), sinks_of(attn_kwargs))


compute = decode_op(_attend_gather)
compute_kernel = decode_op(_attend_kernel)


def register() -> None:
    """Registers the ops with FMS once per process.  Every step attends
    through the pool, so there is no separate prefill op."""
    register_ops({
        ATTN_NAME: dict(store_op=store, compute_op=compute),
        ATTN_NAME_CPU_KERNEL: dict(store_op=store, compute_op=compute_kernel),
        ATTN_NAME_EAGER_KERNEL: dict(store_op=store_kernel,
                                     compute_op=compute_heads),
    })
