"""Unit tests of the pooling settings (vllm/config/spyre.py),
the packing of texts into shapes (vllm/worker/spyre_pooling_inputs.py) and
the pooling memory estimate: no model, no engine."""
import random

import pytest
import torch

from vllm.config.spyre import SpyreConfig, WarmupShape
from vllm.worker import spyre_memory
from vllm.core.spyre_pooling_shapes import (choose_pooling_shape,
                                            first_fit,
                                            Placement,
                                            rejection_reason,
                                            select_texts)
from vllm.worker.spyre_pooling_inputs import packed_inputs, plan_passes

P = Placement


def S(prompt_len, batch_size):
    return WarmupShape(prompt_len, 0, batch_size)


# ----------------------------------------------------------------- settings
def test_pooling_shapes_are_prompt_lens_by_batch_sizes():
    cfg = SpyreConfig.from_env(environ={
        "VLLM_SPYRE_DYNAMO_BACKEND": "eager",
        "VLLM_SPYRE_WARMUP_PROMPT_LENS": "256,64",
        "VLLM_SPYRE_WARMUP_BATCH_SIZES": "2,8"}, pooling=True)
    assert cfg.pooling and not cfg.use_cb
    assert cfg.warmup_shapes == (S(64, 8), S(256, 2))
    assert cfg.max_model_len == 256  # no new tokens
    assert cfg.max_num_batched_tokens == 512
    assert cfg.ignored_vars == ()


def test_pooling_ignores_new_tokens_and_cb_without_parsing_them():
    cfg = SpyreConfig.from_env(environ={
        "VLLM_SPYRE_DYNAMO_BACKEND": "eager",
        "VLLM_SPYRE_WARMUP_NEW_TOKENS": "x", "VLLM_SPYRE_USE_CB": "1"},
        pooling=True)
    assert cfg.ignored_vars == ("VLLM_SPYRE_WARMUP_NEW_TOKENS",
                                "VLLM_SPYRE_USE_CB")
    assert not cfg.use_cb and cfg.warmup_shapes == (S(64, 1), )


@pytest.mark.parametrize("env, message", [
    ({"VLLM_SPYRE_WARMUP_PROMPT_LENS": "64,128",
      "VLLM_SPYRE_WARMUP_BATCH_SIZES": "4"},
     "VLLM_SPYRE_WARMUP_PROMPT_LENS has 2, VLLM_SPYRE_WARMUP_BATCH_SIZES "
     "has 1"),
    ({"VLLM_SPYRE_WARMUP_PROMPT_LENS": "100"}, "100 is not a multiple of 64"),
    ({"VLLM_SPYRE_WARMUP_BATCH_SIZES": "0"}, "0 is not a positive integer"),
])
def test_bad_pooling_shapes_are_refused_by_name(env, message):
    with pytest.raises(ValueError, match=message):
        SpyreConfig.from_env(environ={"VLLM_SPYRE_DYNAMO_BACKEND": "eager",
                                      **env}, pooling=True)


def test_pooling_flag_round_trips():
    cfg = SpyreConfig.from_env(environ={"VLLM_SPYRE_DYNAMO_BACKEND":
                                        "eager"}, pooling=True)
    assert SpyreConfig.from_dict(cfg.to_dict()) == cfg


# ------------------------------------------------------------------ packing
def test_first_fit_places_in_order_into_the_first_row_with_room():
    assert first_fit([30, 40, 20, 64, 14], S(64, 3)) == [
        P(0, 0), P(1, 0), P(0, 30), P(2, 0), P(0, 50)]
    assert first_fit([30, 40, 40], S(64, 2)) is None
    assert first_fit([65], S(64, 8)) is None
    assert first_fit([], S(64, 1)) == []


def test_choose_pooling_shape_is_the_cheapest_that_holds_all():
    shapes = [S(256, 2), S(64, 8), S(64, 1)]
    assert choose_pooling_shape([10, 20, 30], shapes)[0] == S(64, 1)
    assert choose_pooling_shape([40, 40], shapes)[0] == S(64, 8)
    assert choose_pooling_shape([100], shapes)[0] == S(256, 2)
    # Nine texts of 64 fill more than 64x8; 256x2 holds eight.
    assert choose_pooling_shape([64] * 9, shapes) is None
    assert choose_pooling_shape([300], shapes) is None


def test_select_texts_takes_the_oldest_and_skips_what_does_not_fit():
    shapes = [S(64, 2)]
    # 50 and 40 fill the rows; 30 waits, 10 still fits beside 50.
    assert select_texts([50, 40, 30, 10], shapes, 100) == [0, 1, 3]
    assert select_texts([10] * 20, shapes, 100) == list(range(12))
    assert select_texts([10] * 20, shapes, 5) == list(range(5))
    assert select_texts([], shapes, 5) == []
    assert select_texts([65, 10], shapes, 5) == []


def test_select_texts_prefers_the_shape_that_takes_most():
    shapes = [S(64, 4), S(256, 1)]
    # The long text alone fits only 256x1; it goes first, with what fits.
    assert select_texts([200, 30, 30, 30], shapes, 100) == [0, 1]
    # Short texts: 64x4 takes all four, 256x1 only three.
    assert select_texts([60, 60, 60, 60], shapes, 100) == [0, 1, 2, 3]


