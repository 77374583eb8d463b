"""Unit tests of vllm/worker/spyre_inputs.py (no model, no engine)."""
import random

import pytest
import torch
import torch.nn.functional as F

from vllm.platforms.spyre_config import WarmupShape
from vllm.platforms.spyre_static_shapes import (choose_shape,
                                                fits,
                                                parallel_samples_reason,
                                                rejection_reason,
                                                RequestSize,
                                                select_batch)
from vllm.worker.spyre_inputs import decode_inputs, DecodeSteps, prefill_inputs

T, F_ = True, False


def R(prompt_len, max_tokens=10):
    return RequestSize(prompt_len=prompt_len, max_tokens=max_tokens)


# --------------------------------------------------------------------- fits
@pytest.mark.parametrize("req, expected", [
    (R(64, 20), True),  # both limits are inclusive
    (R(1, 1), True),
    (R(65, 20), False),  # prompt one too long
    (R(64, 21), False),  # max_tokens one too many
    (R(100, 100), False),
])
def test_fits(req, expected):
    assert fits(WarmupShape(64, 20, 4), req) is expected


# ------------------------------------------------------------- choose_shape
def test_choose_shape_picks_cheapest_holding_all():
    small = WarmupShape(64, 20, 1)  # prefills 64 tokens
    wide = WarmupShape(64, 20, 4)  # 256
    long = WarmupShape(128, 20, 4)  # 512
    shapes = [long, wide, small]
    assert choose_shape([R(10)], shapes) == small
    assert choose_shape([R(10), R(20)], shapes) == wide
    assert choose_shape([R(10), R(100)], shapes) == long
    assert choose_shape([R(100)], shapes) == long


def test_choose_shape_uses_prefill_tokens_not_prompt_len():
    # A longer prompt in a narrower batch prefills fewer padded tokens.
    wide = WarmupShape(64, 20, 8)  # prefills 512 tokens
    narrow_long = WarmupShape(128, 20, 2)  # prefills 256 tokens
    assert choose_shape([R(10, 5)], [wide, narrow_long]) == narrow_long


def test_choose_shape_ignores_unused_new_tokens():
    # Equal prefill work: the shorter attention span wins, however many
    # new tokens each shape could produce.
    pair = WarmupShape(64, 4, 2)
    single_long = WarmupShape(128, 3, 1)
    assert choose_shape([R(30, 2)], [single_long, pair]) == pair


def test_choose_shape_checks_max_tokens():
    short_out = WarmupShape(64, 20, 4)
    long_out = WarmupShape(64, 100, 4)
    shapes = [short_out, long_out]
    assert choose_shape([R(10, 20)], shapes) == short_out
    assert choose_shape([R(10, 20), R(10, 50)], shapes) == long_out


def test_choose_shape_cost_tie_is_deterministic():
    a = WarmupShape(128, 64, 1)  # prefills 128 tokens
    b = WarmupShape(64, 32, 2)  # prefills 128 tokens
    assert a.cost[0] == b.cost[0]
    assert choose_shape([R(10, 20)], [a, b]) == b
    assert choose_shape([R(10, 20)], [b, a]) == b


def test_choose_shape_none_when_nothing_fits():
    shapes = [WarmupShape(64, 20, 4), WarmupShape(128, 20, 2)]
    assert choose_shape([R(129)], shapes) is None
    assert choose_shape([R(10, 21)], shapes) is None
    assert choose_shape([R(10), R(200)], shapes) is None


def test_choose_shape_none_when_too_many_requests():
    shapes = [WarmupShape(64, 20, 4), WarmupShape(128, 20, 2)]
    assert choose_shape([R(10)] * 4, shapes) == WarmupShape(64, 20, 4)
    assert choose_shape([R(10)] * 5, shapes) is None
    # 3 requests where one is long: only the 128 shape takes the long one,
    # and it holds only 2 rows.
    assert choose_shape([R(10), R(10), R(100)], shapes) is None


# ------------------------------------------------------------- select_batch
def test_select_batch_empty_queue():
    assert select_batch([], [WarmupShape(64, 20, 4)]) is None


def test_select_batch_none_when_oldest_fits_nothing():
    shapes = [WarmupShape(64, 20, 4)]
    # Later requests fit, but the oldest is never skipped over.
    assert select_batch([R(100), R(10), R(10)], shapes) is None
    assert select_batch([R(10, 50), R(10)], shapes) is None


