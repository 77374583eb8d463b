"""Key/value cache layouts: per-shape caches and block pools.

``CacheLayout`` reads the cache geometry off a loaded (possibly sharded)
FMS model and allocates the caches of static batching, one buffer of a
shape's full length per layer; ``PoolLayout`` allocates continuous
batching's block pools from the same geometry.  The memory estimate and
the models size their caches through these two.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from vllm.config.spyre import CB_BLOCK_SIZE


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


@dataclass(frozen=True)
class PoolLayout:
    """The block pools of every layer of one (possibly sharded) model, in
    blocks of ``CB_BLOCK_SIZE`` tokens (the size both attention paths use)."""

    cache: CacheLayout

    def block_bytes(self, dtype: torch.dtype) -> int:
        """Bytes one block takes over all layers (keys and values)."""
        return self.cache.nbytes(1, CB_BLOCK_SIZE, dtype)

    def allocate(self, num_blocks: int, dtype: torch.dtype
                 ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Zeroed pools, one (keys, values) pair per layer, each
        ``[num_blocks * CB_BLOCK_SIZE, kv_heads, head_dim]``."""
        slots = num_blocks * CB_BLOCK_SIZE
        c = self.cache
        return [(torch.zeros(slots, c.kv_heads, c.k_head_dim, dtype=dtype),
                 torch.zeros(slots, c.kv_heads, c.v_head_dim, dtype=dtype))
                for _ in range(c.layers)]