@pytest.mark.parametrize("seed", range(20))
def test_plan_passes_runs_every_text_once_in_order(seed):
    rng = random.Random(seed)
    shapes = [S(64, 4), S(128, 2), S(256, 1)]
    waiting = [rng.randint(1, 256) for _ in range(rng.randint(1, 30))]
    # A step as the scheduler picks it is one pass, on a shape that fits.
    step = [waiting[i] for i in select_texts(waiting, shapes, 100)]
    passes = plan_passes(step, shapes)
    assert len(passes) == 1
    # Any set of texts runs, in order, split where no shape holds it all.
    passes = plan_passes(waiting, shapes)
    order = [i for _, indices, _ in passes for i in indices]
    assert order == list(range(len(waiting)))
    for shape, indices, placements in passes:
        assert first_fit([waiting[i] for i in indices], shape) == placements


def test_plan_passes_refuses_a_text_no_shape_holds():
    with pytest.raises(ValueError, match="The input has 65 tokens"):
        plan_passes([65], [S(64, 4)])


def test_rejection_reason_names_the_length_and_the_shapes():
    shapes = [S(64, 8), S(256, 2)]
    assert rejection_reason(256, shapes) is None
    msg = rejection_reason(257, shapes)
    assert "257 tokens" in msg and "longest" in msg
    assert "prompt lengths: 64, 256" in msg
    assert "VLLM_SPYRE_WARMUP_PROMPT_LENS" in msg


# ------------------------------------------------------------------- inputs
def test_packed_inputs_lay_out_texts_positions_types_and_mask():
    texts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    types = [None, [0, 1], None]
    shape = S(64, 2)
    placements = [
        P(0, 0), P(0, 3), P(1, 0)]
    inputs = packed_inputs(texts, types, shape, placements, pad_id=0,
                           first_position=2)
    assert inputs.input_ids.shape == (2, 64)
    assert inputs.input_ids[0, :6].tolist() == [5, 6, 7, 8, 9, 0]
    assert inputs.input_ids[1, :5].tolist() == [10, 11, 12, 13, 0]
    assert inputs.position_ids[0, :6].tolist() == [2, 3, 4, 2, 3, 0]
    assert inputs.token_type_ids[0, :6].tolist() == [0, 0, 0, 0, 1, 0]
    assert inputs.gather.tolist() == [0, 1, 2, 3, 4, 64, 65, 66, 67]
    mask = inputs.mask
    # Each text sees its own tokens only; padding sees itself only.
    assert mask[0, 0, :6].tolist() == [True, True, True, False, False, False]
    assert mask[0, 4, :6].tolist() == [False, False, False, True, True,
                                       False]
    assert mask[0, 5].nonzero().flatten().tolist() == [5]
    assert mask[1, 3, :5].tolist() == [True, True, True, True, False]
    assert mask.sum(-1).min() >= 1  # no row attends to nothing
    # The same texts as first slots, for the C++ kernel.
    assert inputs.text_starts[0, :6].tolist() == [0, 0, 0, 3, 3, 5]
    assert inputs.text_starts[1, :6].tolist() == [0, 0, 0, 0, 4, 5]
    starts = inputs.text_starts
    same_text = starts[:, :, None] == starts[:, None, :]
    assert torch.equal(same_text, mask)


def test_packing_changes_no_text_result():
    """Attention over packed texts equals attention over each text alone."""
    torch.manual_seed(0)
    lengths = [7, 20, 3, 30]
    shape = S(64, 1)
    placements = first_fit(lengths, shape)
    inputs = packed_inputs([[1] * n for n in lengths], [None] * 4, shape,
                           placements, pad_id=0)
    x = torch.randn(1, 64, 8)
    packed = torch.nn.functional.scaled_dot_product_attention(
        x, x, x, attn_mask=inputs.mask)[0][inputs.gather]
    alone = torch.cat([
        torch.nn.functional.scaled_dot_product_attention(
            x[:, p.offset:p.offset + n], x[:, p.offset:p.offset + n],
            x[:, p.offset:p.offset + n])[0]
        for p, n in zip(placements, lengths)])
    torch.testing.assert_close(packed, alone)


def test_packed_inputs_refuse_a_text_past_its_row():
    with pytest.raises(ValueError, match="does not fit"):
        packed_inputs([[1] * 10], [None], S(64, 1), [P(0, 60)], pad_id=0)


# ------------------------------------------------------------------- memory
def test_pooling_estimate_has_no_cache_and_sizes_the_largest_shape():
    geometry = spyre_memory.Geometry(layers=6, kv_heads=12, heads=12,
                                     head_size=32, hidden=384,
                                     intermediate=1536, vocab=30522, item=4)
    shapes = [S(64, 8), S(256, 4)]
    est = spyre_memory.pooling_estimate(100, 1000, geometry, shapes, "eager")
    assert est.kv_cache == 0
    assert "prompt_len=256, batch_size=4" in est.sized_for
    assert est.activations == (geometry.activation_bytes(4, 256, 256) +
                               4 * 256 * 256)


@pytest.mark.parametrize("dtype, backend, held, bf16", [
    (torch.bfloat16, "inductor", torch.float32, True),
    (torch.bfloat16, "eager", torch.float32, True),
    (torch.bfloat16, "sendnn", torch.bfloat16, False),
    (torch.float16, "eager", torch.float32, False),
    (torch.float32, "inductor", torch.float32, False),
])
def test_encoder_dtype(dtype, backend, held, bf16):
    """``--dtype bfloat16`` on the CPU: float32 tensors, bfloat16 products
    (the memory check counts the tensors as held)."""
    from vllm.model_executor.models.spyre_dtypes import encoder_dtype
    assert encoder_dtype(dtype, backend) == (held, bf16)