def test_select_batch_oldest_always_included():
    short_wide = WarmupShape(64, 20, 4)
    long_narrow = WarmupShape(128, 20, 2)
    waiting = [R(100), R(10), R(10), R(10), R(10)]
    # The 64-shape would admit 4 requests, but not the oldest one.
    shape, idx = select_batch(waiting, [short_wide, long_narrow])
    assert idx[0] == 0
    assert idx == [0, 1]
    assert shape == long_narrow


def test_select_batch_skips_misfits_and_takes_later_fits():
    short_wide = WarmupShape(64, 20, 4)
    long_single = WarmupShape(128, 20, 1)
    waiting = [R(10), R(100), R(20), R(30), R(40), R(50)]
    shape, idx = select_batch(waiting, [long_single, short_wide])
    assert shape == short_wide
    assert idx == [0, 2, 3, 4]  # index 1 skipped, arrival order kept


def test_select_batch_skips_by_max_tokens_too():
    shape20 = WarmupShape(64, 20, 3)
    waiting = [R(10, 5), R(10, 30), R(10, 20), R(10, 1)]
    shape, idx = select_batch(waiting, [shape20])
    assert shape == shape20
    assert idx == [0, 2, 3]


def test_select_batch_keeps_arrival_order():
    shape = WarmupShape(128, 20, 8)
    waiting = [R(p) for p in (90, 5, 128, 64, 1)]
    got_shape, idx = select_batch(waiting, [shape])
    assert got_shape == shape
    assert idx == [0, 1, 2, 3, 4]
    assert idx == sorted(idx)


def test_select_batch_respects_batch_size():
    shape = WarmupShape(64, 20, 4)
    waiting = [R(10)] * 10
    got, idx = select_batch(waiting, [shape])
    assert got == shape
    assert idx == [0, 1, 2, 3]


def test_select_batch_most_requests_wins_over_cheaper():
    cheap_narrow = WarmupShape(64, 20, 2)  # prefills 128, admits 2
    dear_wide = WarmupShape(128, 20, 4)  # prefills 512, admits 4
    waiting = [R(10)] * 4
    shape, idx = select_batch(waiting, [cheap_narrow, dear_wide])
    assert shape == dear_wide
    assert idx == [0, 1, 2, 3]


def test_select_batch_most_requests_counts_only_fitting_requests():
    # The wide shape has more rows but only 1 waiting request fits it;
    # the long shape takes 2.
    short_wide = WarmupShape(64, 20, 8)
    long_pair = WarmupShape(128, 20, 2)
    waiting = [R(10), R(100), R(100)]
    shape, idx = select_batch(waiting, [short_wide, long_pair])
    assert shape == long_pair
    assert idx == [0, 1]


@pytest.mark.parametrize("order", [0, 1])
def test_select_batch_tie_goes_to_cheapest(order):
    cheap = WarmupShape(64, 20, 4)  # prefills 256
    dear = WarmupShape(128, 20, 4)  # prefills 512
    shapes = [dear, cheap] if order else [cheap, dear]
    waiting = [R(10)] * 3
    shape, idx = select_batch(waiting, shapes)
    assert shape == cheap
    assert idx == [0, 1, 2]


def test_select_batch_result_is_held_by_its_shape():
    shapes = [
        WarmupShape(64, 20, 4),
        WarmupShape(128, 20, 2),
        WarmupShape(256, 100, 1),
        WarmupShape(64, 100, 2),
    ]
    rng = random.Random(1234)
    for _ in range(300):
        waiting = [
            R(rng.randint(1, 300), rng.randint(1, 120))
            for _ in range(rng.randint(0, 8))
        ]
        res = select_batch(waiting, shapes)
        if not waiting or not any(fits(s, waiting[0]) for s in shapes):
            assert res is None
            continue
        shape, idx = res
        assert idx[0] == 0
        assert idx == sorted(set(idx))
        assert len(idx) <= shape.batch_size
        assert all(fits(shape, waiting[i]) for i in idx)
        assert shape == choose_shape([waiting[i] for i in idx], shapes)
        # No shape fitting the oldest request admits more requests.
        for s in shapes:
            if fits(s, waiting[0]):
                admitted = min(s.batch_size,
                               sum(fits(s, r) for r in waiting))
                assert admitted <= len(idx)


# --------------------------------------------------------- rejection_reason
def test_rejection_reason_none_when_some_shape_fits():
    shapes = [WarmupShape(64, 20, 4), WarmupShape(128, 10, 2)]
    assert rejection_reason(R(100, 10), shapes) is None
    assert rejection_reason(R(10, 20), shapes) is None


