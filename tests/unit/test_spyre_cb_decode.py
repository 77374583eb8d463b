"""Unit tests of vllm/worker/spyre_cb_inputs.py's decode batches and of
``PagedInputs`` (no model, no engine): tables of exact values."""
import pytest
import torch

from vllm.attention.ops.spyre_paged_inputs import MIN_DECODE_BATCH
from vllm.worker.spyre_cb_inputs import decode_batch, prefill_chunks

from cb_cases import PAD_ID, assert_int64, rows


# ------------------------------------------------------------- decode_batch
def test_decode_small_blocks():
    got = decode_batch([21, 22, 23], [1, 4, 6], [[3], [0], [2, 5]],
                       block_size=4, max_blocks=3, pad_id=PAD_ID,
                       pad_block=7)
    assert_int64(got)
    assert rows(got.input_ids) == [[21], [22], [23]]
    assert rows(got.position_ids) == [[0], [3], [5]]
    # 1 token: block 3 offset 0; 4 tokens: block 0 offset 3; 6 tokens:
    # block 5 offset 1.
    assert rows(got.cache_slots) == [[12], [3], [21]]
    assert rows(got.ctx_lens) == [[1], [4], [6]]
    assert rows(got.block_table) == [[3, 7, 7], [0, 7, 7], [2, 5, 7]]


def test_decode_pads_to_min_batch():
    assert MIN_DECODE_BATCH == 2
    got = decode_batch([9], [3], [[4]], block_size=4, max_blocks=2, pad_id=1,
                       pad_block=6)
    assert rows(got.input_ids) == [[9], [1]]
    assert rows(got.position_ids) == [[2], [0]]
    # The padding row writes into the spare block (6 * 4 + its row index)
    # and sees one token.
    assert rows(got.cache_slots) == [[18], [25]]
    assert rows(got.ctx_lens) == [[3], [1]]
    assert rows(got.block_table) == [[4, 6], [6, 6]]


def test_decode_without_sequences_is_all_padding():
    got = decode_batch([], [], [], block_size=4, max_blocks=2, pad_id=1,
                       pad_block=6)
    assert rows(got.input_ids) == [[1], [1]]
    assert rows(got.cache_slots) == [[24], [25]]
    assert rows(got.ctx_lens) == [[1], [1]]
    assert rows(got.block_table) == [[6, 6], [6, 6]]


def test_decode_batch_is_not_padded_beyond_its_sequences():
    got = decode_batch([1] * 5, [2] * 5, [[i] for i in range(5)], 4, 1,
                       PAD_ID, 9)
    assert got.input_ids.shape == (5, 1)
    assert rows(got.cache_slots) == [[1], [5], [9], [13], [17]]


def test_decode_across_a_block_boundary():
    # 64 tokens: the last one is offset 63 of the first block; 65 tokens:
    # offset 0 of the second.
    got = decode_batch([5, 6], [64, 65], [[3, 1], [3, 1]], 64, 4, PAD_ID, 8)
    assert rows(got.position_ids) == [[63], [64]]
    assert rows(got.cache_slots) == [[3 * 64 + 63], [1 * 64]]
    assert rows(got.ctx_lens) == [[64], [65]]
    assert rows(got.block_table) == [[3, 1, 8, 8], [3, 1, 8, 8]]


def test_decode_errors():
    with pytest.raises(ValueError, match="one token, length and block table"):
        decode_batch([1, 2], [3], [[0], [1]], 4, 2, PAD_ID, 5)
    with pytest.raises(ValueError, match="one token, length and block table"):
        decode_batch([1], [3], [[0], [1]], 4, 2, PAD_ID, 5)
    with pytest.raises(ValueError) as exc:
        decode_batch([1], [65], [[0]], 64, 2, PAD_ID, 5)
    assert str(exc.value) == ("position 64 lies beyond the 1 blocks of its "
                              "sequence")
    with pytest.raises(ValueError) as exc:
        decode_batch([1], [3], [[0, 1, 2]], 4, 2, PAD_ID, 5)
    assert str(exc.value) == ("a sequence holds 3 blocks, more than the 2 "
                              "of max_model_len")


# ------------------------------------------------------------ PagedInputs
def test_row_is_an_independent_batch_of_one():
    chunks = prefill_chunks(list(range(1, 10)), [0, 1, 2], 4, 3, PAD_ID, 3)
    before = [t.clone() for t in (chunks.input_ids, chunks.position_ids,
                                  chunks.cache_slots, chunks.block_table,
                                  chunks.ctx_lens)]
    row = chunks.row(1)
    # 9 tokens in 3 chunks of 4, left-padded by 3: chunk 1 holds
    # positions 1-4, the last of them at offset 0 of block 1.
    assert rows(row.input_ids) == [[2, 3, 4, 5]]
    assert rows(row.position_ids) == [[1, 2, 3, 4]]
    assert rows(row.cache_slots) == [[1, 2, 3, 4]]
    assert rows(row.ctx_lens) == [[2, 3, 4, 5]]
    assert rows(row.block_table) == [[0, 1, 2]]
    for t in (row.input_ids, row.position_ids, row.cache_slots,
              row.block_table, row.ctx_lens):
        t.fill_(-1)
    after = (chunks.input_ids, chunks.position_ids, chunks.cache_slots,
             chunks.block_table, chunks.ctx_lens)
    for a, b in zip(before, after):
        assert torch.equal(a, b)
    # The block table rows of a prefill are copies too, not one expanded
    # row: writing one chunk's table leaves the others alone.
    chunks.block_table[0, 0] = 99
    assert chunks.block_table[1, 0] == 0


def test_paged_inputs_is_frozen():
    got = decode_batch([1], [1], [[0]], 4, 1, PAD_ID, 1)
    with pytest.raises(Exception):
        got.input_ids = torch.zeros(1)  # type: ignore[misc]
