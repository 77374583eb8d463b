"""FMS's attention ops under ``eager`` (``ATTN_NAME_EAGER_KERNEL``: the
cache write and the attention one C++ call each, ``cached_attention.cpp``)
against the kernel ops they replace, bit for bit: the same caches and
pools after the write (float32 and bfloat16, keys given as strided views),
the same returns, the same attention with a layer's sliding window and
attention sinks, a decode step and a prefill; and slots outside the cache
refused by name."""
from __future__ import annotations

import pytest
import torch

from paged_cases import PAD_BLOCK, _decode_case, _prefill_case, needs_kernel
from vllm.attention.ops import spyre_paged_cache as paged_cache
from vllm.attention.ops import spyre_static_cache as static_cache

pytestmark = needs_kernel

B, T, H, KVH, D = 3, 12, 8, 2, 16


def strided(x: torch.Tensor) -> torch.Tensor:
    """x [B, L, heads, D] as FMS hands it: a view into wider rows."""
    wide = torch.zeros(*x.shape[:2], x.shape[2] * x.shape[3] + 5)
    wide[..., 3:3 + x.shape[2] * x.shape[3]] = x.flatten(2)
    return wide[..., 3:3 + x.shape[2] * x.shape[3]].view(x.shape)


def caches(dtype, gen):
    return tuple(torch.randn(B, KVH, T, D, generator=gen).to(dtype)
                 for _ in range(2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("prefill", [False, True])
def test_static_store_writes_the_same_cache(dtype, prefill):
    gen = torch.Generator().manual_seed(0)
    L = 4 if prefill else 1
    keys = strided(torch.randn(B, L, KVH, D, generator=gen))
    values = strided(torch.randn(B, L, KVH, D, generator=gen))
    kw = dict(cache_slots=torch.tensor([5, 6, 7, 8][:L]),
              spyre_prefill=prefill)
    before = caches(dtype, gen)
    ref = tuple(c.clone() for c in before)
    got = tuple(c.clone() for c in before)
    want = static_cache.store(keys, values, *ref, **kw)
    have = static_cache.store_kernel(keys, values, *got, **kw)
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    assert not torch.equal(got[0], before[0])
    for a, b in zip(have, want):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layer", [{}, {"sliding_window": 3},
                                   {"sinks": True}],
                         ids=["plain", "window", "sinks"])
def test_static_decode_attends_the_same(dtype, layer):
    gen = torch.Generator().manual_seed(1)
    keys, values = caches(dtype, gen)
    query = strided(torch.randn(B, 1, H, D, generator=gen))
    mask = torch.rand(B, 1, T, generator=gen) < 0.7
    mask[:, :, 9] = True
    kw = dict(mask=mask, cache_slots=torch.tensor([9]),
              spyre_prefill=False)
    if "sliding_window" in layer:
        kw["sliding_window"] = layer["sliding_window"]
    if "sinks" in layer:
        kw["sinks"] = torch.randn(H, generator=gen)
    want = static_cache._compute_decode_kernel(query, keys, values, H, KVH,
                                               0.0, 0.3, **kw)
    have = static_cache._compute_decode_heads(query, keys, values, H, KVH,
                                              0.0, 0.3, **kw)
    assert have.shape == (B, 1, H, D)
    assert torch.equal(have, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", ["decode", "prefill"])
def test_paged_store_and_attention_are_the_same(dtype, case):
    if case == "decode":
        pool, _, _, step, q, new_k, new_v = _decode_case(H, KVH, D, D,
                                                         seed=2)
    else:
        pool, _, _, _, step, q, new_k, new_v = _prefill_case(
            100, H, KVH, D, D, seed=2)
    pools = (pool.keys.to(dtype), pool.values.to(dtype))
    ref = tuple(p.clone() for p in pools)
    got = tuple(p.clone() for p in pools)
    kw = dict(cache_slots=step.cache_slots, block_table=step.block_table,
              ctx_lens=step.ctx_lens)
    paged_cache.store(strided(new_k), strided(new_v), *ref, **kw)
    returned = paged_cache.store_kernel(strided(new_k), strided(new_v),
                                        *got, **kw)
    assert returned == (got[0], got[1], got[0], got[1])
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    for extra in ({}, {"spyre_window": 40},
                  {"sinks": torch.randn(H, generator=pool.gen)}):
        want = paged_cache.compute_kernel(q, *got, H, KVH, 0.0, None,
                                          **kw, **extra)
        have = paged_cache.compute_heads(strided(q), *got, H, KVH, 0.0,
                                         None, **kw, **extra)
        assert torch.equal(have, want)


def test_a_slot_outside_the_cache_is_refused():
    gen = torch.Generator().manual_seed(3)
    keys = torch.randn(B, 1, KVH, D, generator=gen)
    with pytest.raises(RuntimeError, match=f"cache slot {T} is outside "
                       f"the cache's {T} slots"):
        static_cache.store_kernel(keys, keys, *caches(torch.float32, gen),
                                  cache_slots=torch.tensor([T]),
                                  spyre_prefill=False)
    pool = torch.zeros(PAD_BLOCK * 64, KVH, D)
    with pytest.raises(RuntimeError, match="cache slot -1 is outside"):
        paged_cache.store_kernel(keys, keys, pool, pool.clone(),
                                 cache_slots=torch.tensor([[0], [-1], [2]]))
