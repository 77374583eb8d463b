"""The C++ kernel of the paged pool (``spyre_kernels::paged_attention``):
it equals the torch-op path, also for head sizes that do not fill a
16-float vector and for bfloat16 pools, never reads a slot outside a
row's context or before its sliding window (those hold NaN here), shares
uneven sequences among threads, and checks its arguments.  Sliding
windows are checked on both paths against the float64 reference."""
from __future__ import annotations

import pytest
import torch

from paged_cases import (BS, HEADS, _attend, _decode_case, _poison_unread,
                         _poison_unseen, _prefill_case, _reference, _store,
                         needs_kernel)
from vllm.spyre_kernels import ops as native
from vllm.attention.ops import spyre_paged_cache as paged_cache


@needs_kernel
def test_kernel_reads_bf16_pools():
    """bfloat16 pools under a float32 query: the kernel and the torch ops
    agree, and the store rounds what it writes to the pools' dtype."""
    H, kvh, D = HEADS[0]
    pool, _, _, step, q, new_k, new_v = _decode_case(H, kvh, D, D, seed=4)
    pool.keys, pool.values = pool.keys.bfloat16(), pool.values.bfloat16()
    _store(pool, new_k, new_v, step)
    slots = step.cache_slots.flatten()
    assert torch.equal(pool.keys[slots],
                       new_k.flatten(0, 1).bfloat16())
    ref = _attend(paged_cache.compute, q, pool.keys, pool.values, H, kvh,
                  step, None)
    got = _attend(paged_cache.compute_kernel, q, pool.keys, pool.values,
                  H, kvh, step, None)
    assert got.dtype == ref.dtype == torch.float32
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


@needs_kernel
@pytest.mark.parametrize("H, kvh, D", HEADS)
def test_kernel_decode_matches_torch_ops(H, kvh, D):
    pool, _, _, step, q, new_k, new_v = _decode_case(H, kvh, D, D, seed=1)
    _store(pool, new_k, new_v, step)
    nan_k, nan_v = _poison_unread(pool.keys, pool.values, step)
    for scale in (None, 0.3):
        ref = _attend(paged_cache.compute, q, pool.keys, pool.values, H,
                      kvh, step, scale)
        got = _attend(paged_cache.compute_kernel, q, nan_k, nan_v, H,
                      kvh, step, scale)
        assert not got.isnan().any()
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


@needs_kernel
def test_kernel_shares_uneven_sequences_among_threads():
    """The work is split by cost, so a thread may get part of one
    sequence's heads and another its rest: every thread count gives the
    same output, equal to the torch ops'."""
    H, kvh, D = 6, 3, 16
    pool, _, _, step, q, new_k, new_v = _decode_case(
        H, kvh, D, D, seed=3, lens=[1, 190, 2, 64])
    _store(pool, new_k, new_v, step)
    nan_k, nan_v = _poison_unread(pool.keys, pool.values, step)
    ref = _attend(paged_cache.compute, q, pool.keys, pool.values, H, kvh,
                  step)
    threads = torch.get_num_threads()
    outs = []
    try:
        for n in (1, 2, 3, 5, 13):
            torch.set_num_threads(n)
            outs.append(_attend(paged_cache.compute_kernel, q, nan_k,
                                nan_v, H, kvh, step))
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(outs[0], ref, atol=1e-5, rtol=1e-5)
    for out in outs[1:]:
        assert torch.equal(out, outs[0])


@needs_kernel
@pytest.mark.parametrize("H, kvh, D", HEADS)
def test_kernel_prefill_matches_torch_ops(H, kvh, D):
    pool, _, _, _, chunks, q, keys, values = _prefill_case(100, H, kvh, D, D,
                                                           seed=2)
    for c in range(2):
        row = chunks.row(c)
        _store(pool, keys[c:c + 1], values[c:c + 1], row)
        nan_k, nan_v = _poison_unread(pool.keys, pool.values, row)
        ref = _attend(paged_cache.compute, q[c:c + 1], pool.keys,
                      pool.values, H, kvh, row)
        got = _attend(paged_cache.compute_kernel, q[c:c + 1], nan_k,
                      nan_v, H, kvh, row)
        assert not got.isnan().any()
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


@needs_kernel
def test_kernel_value_head_size_may_differ():
    H, kvh, D, Dv = 4, 2, 16, 24
    pool, _, seqs, step, q, new_k, new_v = _decode_case(H, kvh, D, Dv)
    _store(pool, new_k, new_v, step)
    got = _attend(paged_cache.compute_kernel, q, pool.keys, pool.values,
                  H, kvh, step)
    assert got.shape == (4, 1, H, Dv)
    ref = _reference(q, [k for k, _ in seqs], [v for _, v in seqs],
                     step.ctx_lens)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


