"""The paged key/value pool of continuous batching against plain attention.

``paged_cache`` stores a step's keys and values into a block pool and
attends through a block table.  Checked here:

* the torch-op path (``compute``) equals causal attention over the same
  keys laid out contiguously (a float64 softmax written out), for a decode
  batch of sequences of different lengths and for left-padded prefill
  chunks, with grouped-query and plain heads and a shuffled block table;
* the C++ kernel path (``compute_kernel``) equals the torch-op path, also
  for head sizes that do not fill a 16-float vector, and never reads a slot
  outside a row's context (those hold NaN here);
* the kernel's argument checks, and tracing under ``torch.compile`` with a
  dynamic batch.

``test_spyre_paged_model.py`` runs a whole tiny FMS model over the pool.
"""
from __future__ import annotations

import pytest
import torch

from vllm.attention.ops import spyre_kv_layout as kv_layout
from vllm.attention.ops import spyre_native as native
from vllm.attention.ops import spyre_paged_cache as paged_cache
from vllm.attention.ops.spyre_kv_layout import CacheLayout
from vllm.platforms.spyre_config import CB_BLOCK_SIZE
from vllm.attention.ops.spyre_paged_inputs import PagedInputs
from vllm.platforms.spyre_cb_blocks import blocks_needed
from vllm.worker.spyre_cb_inputs import decode_batch, prefill_chunks


BS = CB_BLOCK_SIZE
needs_kernel = pytest.mark.skipif(not native.available(),
                                  reason="no C++ compiler for the kernel")

# (heads, kv heads, head size): grouped-query, plain multi-head, and head
# sizes that are not a multiple of the kernel's 16-float vector.
HEADS = [(4, 2, 16), (3, 3, 8), (6, 2, 20), (2, 1, 36)]


