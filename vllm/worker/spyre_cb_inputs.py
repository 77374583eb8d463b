"""Pure functions that turn continuous-batching steps into paged tensors.

Under continuous batching (``VLLM_SPYRE_USE_CB=1``) a step is either the
prefill of one sequence or a decode step of every running sequence; vLLM's
block manager has given each sequence its blocks of ``block_size`` tokens.

* A prefill runs in one pass over the positions it computes, its length
  dynamic (at least ``MIN_PREFILL_LEN``; on the CPU's paged kernel), or in
  chunks of exactly ``block_size`` positions (the card, the torch ops), so
  one compiled graph serves every prompt length either way.  The chunks
  are aligned to the end of the span: the last chunk ends on its last
  token (whose logits are sampled) and the first chunk is left-padded.
  The span (``prefill_span``) skips what the pool holds already: a cached
  prefix (``--enable-prefix-caching``) and the earlier chunks of a
  chunked prefill (``--enable-chunked-prefill``).
* A decode step has one position per running sequence; its batch dimension
  is dynamic, and padded to at least ``MIN_DECODE_BATCH`` rows (dynamo
  specialises a size of 1).
* Every step carries a block table of a fixed width (the blocks of a
  ``max_model_len`` sequence) and, per query position, how many tokens of
  its sequence it sees.  Padding positions write their keys and values into
  a spare block that no sequence owns, and see one token.

The step's tensors are a ``PagedInputs`` (``vllm.attention.ops.spyre_paged_inputs``), which
the model reads; the scheduler's limits are in
``vllm.core.spyre_cb_blocks``.  Nothing here touches a model or global
state.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from vllm.attention.ops.spyre_paged_inputs import (MIN_DECODE_BATCH,
                                               MIN_PREFILL_LEN, PagedInputs)
from vllm.core.spyre_cb_blocks import blocks_needed


def _table_row(block_ids: Sequence[int], max_blocks: int,
               pad_block: int) -> list[int]:
    if len(block_ids) > max_blocks:
        raise ValueError(f"a sequence holds {len(block_ids)} blocks, more "
                         f"than the {max_blocks} of max_model_len")
    return list(block_ids) + [pad_block] * (max_blocks - len(block_ids))


def prefill_chunks(token_ids: Sequence[int], block_ids: Sequence[int],
                   block_size: int, max_blocks: int, pad_id: int,
                   pad_block: int,
                   chunk_len: Optional[int] = None, start: int = 0,
                   cached: int = 0) -> PagedInputs:
    """The prefill of positions ``start`` to ``len(token_ids) - 1`` of one
    sequence as ``[chunks, chunk_len]`` rows (by default ``chunk_len =
    block_size``, the card's chunks), aligned to the end: the last row ends
    on the last position, the first is left-padded.  A ``chunk_len`` of
    ``whole_prefill_len(n)`` gives one row of the ``n`` positions.

    Positions before ``start`` are in the pool already (a cached prefix,
    or earlier chunks of a chunked prefill); the positions computed see
    them through the block table.  A computed position below ``cached`` is
    run only for its logits (a prompt cached whole): its keys and values
    are in the pool already, maybe in a block other sequences share, so it
    writes them to the spare block instead."""
    n = len(token_ids)
    if n == 0:
        raise ValueError("a prefill needs at least one token")
    if not 0 <= start < n:
        raise ValueError(f"a prefill of {n} tokens cannot start at "
                         f"position {start}")
    count = n - start
    chunk_len = block_size if chunk_len is None else chunk_len
    if chunk_len < 1:
        raise ValueError(f"chunk_len must be positive, got {chunk_len}")
    need = blocks_needed(n, block_size)
    if len(block_ids) < need:
        raise ValueError(f"a prefill of {n} tokens needs {need} blocks, "
                         f"the sequence holds {len(block_ids)}")
    chunks = blocks_needed(count, chunk_len)
    total = chunks * chunk_len
    pad = total - count
    pos = torch.arange(total) - pad + start
    real = pos >= start
    ids = torch.full((total, ), pad_id, dtype=torch.long)
    ids[pad:] = torch.tensor(token_ids[start:], dtype=torch.long)
    table = torch.tensor(block_ids[:need], dtype=torch.long)
    real_pos = torch.where(real, pos, torch.zeros_like(pos))
    slots = table[real_pos // block_size] * block_size + real_pos % block_size
    spare = pad_block * block_size + torch.arange(total) % block_size
    slots = torch.where(real & (pos >= cached), slots, spare)
    ctx = torch.where(real, pos + 1, torch.ones_like(pos))
    row = torch.tensor(_table_row(block_ids, max_blocks, pad_block))
    shape = (chunks, chunk_len)
    return PagedInputs(ids.view(shape), real_pos.view(shape),
                       slots.view(shape), row.expand(chunks, -1).clone(),
                       ctx.view(shape))


def prefill_span(num_tokens: int, computed: int, chunk_tokens: int,
                 cached: int) -> tuple[int, int]:
    """``(start, end)``: the positions a prefill step computes, of a
    sequence of ``num_tokens`` tokens of which ``computed`` are computed
    by earlier steps, when the scheduler gives it ``chunk_tokens`` tokens
    (cached ones included) and the first ``cached`` tokens are in cached
    blocks.  It ends at ``end`` and starts after whatever is computed or
    cached; when everything up to ``end`` is, at ``end - 1``, as the last
    position's logits are still needed."""
    end = min(num_tokens, computed + chunk_tokens)
    if not 0 <= computed < end:
        raise ValueError(f"a prefill step of {chunk_tokens} tokens from "
                         f"position {computed} of a {num_tokens}-token "
                         "sequence computes nothing")
    return min(max(computed, cached), end - 1), end


def whole_prefill_len(num_tokens: int) -> int:
    """The positions of a prefill run in one pass: the sequence, left-padded
    to ``MIN_PREFILL_LEN``."""
    return max(num_tokens, MIN_PREFILL_LEN)


def decode_batch(last_tokens: Sequence[int], seq_lens: Sequence[int],
                 block_tables: Sequence[Sequence[int]], block_size: int,
                 max_blocks: int, pad_id: int, pad_block: int) -> PagedInputs:
    """One decode position per sequence: the last token of a sequence of
    ``seq_lens[i]`` tokens (the token being fed back included) at position
    ``seq_lens[i] - 1``, seeing all ``seq_lens[i]`` tokens.  Rows beyond
    the sequences, up to ``MIN_DECODE_BATCH``, are padding."""
    n = len(last_tokens)
    if not n == len(seq_lens) == len(block_tables):
        raise ValueError("one token, length and block table per sequence")
    if any(length < 1 for length in seq_lens):
        raise ValueError(f"sequence lengths must be positive, got "
                         f"{list(seq_lens)}")
    rows = max(n, MIN_DECODE_BATCH)
    spare = [pad_block] * max_blocks
    tables = [_table_row(t, max_blocks, pad_block)
              for t in block_tables] + [spare] * (rows - n)
    lens = list(seq_lens) + [1] * (rows - n)
    positions = [length - 1 for length in lens]
    slots = []
    for i, (table, p) in enumerate(zip(tables, positions)):
        if i < n and p // block_size >= len(block_tables[i]):
            raise ValueError(f"position {p} lies beyond the "
                             f"{len(block_tables[i])} blocks of its sequence")
        slots.append(table[p // block_size] * block_size + p % block_size
                     if i < n else pad_block * block_size + i)
    tokens = list(last_tokens) + [pad_id] * (rows - n)
    column = lambda xs: torch.tensor(xs, dtype=torch.long).unsqueeze(1)  # noqa: E731
    return PagedInputs(column(tokens), column(positions), column(slots),
                       torch.tensor(tables, dtype=torch.long), column(lens))


def verify_batch(last_tokens: Sequence[int],
                 proposals: Sequence[Sequence[int]],
                 seq_lens: Sequence[int],
                 block_tables: Sequence[Sequence[int]], width: int,
                 block_size: int, max_blocks: int, pad_id: int,
                 pad_block: int) -> PagedInputs:
    """A speculative verify step: per sequence of ``seq_lens[i]`` tokens,
    its last token at position ``seq_lens[i] - 1`` and its proposals at
    the positions after it, each position seeing its sequence up to
    itself, in rows of ``width`` positions.  The columns after a row's
    proposals, and the rows beyond the sequences up to
    ``MIN_DECODE_BATCH``, are padding: they write into the spare block
    and see one token."""
    n = len(last_tokens)
    if not n == len(proposals) == len(seq_lens) == len(block_tables):
        raise ValueError("one token, proposal list, length and block table "
                         "per sequence")
    rows = max(n, MIN_DECODE_BATCH)
    ids = torch.full((rows, width), pad_id, dtype=torch.long)
    positions = torch.zeros((rows, width), dtype=torch.long)
    slots = (pad_block * block_size +
             torch.arange(rows * width) % block_size).view(rows, width)
    ctx = torch.ones((rows, width), dtype=torch.long)
    tables = [_table_row(t, max_blocks, pad_block)
              for t in block_tables] + [[pad_block] * max_blocks] * (rows - n)
    for i in range(n):
        row = [last_tokens[i], *proposals[i]]
        if len(row) > width:
            raise ValueError(f"{len(proposals[i])} proposals do not fit a "
                             f"verify step of {width} positions")
        first = seq_lens[i] - 1
        if first < 0:
            raise ValueError(f"sequence lengths must be positive, got "
                             f"{seq_lens[i]}")
        last = first + len(row) - 1
        if last // block_size >= len(block_tables[i]):
            raise ValueError(f"position {last} lies beyond the "
                             f"{len(block_tables[i])} blocks of its sequence")
        pos = torch.arange(first, last + 1)
        table = torch.tensor(block_tables[i], dtype=torch.long)
        ids[i, :len(row)] = torch.tensor(row, dtype=torch.long)
        positions[i, :len(row)] = pos
        slots[i, :len(row)] = (table[pos // block_size] * block_size +
                               pos % block_size)
        ctx[i, :len(row)] = pos + 1
    return PagedInputs(ids, positions, slots,
                       torch.tensor(tables, dtype=torch.long), ctx)