# ---- sliding windows -------------------------------------------------------
# Windows shorter than some sequences (LENS: 3 to 130 tokens), across block
# boundaries, and one longer than all of them.
WINDOWS = [1, 17, 64, 65, 200]


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("op", ["torch", "kernel"])
def test_decode_attends_over_the_window(op, window):
    """Each sequence's last position attends to its last ``window`` tokens
    only; the kernel reads nothing before them (NaN there)."""
    if op == "kernel" and not native.available():
        pytest.skip("no C++ compiler for the kernel")
    H, kvh, D = 6, 2, 20
    pool, _, seqs, step, q, new_k, new_v = _decode_case(H, kvh, D, D,
                                                        seed=4)
    _store(pool, new_k, new_v, step)
    keys, values = pool.keys, pool.values
    if op == "kernel":
        keys, values = _poison_unseen(keys, values, step, window)
    compute = (paged_cache.compute_kernel if op == "kernel"
               else paged_cache.compute)
    got = _attend(compute, q, keys, values, H, kvh, step, window=window)
    ref = _reference(q, [k for k, _ in seqs], [v for _, v in seqs],
                     step.ctx_lens, window=window)
    assert not got.isnan().any()
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [1, 30, 70])
@pytest.mark.parametrize("op", ["torch", "kernel"])
def test_prefill_chunks_attend_over_the_window(op, window):
    """A 130-token prompt in three chunks: every real position sees its
    last ``window`` tokens, against the float64 reference."""
    if op == "kernel" and not native.available():
        pytest.skip("no C++ compiler for the kernel")
    H, kvh, D, n = 4, 2, 16, 130
    pool, _, seq_k, seq_v, chunks, q, keys, values = _prefill_case(
        n, H, kvh, D, D, seed=5)
    compute = (paged_cache.compute_kernel if op == "kernel"
               else paged_cache.compute)
    pad = chunks.input_ids.shape[0] * BS - n
    for c in range(chunks.input_ids.shape[0]):
        row = chunks.row(c)
        _store(pool, keys[c:c + 1], values[c:c + 1], row)
        got = _attend(compute, q[c:c + 1], pool.keys, pool.values, H, kvh,
                      row, window=window)
        ref = _reference(q[c:c + 1], [seq_k], [seq_v], row.ctx_lens,
                         window=window)
        real = slice(max(0, pad - c * BS), BS)
        torch.testing.assert_close(got[:, real], ref[:, real], atol=1e-5,
                                   rtol=1e-5, msg=f"chunk {c}")


def _raw_args(B=2, kvh=2, group=2, D=16, blocks=3, block_size=4, MB=2):
    gen = torch.Generator().manual_seed(0)
    return dict(
        query=torch.randn(B, kvh, group, D, generator=gen),
        key_pool=torch.randn(blocks * block_size, kvh, D, generator=gen),
        value_pool=torch.randn(blocks * block_size, kvh, D, generator=gen),
        block_table=torch.tensor([[0, 2], [1, 0]])[:B, :MB],
        ctx_lens=torch.tensor([[5], [8]])[:B],
        block_size=block_size,
        scale=0.25)


def _paged(args):
    return torch.ops.spyre_kernels.paged_attention(
        args["query"], args["key_pool"], args["value_pool"],
        args["block_table"], args["ctx_lens"], args["block_size"],
        args["scale"])


@needs_kernel
def test_kernel_small_blocks_and_empty_context():
    args = _raw_args()
    out = _paged(args)  # [B, kvh, group, D]
    # Row 1, kv head 0, the first of its group: tokens 0-3 in block 1,
    # 4-7 in block 0, computed by hand.
    slots = [4, 5, 6, 7, 0, 1, 2, 3]
    k = args["key_pool"][slots, 0]  # [8, D]
    v = args["value_pool"][slots, 0]
    probs = torch.softmax(k @ args["query"][1, 0, 0] * 0.25, dim=0)
    torch.testing.assert_close(out[1, 0, 0], probs @ v, atol=1e-5,
                               rtol=1e-5)
    # A position that sees nothing gets zeros.
    args["ctx_lens"] = torch.tensor([[0], [8]])
    out = _paged(args)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    assert out[1].abs().sum() > 0


@needs_kernel
@pytest.mark.parametrize("change, message", [
    (dict(block_table=torch.tensor([[0, 3], [1, 0]])),
     "block 3 outside the pool of 3 blocks"),
    (dict(block_table=torch.tensor([[0, 2], [-1, 0]])),
     "block -1 outside the pool of 3 blocks"),
    (dict(ctx_lens=torch.tensor([[5], [9]])),
     "context length 9 outside the block table's 8 tokens"),
    (dict(ctx_lens=torch.tensor([[-1], [8]])),
     "context length -1 outside the block table's 8 tokens"),
    (dict(block_size=5), "pool of 12 slots is not a whole number of blocks "
     "of 5"),
    (dict(block_size=0), "not a whole number of blocks of 0"),
    (dict(key_pool=torch.zeros(12, 2, 8)), "pools"),
    (dict(value_pool=torch.zeros(8, 2, 16)), "pools"),
    (dict(ctx_lens=torch.tensor([[5]])), "ctx_lens"),
    (dict(ctx_lens=torch.zeros(2, 0, dtype=torch.long)), "ctx_lens"),
    (dict(query=torch.zeros(2, 2, 2, 16, dtype=torch.float64)),
     "a float32 or bfloat16 query, and keys and values of one dtype, "
     "float32 or bfloat16; got Double"),
    (dict(key_pool=torch.zeros(12, 2, 16, dtype=torch.bfloat16)),
     "keys and values of one dtype"),
    (dict(block_table=torch.tensor([[0, 2], [1, 0]], dtype=torch.int32)),
     "must be int64"),
    (dict(ctx_lens=torch.tensor([[5], [8]], dtype=torch.int32)),
     "must be int64"),
    (dict(block_table=torch.tensor([0, 2])), "2-d block table"),
])
def test_kernel_rejects_bad_inputs(change, message):
    args = dict(_raw_args(), **change)
    with pytest.raises(RuntimeError) as exc:
        _paged(args)
    assert message in str(exc.value)
