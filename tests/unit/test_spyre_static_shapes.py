"""Unit tests of vllm/core/spyre_static_shapes.py: which requests fit
which compiled shapes, the rules the static scheduler and model runner
share (no model, no engine)."""
import random

import pytest

from vllm.config.spyre import WarmupShape
from vllm.core.spyre_static_shapes import (RequestSize, choose_shape,
                                           fits,
                                           parallel_samples_reason,
                                           rejection_reason,
                                           select_batch)


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