def test_rejection_reason_message():
    shapes = [WarmupShape(64, 20, 4), WarmupShape(128, 10, 2)]
    # prompt fits only the 128 shape, max_tokens only the 64 shape
    msg = rejection_reason(R(100, 15), shapes)
    assert msg is not None
    assert "prompt length 100" in msg
    assert "max_tokens 15" in msg
    assert "(prompt_len=64, new_tokens=20, batch_size=4)" in msg
    assert "(prompt_len=128, new_tokens=10, batch_size=2)" in msg
    assert "VLLM_SPYRE_WARMUP_PROMPT_LENS" in msg



def test_parallel_samples_reason_names_n_and_largest_batch():
    shapes = [WarmupShape(64, 20, 4), WarmupShape(128, 10, 2)]
    assert parallel_samples_reason(1, shapes) is None
    assert parallel_samples_reason(4, shapes) is None
    msg = parallel_samples_reason(5, shapes)
    assert msg is not None
    assert "n=5" in msg
    assert "largest batch size 4" in msg
    assert "VLLM_SPYRE_WARMUP_BATCH_SIZES" in msg

# ------------------------------------------------------------ prefill_inputs
def test_prefill_inputs_exact_small_case():
    shape = WarmupShape(prompt_len=4, new_tokens=3, batch_size=3)
    out = prefill_inputs([[5, 6], [7, 8, 9]], shape, pad_id=0)
    assert out.input_ids.dtype == torch.long
    assert out.position_ids.dtype == torch.long
    assert out.mask.dtype == torch.bool
    assert torch.equal(out.input_ids, torch.tensor([
        [0, 0, 5, 6],
        [0, 7, 8, 9],
        [0, 0, 0, 0],  # filler row
    ]))
    assert torch.equal(out.position_ids, torch.tensor([
        [0, 0, 0, 1],
        [0, 0, 1, 2],
        [0, 0, 0, 0],
    ]))
    expected_mask = torch.tensor([
        [  # row 0: pads at 0, 1; real at 2, 3
            [T, F_, F_, F_],
            [T, T, F_, F_],
            [F_, F_, T, F_],
            [F_, F_, T, T],
        ],
        [  # row 1: pad at 0; real at 1, 2, 3
            [T, F_, F_, F_],
            [F_, T, F_, F_],
            [F_, T, T, F_],
            [F_, T, T, T],
        ],
        [  # filler row: pads at 0..2, one "real" pad token at 3
            [T, F_, F_, F_],
            [T, T, F_, F_],
            [T, T, T, F_],
            [F_, F_, F_, T],
        ],
    ])
    assert torch.equal(out.mask, expected_mask)


def test_prefill_inputs_pad_id_and_full_rows():
    shape = WarmupShape(prompt_len=3, new_tokens=1, batch_size=2)
    out = prefill_inputs([[1, 2, 3], [4]], shape, pad_id=99)
    assert torch.equal(out.input_ids, torch.tensor([[1, 2, 3], [99, 99, 4]]))
    assert torch.equal(out.position_ids, torch.tensor([[0, 1, 2],
                                                       [0, 0, 0]]))
    # A full row has a plain causal mask.
    assert torch.equal(out.mask[0], torch.ones(3, 3, dtype=torch.bool).tril())


def test_prefill_inputs_filler_rows():
    shape = WarmupShape(prompt_len=5, new_tokens=2, batch_size=4)
    out = prefill_inputs([[11, 12]], shape, pad_id=7)
    assert out.input_ids.shape == (4, 5)
    assert out.position_ids.shape == (4, 5)
    assert out.mask.shape == (4, 5, 5)
    for row in (1, 2, 3):
        assert torch.equal(out.input_ids[row], torch.full((5, ), 7))
        assert out.position_ids[row].tolist() == [0] * 5
        # The last token (the filler's single "real" token) sees itself only.
        assert out.mask[row, -1].tolist() == [F_, F_, F_, F_, T]
    # All rows of zero prompts are filler.
    empty = prefill_inputs([], shape, pad_id=7)
    assert torch.equal(empty.input_ids, torch.full((4, 5), 7))


def test_prefill_positions_pads_zero_real_counting():
    shape = WarmupShape(prompt_len=8, new_tokens=1, batch_size=3)
    prompts = [[1] * 3, [2] * 8, [3]]
    out = prefill_inputs(prompts, shape, pad_id=0)
    for row, prompt in enumerate(prompts):
        n = len(prompt)
        pos = out.position_ids[row].tolist()
        assert pos[:8 - n] == [0] * (8 - n)
        assert pos[8 - n:] == list(range(n))


