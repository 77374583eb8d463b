"""Unit tests of vllm/worker/spyre_cb_inputs.py's prefills (no model, no
engine); its decode batches are test_spyre_cb_decode.py's.

Tables of exact values: block size 4 keeps them readable by hand, block
size 64 (the card's) checks the lengths around a block boundary."""
import pytest

from vllm.attention.ops.spyre_paged_inputs import MIN_PREFILL_LEN
from vllm.core.spyre_cb_blocks import blocks_needed
from vllm.worker.spyre_cb_inputs import (decode_batch, prefill_chunks,
                                         prefill_span, whole_prefill_len)

from cb_cases import PAD_ID, assert_int64, rows


# ------------------------------------------------------------ blocks_needed
@pytest.mark.parametrize("tokens, expected", [(0, 0), (1, 1), (63, 1),
                                              (64, 1), (65, 2), (128, 2),
                                              (129, 3)])
def test_blocks_needed(tokens, expected):
    assert blocks_needed(tokens, 64) == expected


# ----------------------------------------------------------- prefill_chunks
def test_prefill_small_blocks_left_pads_first_chunk():
    # 6 tokens in blocks of 4: two chunks, the first left-padded by 2.
    tokens = [11, 12, 13, 14, 15, 16]
    got = prefill_chunks(tokens, [7, 2], block_size=4, max_blocks=4,
                         pad_id=PAD_ID, pad_block=9)
    assert_int64(got)
    assert rows(got.input_ids) == [[0, 0, 11, 12], [13, 14, 15, 16]]
    assert rows(got.position_ids) == [[0, 0, 0, 1], [2, 3, 4, 5]]
    # Tokens 0-1 in block 7 (slots 28-31), 2-3 likewise, 4-5 in block 2
    # (slots 8-9); the two pads in the spare block 9 (slots 36, 37).
    assert rows(got.cache_slots) == [[36, 37, 28, 29], [30, 31, 8, 9]]
    assert rows(got.ctx_lens) == [[1, 1, 1, 2], [3, 4, 5, 6]]
    assert rows(got.block_table) == [[7, 2, 9, 9], [7, 2, 9, 9]]


def test_prefill_small_blocks_exact_multiple_has_no_padding():
    got = prefill_chunks([1, 2, 3, 4, 5, 6, 7, 8], [3, 0], block_size=4,
                         max_blocks=3, pad_id=PAD_ID, pad_block=5)
    assert rows(got.input_ids) == [[1, 2, 3, 4], [5, 6, 7, 8]]
    assert rows(got.position_ids) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert rows(got.cache_slots) == [[12, 13, 14, 15], [0, 1, 2, 3]]
    assert rows(got.ctx_lens) == [[1, 2, 3, 4], [5, 6, 7, 8]]
    assert rows(got.block_table) == [[3, 0, 5], [3, 0, 5]]


def test_prefill_one_token_small_blocks():
    got = prefill_chunks([42], [1], block_size=4, max_blocks=2, pad_id=7,
                         pad_block=3)
    assert rows(got.input_ids) == [[7, 7, 7, 42]]
    assert rows(got.position_ids) == [[0, 0, 0, 0]]
    # Three pads in block 3 (slots 12-14); the token at offset 0 of block 1.
    assert rows(got.cache_slots) == [[12, 13, 14, 4]]
    assert rows(got.ctx_lens) == [[1, 1, 1, 1]]
    assert rows(got.block_table) == [[1, 3]]


def test_prefill_blocks_beyond_the_prompt_stay_in_the_table():
    # A sequence may already hold the block its first output goes to.
    got = prefill_chunks([1, 2, 3], [6, 4], block_size=4, max_blocks=3,
                         pad_id=PAD_ID, pad_block=8)
    assert rows(got.cache_slots) == [[32, 24, 25, 26]]
    assert rows(got.block_table) == [[6, 4, 8]]