def _slot(table, t: int) -> int:
    return int(table[t // BS]) * BS + t % BS


class Pool:
    """A pool of ``blocks`` blocks holding finite garbage, and the
    contiguous keys/values of the sequences written into it."""

    def __init__(self, blocks, kvh, D, Dv, seed=0):
        self.gen = torch.Generator().manual_seed(seed)
        self.kvh, self.D, self.Dv = kvh, D, Dv
        self.keys = 3 * torch.randn(blocks * BS, kvh, D, generator=self.gen)
        self.values = 3 * torch.randn(blocks * BS, kvh, Dv,
                                      generator=self.gen)

    def sequence(self, n):
        """Random keys/values of an n-token sequence: [n, kvh, D/Dv]."""
        return (torch.randn(n, self.kvh, self.D, generator=self.gen),
                torch.randn(n, self.kvh, self.Dv, generator=self.gen))

    def write(self, table, k, v, start=0, end=None):
        """Tokens start..end of a sequence through its block table, as
        earlier steps would have stored them."""
        end = k.shape[0] if end is None else end
        for t in range(start, end):
            self.keys[_slot(table, t)] = k[t]
            self.values[_slot(table, t)] = v[t]


def _reference(q, seq_k, seq_v, ctx_lens, scale=None, window=0):
    """q: [B, L, H, D]; seq_k/seq_v: per row, the contiguous [n, kvh, D]
    keys/values of its sequence; ctx_lens: [B, L].  Attention of each
    position over the first ctx_lens[b, l] tokens (with ``window``, the
    last ``window`` of them), in float64."""
    B, L, H, D = q.shape
    scale = D**-0.5 if scale is None else scale
    out = torch.empty(B, L, H, seq_v[0].shape[-1], dtype=torch.float64)
    for b in range(B):
        kvh = seq_k[b].shape[1]
        k = seq_k[b].double().repeat_interleave(H // kvh, dim=1)  # [n, H, D]
        v = seq_v[b].double().repeat_interleave(H // kvh, dim=1)
        for pos in range(L):
            n = int(ctx_lens[b, pos])
            first = max(0, n - window) if window else 0
            scores = torch.einsum("hd,nhd->hn", q[b, pos].double(),
                                  k[first:n]) * scale
            probs = torch.exp(scores - scores.max(-1, keepdim=True).values)
            probs = probs / probs.sum(-1, keepdim=True)
            out[b, pos] = torch.einsum("hn,nhd->hd", probs, v[first:n])
    return out.float()


def _attend(op, q, pool_k, pool_v, H, kvh, step: PagedInputs, scale=None,
            window=0):
    return op(q, pool_k, pool_v, H, kvh, 0.0, scale,
              block_table=step.block_table, ctx_lens=step.ctx_lens,
              cache_slots=step.cache_slots, spyre_window=window)


def _store(pool, keys, values, step):
    k, v, rk, rv = paged_cache.store(keys, values, pool.keys, pool.values,
                                     cache_slots=step.cache_slots)
    assert k is pool.keys and v is pool.values
    assert rk is pool.keys and rv is pool.values


# ---- a decode batch --------------------------------------------------------
LENS = [64, 65, 3, 130]  # both sides of a block boundary, one and 3 blocks
POOL_BLOCKS = 9  # 1 + 2 + 1 + 3 blocks, one free, and the spare (8)
PAD_BLOCK = 8
MAX_BLOCKS = 4


def _decode_case(H, kvh, D, Dv, seed=0, lens=LENS):
    """A pool holding every sequence but its last token, the decode step of
    the last tokens, their queries/keys/values and the contiguous
    sequences."""
    pool = Pool(POOL_BLOCKS, kvh, D, Dv, seed)
    order = torch.randperm(PAD_BLOCK, generator=pool.gen).tolist()
    tables, seqs = [], []
    for n in lens:
        need = blocks_needed(n, BS)
        tables.append(order[:need])
        order = order[need:]
        seqs.append(pool.sequence(n))
        pool.write(tables[-1], *seqs[-1], end=n - 1)
    step = decode_batch([7] * len(lens), lens, tables, BS, MAX_BLOCKS, 0,
                        PAD_BLOCK)
    B = step.input_ids.shape[0]
    q = torch.randn(B, 1, H, D, generator=pool.gen)
    new_k = torch.randn(B, 1, kvh, D, generator=pool.gen)
    new_v = torch.randn(B, 1, kvh, Dv, generator=pool.gen)
    for b, n in enumerate(lens):
        new_k[b, 0], new_v[b, 0] = seqs[b][0][n - 1], seqs[b][1][n - 1]
    return pool, tables, seqs, step, q, new_k, new_v


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


# ---- prefill chunks --------------------------------------------------------
def _prefill_case(n, H, kvh, D, Dv, seed=0):
    """Chunks of an n-token prompt over a shuffled table, with per chunk the
    queries and keys/values (pads: random)."""
    pool = Pool(POOL_BLOCKS, kvh, D, Dv, seed)
    table = torch.randperm(PAD_BLOCK, generator=pool.gen)[:blocks_needed(
        n, BS)].tolist()
    seq_k, seq_v = pool.sequence(n)
    chunks = prefill_chunks(list(range(1, n + 1)), table, BS, MAX_BLOCKS, 0,
                            PAD_BLOCK)
    C = chunks.input_ids.shape[0]
    pad = C * BS - n
    keys = torch.randn(C * BS, kvh, D, generator=pool.gen)
    values = torch.randn(C * BS, kvh, Dv, generator=pool.gen)
    keys[pad:], values[pad:] = seq_k, seq_v
    q = torch.randn(C, BS, H, D, generator=pool.gen)
    return (pool, table, seq_k, seq_v, chunks, q, keys.view(C, BS, kvh, D),
            values.view(C, BS, kvh, Dv))


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


# ---- the C++ kernel --------------------------------------------------------
def _poison_unread(pool_k, pool_v, step: PagedInputs):
    """Copies of the pools with NaN in every slot no position may read."""
    readable = torch.zeros(pool_k.shape[0], dtype=torch.bool)
    B, L = step.ctx_lens.shape
    for b in range(B):
        for pos in range(L):
            for t in range(int(step.ctx_lens[b, pos])):
                readable[_slot(step.block_table[b], t)] = True
    k, v = pool_k.clone(), pool_v.clone()
    k[~readable] = float("nan")
    v[~readable] = float("nan")
    assert (~readable).sum() > BS  # whole blocks are poisoned
    return k, v


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


def _poison_unseen(pool_k, pool_v, step: PagedInputs, window: int):
    """Copies of the pools with NaN in every slot before each sequence's
    window (the last position of a decode step)."""
    k, v = pool_k.clone(), pool_v.clone()
    for b in range(step.ctx_lens.shape[0]):
        n = int(step.ctx_lens[b, -1])
        for t in range(max(0, n - window)):
            k[_slot(step.block_table[b], t)] = float("nan")
            v[_slot(step.block_table[b], t)] = float("nan")
    return k, v


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
    return torch.ops.spyre_cpu.paged_attention(
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