def test_prefill_mask_properties():
    shape = WarmupShape(prompt_len=6, new_tokens=1, batch_size=4)
    prompts = [[1, 2], [3, 4, 5, 6, 7, 8], [9], [4, 4, 4, 4]]
    out = prefill_inputs(prompts, shape, pad_id=0)
    P = 6
    for row, prompt in enumerate(prompts):
        first_real = P - len(prompt)
        m = out.mask[row]
        for i in range(P):
            assert m[i].any(), "a fully masked row would give NaN"
            for j in range(P):
                if j > i:
                    assert not m[i, j], "no attention to the future"
                elif i >= first_real:
                    # real tokens attend causally to real tokens only
                    assert bool(m[i, j]) == (j >= first_real)
                else:
                    # pads attend only to earlier (or the same) pads
                    assert bool(m[i, j]) == (j <= i)


def test_prefill_too_many_prompts():
    shape = WarmupShape(prompt_len=4, new_tokens=1, batch_size=2)
    with pytest.raises(ValueError, match="3 prompts exceed the batch size"):
        prefill_inputs([[1], [2], [3]], shape, pad_id=0)


def test_prefill_too_long_prompt():
    shape = WarmupShape(prompt_len=4, new_tokens=1, batch_size=2)
    with pytest.raises(ValueError,
                       match="a prompt of 5 tokens exceeds the prompt length"):
        prefill_inputs([[1], [1, 2, 3, 4, 5]], shape, pad_id=0)
    # exactly prompt_len is fine
    prefill_inputs([[1, 2, 3, 4]], shape, pad_id=0)


# ------------------------------------------------------------- decode_inputs
def test_decode_inputs_exact_small_case():
    shape = WarmupShape(prompt_len=4, new_tokens=3, batch_size=3)
    out = decode_inputs([21, 22, 0], [2, 3, 1], shape, step=2)
    assert torch.equal(out.input_ids, torch.tensor([[21], [22], [0]]))
    assert out.input_ids.dtype == torch.long
    assert torch.equal(out.position_ids, torch.tensor([[3], [4], [2]]))
    # The cache has 4 + 3 slots; step 2 writes slot 5, slot 6 is not
    # written yet.
    assert out.mask.shape == (3, 1, 7)
    assert torch.equal(out.mask, torch.tensor([
        [[F_, F_, T, T, T, T, F_]],
        [[F_, T, T, T, T, T, F_]],
        [[F_, F_, F_, T, T, T, F_]],
    ]))
    assert out.cache_slots.tolist() == [5]
    assert out.cache_len == 7


@pytest.mark.parametrize("step", [1, 2, 5])
def test_decode_positions_and_mask(step):
    P, G = 8, 6
    shape = WarmupShape(prompt_len=P, new_tokens=G, batch_size=3)
    lens = [3, 8, 1]
    out = decode_inputs([1, 2, 3], lens, shape, step=step)
    assert out.position_ids.shape == (3, 1)
    assert out.position_ids[:, 0].tolist() == [n + step - 1 for n in lens]
    # Every step of a shape has the same shapes: one compiled graph.
    assert out.mask.shape == (3, 1, P + G)
    assert out.cache_slots.tolist() == [P + step - 1]
    for row, n in enumerate(lens):
        m = out.mask[row, 0].tolist()
        assert m[:P - n] == [F_] * (P - n)  # pads
        assert m[P - n:P] == [T] * n  # real prompt tokens
        assert m[P:P + step] == [T] * step  # generated, current included
        assert m[P + step:] == [F_] * (G - step)  # slots not written yet


def test_decode_steps_cover_every_step_of_one_batch():
    P, G = 8, 6
    shape = WarmupShape(prompt_len=P, new_tokens=G, batch_size=3)
    lens = [3, 8, 1]
    steps = DecodeSteps(lens, shape)
    storages = set()
    for step in range(1, G):
        out = steps.inputs([4, 5, step], step)
        assert out.input_ids[:, 0].tolist() == [4, 5, step]
        assert out.position_ids[:, 0].tolist() == [n + step - 1 for n in lens]
        assert out.cache_slots.tolist() == [P + step - 1]
        assert out.cache_len == P + G
        for row, n in enumerate(lens):
            assert out.mask[row, 0].tolist() == (
                [F_] * (P - n) + [T] * (n + step) + [F_] * (G - step))
        # Laid out as the compiled graphs saw them at warm-up: contiguous,
        # from offset 0, and no step shares memory with another.
        for t in (out.position_ids, out.mask, out.cache_slots):
            assert t.is_contiguous() and t.storage_offset() == 0
            storages.add(t.untyped_storage().data_ptr())
    assert len(storages) == 3 * (G - 1)


