"""The paged key/value pool of continuous batching against plain attention.

``paged_cache`` stores a step's keys and values into a block pool and
attends through a block table.  Checked here: the torch-op path
(``compute``) equals causal attention over the same keys laid out
contiguously (a float64 softmax written out), for a decode batch of
sequences of different lengths and for left-padded prefill chunks, with
grouped-query and plain heads and a shuffled block table; tracing under
``torch.compile`` with a dynamic batch; the pool's layout.  The C++
kernel's tests are in ``test_spyre_paged_kernel.py``; the cases both use
in ``paged_cases.py``.

``test_spyre_paged_model.py`` runs a whole tiny FMS model over the pool.
"""
from __future__ import annotations

import pytest
import torch

from paged_cases import (BS, HEADS, LENS, PAD_BLOCK, _attend, _decode_case,
                         _prefill_case, _reference, _slot, _store,
                         needs_kernel)
from vllm.attention.ops import spyre_kv_layout as kv_layout
from vllm.attention.ops import spyre_paged_cache as paged_cache
from vllm.attention.ops.spyre_kv_layout import CacheLayout


@pytest.mark.parametrize("H, kvh, D", HEADS)
def test_torch_ops_decode_matches_contiguous_attention(H, kvh, D):
    pool, tables, seqs, step, q, new_k, new_v = _decode_case(H, kvh, D, D)
    _store(pool, new_k, new_v, step)
    # The step's own keys landed in their slots.
    for b, n in enumerate(LENS):
        s = _slot(tables[b], n - 1)
        assert int(step.cache_slots[b, 0]) == s
        assert torch.equal(pool.keys[s], seqs[b][0][n - 1])
        assert torch.equal(pool.values[s], seqs[b][1][n - 1])
    for scale in (None, 0.3):
        got = _attend(paged_cache.compute, q, pool.keys, pool.values, H,
                      kvh, step, scale)
        assert got.shape == (4, 1, H, D)
        ref = _reference(q, [k for k, _ in seqs], [v for _, v in seqs],
                         step.ctx_lens, scale)
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_torch_ops_decode_with_padding_row():
    H, kvh, D = 4, 2, 16
    pool, tables, seqs, step, q, new_k, new_v = _decode_case(
        H, kvh, D, D, lens=[70])
    assert step.input_ids.shape == (2, 1)  # padded to MIN_DECODE_BATCH
    _store(pool, new_k, new_v, step)
    got = _attend(paged_cache.compute, q, pool.keys, pool.values, H, kvh,
                  step)
    # The live row sees its 70 tokens; the padding row sees the first slot
    # of the spare block.
    spare = PAD_BLOCK * BS
    ref = _reference(q, [seqs[0][0], pool.keys[spare:spare + 1]],
                     [seqs[0][1], pool.values[spare:spare + 1]],
                     step.ctx_lens)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("H, kvh, D", HEADS[:2])
@pytest.mark.parametrize("n", [1, 64, 100, 130])
def test_torch_ops_prefill_chunks_match_causal_attention(n, H, kvh, D):
    pool, table, seq_k, seq_v, chunks, q, keys, values = _prefill_case(
        n, H, kvh, D, D)
    for c in range(chunks.input_ids.shape[0]):
        row = chunks.row(c)
        _store(pool, keys[c:c + 1], values[c:c + 1], row)
        got = _attend(paged_cache.compute, q[c:c + 1], pool.keys,
                      pool.values, H, kvh, row)
        # Real positions: causal over the prompt; pads: its first token.
        ref = _reference(q[c:c + 1], [seq_k], [seq_v], row.ctx_lens)
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5,
                                   msg=f"chunk {c}")
    # The pool now holds the prompt in order through the table.
    for t in range(n):
        assert torch.equal(pool.keys[_slot(table, t)], seq_k[t])