def _expected_prefill(n, block_ids, bs, max_blocks, pad_block):
    """The same tables written out position by position."""
    chunks = -(-n // bs)
    pad = chunks * bs - n
    ids, pos, slots, ctx = [], [], [], []
    for j in range(chunks * bs):
        p = j - pad
        if p < 0:
            ids.append(PAD_ID)
            pos.append(0)
            slots.append(pad_block * bs + j)
            ctx.append(1)
        else:
            ids.append(1000 + p)
            pos.append(p)
            slots.append(block_ids[p // bs] * bs + p % bs)
            ctx.append(p + 1)

    def cut(xs):
        return [xs[c * bs:(c + 1) * bs] for c in range(chunks)]

    table = list(block_ids) + [pad_block] * (max_blocks - len(block_ids))
    return cut(ids), cut(pos), cut(slots), cut(ctx), [table] * chunks, pad


@pytest.mark.parametrize("n, chunks, pad", [(1, 1, 63), (63, 1, 1),
                                            (64, 1, 0), (65, 2, 63),
                                            (130, 3, 62)])
def test_prefill_block_size_64(n, chunks, pad):
    block_ids = [5, 0, 3][:chunks]
    max_blocks, pad_block = 4, 6
    got = prefill_chunks([1000 + i for i in range(n)], block_ids, 64,
                         max_blocks, PAD_ID, pad_block)
    ids, pos, slots, ctx, table, want_pad = _expected_prefill(
        n, block_ids, 64, max_blocks, pad_block)
    assert want_pad == pad
    assert got.input_ids.shape == (chunks, 64)
    assert rows(got.input_ids) == ids
    assert rows(got.position_ids) == pos
    assert rows(got.cache_slots) == slots
    assert rows(got.ctx_lens) == ctx
    assert rows(got.block_table) == table
    # The last chunk ends on the last token, which sees the whole prompt.
    assert got.input_ids[-1, -1] == 1000 + n - 1
    assert got.position_ids[-1, -1] == n - 1
    assert got.ctx_lens[-1, -1] == n
    # Every real token has its own slot, none in the spare block.
    real = got.input_ids != PAD_ID
    real_slots = got.cache_slots[real].tolist()
    assert len(set(real_slots)) == n
    assert all(s // 64 in block_ids for s in real_slots)
    assert got.cache_slots[~real].div(64, rounding_mode="floor").eq(
        pad_block).all()


def test_prefill_65_tokens_explicit_values():
    got = prefill_chunks(list(range(100, 165)), [2, 7], 64, 3, PAD_ID, 9)
    # Chunk 0: 63 pads, then token 0 at slot 2 * 64.
    assert got.input_ids[0, :63].eq(PAD_ID).all()
    assert got.input_ids[0, 63] == 100
    assert got.cache_slots[0, :63].tolist() == list(range(576, 639))
    assert got.cache_slots[0, 63] == 128
    assert got.ctx_lens[0].tolist() == [1] * 64
    # Chunk 1: tokens 1..64; token 63 ends block 2, token 64 starts block 7.
    assert got.input_ids[1].tolist() == list(range(101, 165))
    assert got.position_ids[1].tolist() == list(range(1, 65))
    assert got.cache_slots[1].tolist() == list(range(129, 192)) + [448]
    assert got.ctx_lens[1].tolist() == list(range(2, 66))


def test_prefill_whole_sequence_small_blocks():
    # 6 tokens in blocks of 4, in one row: no padding, slots across blocks.
    tokens = [11, 12, 13, 14, 15, 16]
    got = prefill_chunks(tokens, [7, 2], block_size=4, max_blocks=4,
                         pad_id=PAD_ID, pad_block=9,
                         chunk_len=whole_prefill_len(6))
    assert_int64(got)
    assert rows(got.input_ids) == [tokens]
    assert rows(got.position_ids) == [[0, 1, 2, 3, 4, 5]]
    assert rows(got.cache_slots) == [[28, 29, 30, 31, 8, 9]]
    assert rows(got.ctx_lens) == [[1, 2, 3, 4, 5, 6]]
    assert rows(got.block_table) == [[7, 2, 9, 9]]


def test_prefill_whole_one_token_is_padded_to_the_shortest_pass():
    assert MIN_PREFILL_LEN == 2
    assert [whole_prefill_len(n) for n in (1, 2, 3, 640)] == [2, 2, 3, 640]
    got = prefill_chunks([42], [1], block_size=4, max_blocks=2, pad_id=7,
                         pad_block=3, chunk_len=whole_prefill_len(1))
    assert rows(got.input_ids) == [[7, 42]]
    assert rows(got.position_ids) == [[0, 0]]
    assert rows(got.cache_slots) == [[12, 4]]
    assert rows(got.ctx_lens) == [[1, 1]]
    assert rows(got.block_table) == [[1, 3]]


@pytest.mark.parametrize("n", [1, 63, 64, 65, 130])
def test_prefill_whole_equals_the_chunks_joined(n):
    """One row of the whole sequence holds exactly the real positions of
    the 64-token chunks, in order, with the same slots and lengths."""
    block_ids = [5, 0, 3][:blocks_needed(n, 64)]
    tokens = [1000 + i for i in range(n)]
    whole = prefill_chunks(tokens, block_ids, 64, 4, PAD_ID, 6,
                           chunk_len=whole_prefill_len(n))
    chunks = prefill_chunks(tokens, block_ids, 64, 4, PAD_ID, 6)
    assert whole.input_ids.shape == (1, max(n, MIN_PREFILL_LEN))
    real = chunks.input_ids.flatten() != PAD_ID
    tail = slice(whole.input_ids.shape[1] - n, None)
    for name in ("input_ids", "position_ids", "cache_slots", "ctx_lens"):
        assert (getattr(whole, name)[0, tail].tolist() ==
                getattr(chunks, name).flatten()[real].tolist()), name
    assert rows(whole.block_table) == rows(chunks.block_table[:1])


def test_prefill_chunk_len_must_be_positive():
    with pytest.raises(ValueError, match="chunk_len must be positive, got 0"):
        prefill_chunks([1, 2], [0], 4, 2, PAD_ID, 3, chunk_len=0)


def test_prefill_errors():
    with pytest.raises(ValueError, match="at least one token"):
        prefill_chunks([], [0], 4, 2, PAD_ID, 3)
    with pytest.raises(ValueError) as exc:
        prefill_chunks(list(range(9)), [0, 1], 4, 4, PAD_ID, 5)
    assert str(exc.value) == ("a prefill of 9 tokens needs 3 blocks, the "
                              "sequence holds 2")
    with pytest.raises(ValueError) as exc:
        prefill_chunks(list(range(9)), [0, 1, 2], 4, 2, PAD_ID, 5)
    assert str(exc.value) == ("a sequence holds 3 blocks, more than the 2 "
                              "of max_model_len")
    with pytest.raises(ValueError) as exc:
        decode_batch([5], [0], [[3]], 64, 2, PAD_ID, 7)
    assert str(exc.value) == "sequence lengths must be positive, got [0]"


# ---------------------------------------- prefills from a position onwards
def test_prefill_from_a_cached_prefix_small_blocks():
    """10 tokens in blocks of 4, the first 8 cached: chunks of 4 cover
    positions 8 and 9 only, left-padded; they see the whole prefix."""
    tokens = list(range(100, 110))
    got = prefill_chunks(tokens, [7, 2, 5], block_size=4, max_blocks=4,
                         pad_id=PAD_ID, pad_block=9, start=8, cached=8)
    assert rows(got.input_ids) == [[0, 0, 108, 109]]
    assert rows(got.position_ids) == [[0, 0, 8, 9]]
    assert rows(got.cache_slots) == [[36, 37, 20, 21]]
    assert rows(got.ctx_lens) == [[1, 1, 9, 10]]
    assert rows(got.block_table) == [[7, 2, 5, 9]]


def test_prefill_of_a_prompt_cached_whole_writes_the_spare_block():
    """8 tokens, both blocks cached: the last position runs for its
    logits, its keys and values going to the spare block (9), not to the
    shared block 2."""
    got = prefill_chunks(list(range(100, 108)), [7, 2], block_size=4,
                         max_blocks=2, pad_id=PAD_ID, pad_block=9,
                         chunk_len=whole_prefill_len(1), start=7, cached=8)
    assert rows(got.input_ids) == [[0, 107]]
    assert rows(got.position_ids) == [[0, 7]]
    assert rows(got.cache_slots) == [[36, 37]]
    assert rows(got.ctx_lens) == [[1, 8]]


@pytest.mark.parametrize("start", [1, 63, 64, 65, 127])
def test_prefill_from_start_equals_the_tail_of_the_whole(start):
    """Positions ``start`` onwards of a 130-token prefill, in one row, hold
    exactly what the whole sequence's row holds for them."""
    tokens = [1000 + i for i in range(130)]
    block_ids = [5, 0, 3]
    whole = prefill_chunks(tokens, block_ids, 64, 4, PAD_ID, 6,
                           chunk_len=whole_prefill_len(130))
    part = prefill_chunks(tokens, block_ids, 64, 4, PAD_ID, 6,
                          chunk_len=whole_prefill_len(130 - start),
                          start=start)
    tail = slice(part.input_ids.shape[1] - (130 - start), None)
    for name in ("input_ids", "position_ids", "cache_slots", "ctx_lens"):
        assert (getattr(part, name)[0, tail].tolist() ==
                getattr(whole, name)[0, start:].tolist()), name


@pytest.mark.parametrize("n, computed, chunk, cached, span", [
    (130, 0, 130, 0, (0, 130)),      # a whole prompt
    (130, 0, 130, 64, (64, 130)),    # one block cached
    (130, 0, 130, 128, (128, 130)),  # two blocks cached
    (128, 0, 128, 128, (127, 128)),  # cached whole: the last position
    (64, 0, 64, 64, (63, 64)),
    (65, 0, 65, 64, (64, 65)),
    (130, 0, 64, 0, (0, 64)),        # chunked: the first chunk
    (130, 64, 64, 0, (64, 128)),     # the second
    (130, 128, 64, 0, (128, 130)),   # the last, shorter
    (300, 0, 192, 128, (128, 192)),  # cached blocks, then a chunk
    (300, 128, 128 + 64, 256, (256, 300)),  # cached blocks count
])
def test_prefill_span(n, computed, chunk, cached, span):
    assert prefill_span(n, computed, chunk, cached) == span


def test_prefill_span_and_start_errors():
    with pytest.raises(ValueError, match="computes nothing"):
        prefill_span(10, 10, 4, 0)
    with pytest.raises(ValueError, match="cannot start at position 3"):
        prefill_chunks([1, 2, 3], [0], 4, 2, PAD_ID, 3, start=3)