@pytest.mark.parametrize("step", [0, 4])
def test_decode_step_outside_shape(step):
    shape = WarmupShape(prompt_len=4, new_tokens=4, batch_size=1)
    with pytest.raises(ValueError, match=f"decode step {step} is outside"):
        decode_inputs([1], [2], shape, step=step)


def test_prefill_writes_the_prompt_slots():
    shape = WarmupShape(prompt_len=5, new_tokens=3, batch_size=2)
    out = prefill_inputs([[1, 2], [3]], shape, pad_id=0)
    assert out.cache_slots.tolist() == [0, 1, 2, 3, 4]
    assert out.cache_len == 8


def test_decode_positions_continue_prefill_positions():
    shape = WarmupShape(prompt_len=6, new_tokens=4, batch_size=2)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8]]
    pre = prefill_inputs(prompts, shape, pad_id=0)
    lens = [len(p) for p in prompts]
    for step in (1, 2, 3):
        dec = decode_inputs([0, 0], lens, shape, step=step)
        last = pre.position_ids[:, -1]
        assert torch.equal(dec.position_ids[:, 0], last + step)


@pytest.mark.parametrize("tokens, lens", [
    ([1, 2], [1, 2, 3]),
    ([1, 2, 3], [1, 2]),
    ([1, 2, 3, 4], [1, 2, 3, 4]),
])
def test_decode_wrong_row_count(tokens, lens):
    shape = WarmupShape(prompt_len=4, new_tokens=2, batch_size=3)
    with pytest.raises(ValueError, match="decode needs exactly 3 rows"):
        decode_inputs(tokens, lens, shape, step=1)


# ------------------------------------------------- property: no NaN in SDPA
def test_prefill_mask_never_gives_nan_and_hides_pads():
    gen = torch.Generator().manual_seed(0)
    rng = random.Random(0)
    heads, dim = 2, 8
    for _ in range(60):
        B = rng.randint(1, 5)
        P = rng.randint(1, 12)
        shape = WarmupShape(prompt_len=P, new_tokens=1, batch_size=B)
        prompts = [[rng.randint(1, 50) for _ in range(rng.randint(0, P))]
                   for _ in range(rng.randint(0, B))]
        out = prefill_inputs(prompts, shape, pad_id=0)
        q, k, v = (torch.randn(B, heads, P, dim, generator=gen)
                   for _ in range(3))
        attn = F.scaled_dot_product_attention(q,
                                              k,
                                              v,
                                              attn_mask=out.mask.unsqueeze(1))
        assert not torch.isnan(attn).any(), (prompts, P, B)
        # Real tokens see exactly what unpadded causal attention sees.
        for row, prompt in enumerate(prompts):
            n = len(prompt)
            if n == 0:
                continue
            ref = F.scaled_dot_product_attention(q[row:row + 1, :, P - n:],
                                                 k[row:row + 1, :, P - n:],
                                                 v[row:row + 1, :, P - n:],
                                                 is_causal=True)
            torch.testing.assert_close(attn[row:row + 1, :, P - n:], ref)


def test_decode_mask_matches_unpadded_attention():
    gen = torch.Generator().manual_seed(1)
    P, step, heads, dim = 6, 3, 2, 4
    lens = [2, 6, 1]
    shape = WarmupShape(prompt_len=P, new_tokens=4, batch_size=3)
    out = decode_inputs([0, 0, 0], lens, shape, step=step)
    kv = P + shape.new_tokens  # slots past P + step hold stale values
    q = torch.randn(3, heads, 1, dim, generator=gen)
    k = torch.randn(3, heads, kv, dim, generator=gen)
    v = torch.randn(3, heads, kv, dim, generator=gen)
    attn = F.scaled_dot_product_attention(q,
                                          k,
                                          v,
                                          attn_mask=out.mask.unsqueeze(1))
    assert not torch.isnan(attn).any()
    for row, n in enumerate(lens):
        ref = F.scaled_dot_product_attention(
            q[row:row + 1], k[row:row + 1, :, P - n:P + step],
            v[row:row + 1, :, P - n:P + step])
        torch.testing.assert_close(attn[row:row + 1], ref)
