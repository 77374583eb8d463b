"""Cases shared by the paged-pool tests (``test_spyre_paged_kv.py``, the
torch-op path; ``test_spyre_paged_kernel.py``, the C++ kernel): a pool of
blocks holding finite garbage, sequences written through shuffled block
tables, decode batches and prefill chunks over them, and attention in
float64 over the same keys laid out contiguously."""
from __future__ import annotations

import pytest
import torch

from vllm.spyre_kernels import ops as native
from vllm.attention.ops import spyre_paged_cache as paged_cache
from vllm.attention.ops.spyre_paged_inputs import PagedInputs
from vllm.core.spyre_cb_blocks import blocks_needed
from vllm.config.spyre import CB_BLOCK_SIZE
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
