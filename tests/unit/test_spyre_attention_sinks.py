"""Attention sinks (GPT-OSS) in every Spyre attention path: the torch ops
(``attend_matmul``), the static cache's decode kernel and the paged
pool's kernel (``spyre_kernels::decode_attention`` / ``paged_attention``)
equal a float64 softmax with one more column per head, the sink's logit,
whose probability is dropped; a query that sees no token gets zeros; the
kernels name a wrong number of sinks."""
from __future__ import annotations

import pytest
import torch

from paged_cases import needs_kernel
from vllm.attention.ops.spyre_torch_ops import attend_matmul


def _case(B=3, kvh=2, group=3, L=2, T=11, D=16, seed=0):
    """Stacked query rows [B, kvh, L * group, D], keys/values [B, kvh, T,
    D], a [B, L, T] mask with one row of each batch entry seeing only part
    of the tokens, and sinks [kvh * group] spread over the scores'
    range."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, kvh, L * group, D, generator=gen)
    k = torch.randn(B, kvh, T, D, generator=gen)
    v = torch.randn(B, kvh, T, D, generator=gen)
    mask = torch.rand(B, L, T, generator=gen) > 0.3
    mask[:, :, 0] = True
    sinks = torch.rand(kvh * group, generator=gen) * 6 - 2
    return q, k, v, mask, sinks


def _reference(q, k, v, mask, sinks, scale):
    """float64: per query head, softmax over [scores, sink], sink
    dropped."""
    B, kvh, rows, D = q.shape
    L = mask.shape[1]
    group = rows // L
    out = torch.zeros(B, kvh, rows, v.shape[-1], dtype=torch.float64)
    for b in range(B):
        for h in range(kvh):
            for r in range(rows):
                pos, g = divmod(r, group)
                seen = mask[b, pos]
                if not seen.any():
                    continue
                scores = (k[b, h].double() @ q[b, h, r].double()) * scale
                logits = torch.cat([scores[seen],
                                    sinks[h * group + g].double().view(1)])
                probs = torch.softmax(logits, 0)[:-1]
                out[b, h, r] = probs @ v[b, h][seen].double()
    return out


def test_torch_ops_equal_the_reference():
    q, k, v, mask, sinks = _case()
    got = attend_matmul(q, k, v, mask, 0.25, sinks)
    torch.testing.assert_close(got.double(),
                               _reference(q, k, v, mask, sinks, 0.25),
                               atol=1e-5, rtol=1e-5)
    # Without sinks the same op answers otherwise.
    assert not torch.allclose(attend_matmul(q, k, v, mask, 0.25), got,
                              atol=1e-3)


def test_a_query_that_sees_nothing_gets_zeros():
    q, k, v, mask, sinks = _case()
    mask[1] = False
    got = attend_matmul(q, k, v, mask, 0.25, sinks)
    assert torch.equal(got[1], torch.zeros_like(got[1]))
    assert not got.isnan().any()


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_static_decode_kernel(dtype):
    q, k, v, mask, sinks = _case(L=1, T=40)
    k, v = k.to(dtype), v.to(dtype)
    got = torch.ops.spyre_kernels.decode_attention(q, k, v, mask, 0.25, sinks)
    ref = attend_matmul(q, k.float(), v.float(), mask, 0.25, sinks)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    plain = torch.ops.spyre_kernels.decode_attention(q, k, v, mask, 0.25)
    assert not torch.allclose(plain, got, atol=1e-3)


@needs_kernel
@pytest.mark.parametrize("window", [0, 5])
def test_paged_kernel(window):
    """Two sequences in blocks of 4, each position's own context length
    (and window): the kernel equals the reference over the tokens each
    position sees."""
    kvh, group, D, block = 2, 3, 16, 4
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(2, kvh, 2 * group, D, generator=gen)  # L = 2
    key_pool = torch.randn(6 * block, kvh, D, generator=gen)
    value_pool = torch.randn(6 * block, kvh, D, generator=gen)
    table = torch.tensor([[3, 0, 5], [1, 4, 2]])
    ctx = torch.tensor([[9, 10], [11, 12]])
    sinks = torch.rand(kvh * group, generator=gen) * 6 - 2
    got = torch.ops.spyre_kernels.paged_attention(q, key_pool, value_pool, table,
                                                  ctx, block, 0.25, window, sinks)
    slots = (table.unsqueeze(2) * block + torch.arange(block)).view(2, -1)
    keys = key_pool[slots].transpose(1, 2)
    values = value_pool[slots].transpose(1, 2)
    col = torch.arange(slots.shape[1])
    mask = col.view(1, 1, -1) < ctx.unsqueeze(2)
    if window:
        mask &= col.view(1, 1, -1) >= ctx.unsqueeze(2) - window
    ref = _reference(q, keys, values, mask, sinks, 0.25)
    torch.testing.assert_close(got.double(), ref, atol=1e-5, rtol=1e-5)


@needs_kernel
def test_kernels_name_a_wrong_number_of_sinks():
    q, k, v, mask, sinks = _case(L=1)
    with pytest.raises(RuntimeError, match="5 attention sinks for 6 query "
                       "heads"):
        torch.ops.spyre_kernels.decode_attention(q, k, v, mask, 0.25, sinks[:5])