def test_left_padded_chunk_equals_sdpa_causal():
    """The last position of a 100-token prompt's chunks, against torch's
    causal sdpa over the contiguous prompt."""
    H, kvh, D, n = 4, 2, 16, 100
    pool, table, seq_k, seq_v, chunks, q, keys, values = _prefill_case(
        n, H, kvh, D, D)
    outs = []
    for c in range(2):
        row = chunks.row(c)
        _store(pool, keys[c:c + 1], values[c:c + 1], row)
        outs.append(_attend(paged_cache.compute, q[c:c + 1], pool.keys,
                            pool.values, H, kvh, row))
    pad = 2 * BS - n
    got = torch.cat(outs, 1)[:, pad:]  # [1, n, H, D]
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.reshape(1, 2 * BS, H, D)[:, pad:].transpose(1, 2),
        seq_k.unsqueeze(0).transpose(1, 2).repeat_interleave(H // kvh, 1),
        seq_v.unsqueeze(0).transpose(1, 2).repeat_interleave(H // kvh, 1),
        is_causal=True).transpose(1, 2)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


# ---- torch.compile ---------------------------------------------------------
def _compiled_decode_steps(op):
    """The op traced once with a dynamic batch, then called at three batch
    sizes; returns the number of compilations."""
    from torch._dynamo.testing import CompileCounterWithBackend
    H, kvh, D = 4, 2, 16
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")

    def attend(q, pool_k, pool_v, block_table, ctx_lens):
        return op(q, pool_k, pool_v, H, kvh, 0.0, None,
                  block_table=block_table, ctx_lens=ctx_lens)

    compiled = torch.compile(attend, backend=counter, fullgraph=True)
    for lens in ([64, 65], [64, 65, 3], LENS):
        pool, _, _, step, q, new_k, new_v = _decode_case(H, kvh, D, D,
                                                         lens=lens)
        _store(pool, new_k, new_v, step)
        args = (q, pool.keys, pool.values, step.block_table, step.ctx_lens)
        for t in (q, step.block_table, step.ctx_lens):
            torch._dynamo.mark_dynamic(t, 0, min=2, max=16)
        got = compiled(*args)
        assert got.shape == (len(lens), 1, H, D)
        torch.testing.assert_close(got, attend(*args), atol=1e-5, rtol=1e-5)
    return counter.frame_count


def test_torch_ops_trace_with_dynamic_batch():
    assert _compiled_decode_steps(paged_cache.compute) == 1


@needs_kernel
def test_kernel_traces_with_dynamic_batch():
    assert _compiled_decode_steps(paged_cache.compute_kernel) == 1


# ---- PoolLayout ------------------------------------------------------------
def test_pool_layout_allocates_and_sizes_blocks():
    layout = kv_layout.PoolLayout(
        CacheLayout(layers=3, kv_heads=2, k_head_dim=16, v_head_dim=8))
    pools = layout.allocate(5, torch.float32)
    assert len(pools) == 3
    for k, v in pools:
        assert k.shape == (5 * BS, 2, 16) and v.shape == (5 * BS, 2, 8)
        assert not k.any() and not v.any()
    # One block over all layers: 3 layers * 64 tokens * 2 heads * (16 + 8)
    # floats.
    assert layout.block_bytes(torch.float32) == 3 * 64 * 2 * 24 * 4
    assert layout.block_bytes(torch.float16) == 3 * 64 * 2 * 24 * 2
    assert 5 * layout.block_bytes(torch.float32) == sum(
        k.nbytes + v.nbytes for k, v in pools)


def test_register_is_idempotent():
    from fms.modules import attention
    paged_cache.register()
    paged_cache.register()
    ops = attention.get_attention_type(attn_name=paged_cache.ATTN_NAME)
    assert ops["store"] is paged_cache.store
    assert ops["compute_decode"] is paged_cache.compute
    kernel = attention.get_attention_type(
        attn_name=paged_cache.ATTN_NAME_CPU_KERNEL)
    assert kernel["compute_decode"] is paged_cache.compute_kernel
    # No separate prefill op: a chunk attends through the pool too.
    assert ops["is_prefill"]() is True
    assert ops["compute_prefill"] is paged_cache.compute
