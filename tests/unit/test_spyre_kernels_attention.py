"""The C++ decode attention kernel against the same attention in torch ops.

``static_cache._compute_decode_kernel`` (the kernel) must match
``_compute_decode`` (matrix products and softmax) for grouped-query and
plain multi-head attention, head sizes that do not fill a 16-float vector,
several query positions per step, and masks as ``DecodeSteps`` builds them;
and it must also run traced by dynamo (its fake implementation)."""
from __future__ import annotations

import pytest
import torch

from vllm.spyre_kernels import ops as native
from vllm.attention.ops import spyre_static_cache as static_cache
from vllm.config.spyre import WarmupShape
from vllm.worker.spyre_static_inputs import DecodeSteps

pytestmark = pytest.mark.skipif(not native.available(),
                                reason="no C++ compiler for the kernel")


def _inputs(B, L, H, kvh, D, T, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, L, H, D, generator=gen)
    k = torch.randn(B, kvh, T, D, generator=gen)
    v = torch.randn(B, kvh, T, D, generator=gen)
    mask = torch.rand(B, L, T, generator=gen) > 0.5
    mask[..., -1] = True
    return q, k, v, mask


@pytest.mark.parametrize("B, L, H, kvh, D, T", [
    (1, 1, 9, 3, 64, 128),  # SmolLM2-135M
    (3, 1, 4, 2, 16, 20),
    (2, 1, 4, 4, 20, 7),  # no grouping; 20 = 16 + a scalar tail
    (2, 3, 6, 2, 8, 11),  # several query positions
    # groups of 5 rows (a tile of 4 and one), 96 = 64 + 2 x 16 columns,
    # 300 tokens = 18 x 16 + a tail
    (2, 2, 10, 2, 96, 300),
])
def test_kernel_matches_torch_ops(B, L, H, kvh, D, T):
    q, k, v, mask = _inputs(B, L, H, kvh, D, T)
    for scale in (None, 0.3):
        ref = static_cache._compute_decode(q, k, v, H, kvh, 0.0, scale,
                                             mask=mask)
        got = static_cache._compute_decode_kernel(q, k, v, H, kvh, 0.0,
                                                    scale, mask=mask)
        assert got.shape == (B, L, H, D)
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_softmax_over_a_wide_range_of_scores():
    """Scores hundreds apart: the kernel's exponential, which clamps far
    below the maximum, still gives the softmax of the torch ops (to the
    float32 rounding of scores this large, about 1e-5 of them)."""
    B, L, H, kvh, D, T = 2, 1, 8, 2, 64, 200
    q, k, v, mask = _inputs(B, L, H, kvh, D, T, seed=5)
    ref = static_cache._compute_decode(q, k, v, H, kvh, 0.0, 12.0,
                                         mask=mask)
    got = static_cache._compute_decode_kernel(q, k, v, H, kvh, 0.0, 12.0,
                                                mask=mask)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("query_dtype", [torch.float32, torch.bfloat16])
def test_bf16_cache_matches_torch_ops(query_dtype):
    """A bfloat16 cache (under a float32 or bfloat16 query): the kernel
    computes in float32 what the torch ops compute on the same values, and
    returns the query's dtype."""
    B, L, H, kvh, D, T = 2, 1, 9, 3, 64, 70
    q, k, v, mask = _inputs(B, L, H, kvh, D, T, seed=3)
    q, k, v = q.to(query_dtype), k.bfloat16(), v.bfloat16()
    got = static_cache._compute_decode_kernel(q, k, v, H, kvh, 0.0, None,
                                                mask=mask)
    assert got.dtype == query_dtype
    ref = static_cache._compute_decode(q.float(), k.float(), v.float(), H,
                                         kvh, 0.0, None, mask=mask)
    # bfloat16 output: within one rounding of the float32 result.
    tol = 1e-5 if query_dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), ref, atol=tol, rtol=tol)
    # The torch ops take a bfloat16 cache under a float32 query too.
    if query_dtype == torch.float32:
        mixed = static_cache._compute_decode(q, k, v, H, kvh, 0.0, None,
                                               mask=mask)
        torch.testing.assert_close(mixed, ref, atol=1e-5, rtol=1e-5)


def test_kernel_with_decode_masks():
    P, G, B, H, kvh, D = 8, 5, 3, 6, 3, 32
    shape = WarmupShape(prompt_len=P, new_tokens=G, batch_size=B)
    steps = DecodeSteps([3, 8, 1], shape)
    for step in range(1, G):
        mask = steps.inputs([0] * B, step).mask  # [B, 1, P + G]
        q, k, v, _ = _inputs(B, 1, H, kvh, D, P + G, seed=step)
        # Stale values in slots not written yet must not matter.
        k[:, :, P + step:] = float("nan")
        v[:, :, P + step:] = float("nan")
        got = static_cache._compute_decode_kernel(q, k, v, H, kvh, 0.0,
                                                    None, mask=mask)
        k, v = k.nan_to_num(), v.nan_to_num()
        ref = static_cache._compute_decode(q, k, v, H, kvh, 0.0, None,
                                             mask=mask)
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_row_that_sees_nothing_gets_zeros():
    q, k, v, mask = _inputs(2, 1, 2, 1, 16, 5)
    mask[1] = False
    out = static_cache._compute_decode_kernel(q, k, v, 2, 1, 0.0, None,
                                                mask=mask)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert out[0].abs().sum() > 0


def test_kernel_traced_by_dynamo():
    q, k, v, mask = _inputs(2, 1, 4, 2, 16, 9)

    def attend(q, k, v, mask):
        return static_cache._compute_decode_kernel(q, k, v, 4, 2, 0.0,
                                                     None, mask=mask)

    compiled = torch.compile(attend, backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(q, k, v, mask), attend(q, k, v, mask))


@pytest.mark.parametrize("change, message", [
    (lambda a: a.update(q=a["q"].double()), "float32 or bfloat16 query"),
    (lambda a: a.update(k=a["k"].bfloat16()), "keys and values of one "
     "dtype"),
    (lambda a: a.update(mask=a["mask"].float()), "must be bool"),
    (lambda a: a.update(k=a["k"][:, :, :, :8]), "keys"),
    (lambda a: a.update(v=a["v"][:, :, :4]), "values"),
    (lambda a: a.update(mask=a["mask"][:, :, :3]), "mask"),
])
def test_bad_inputs_are_named(change, message):
    q, k, v, mask = _inputs(2, 1, 4, 2, 16, 9)
    args = dict(q=q.view(2, 2, 2, 16), k=k, v=v, mask=mask)
    change(args)
    with pytest.raises(RuntimeError, match=message):
        torch.ops.spyre_kernels.decode_attention(args["q"], args["k"], args["v"],
                                                 args["mask"], 0.25)
