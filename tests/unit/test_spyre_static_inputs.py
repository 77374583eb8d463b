"""Unit tests of vllm/worker/spyre_static_inputs.py: the tensors of a static
batch's prefill and decode steps (no model, no engine).  The shape rules
are in test_spyre_static_shapes.py."""
import random

import pytest
import torch
import torch.nn.functional as F

from vllm.config.spyre import WarmupShape
from vllm.worker.spyre_static_inputs import (DecodeSteps, decode_inputs,
                                             prefill_inputs)

T, F_ = True, False


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


def test_sliding_window_narrows_the_masks_once_per_batch():
    """A window of 3: each real position sees its last 3 real tokens in
    the prefill, and each decode step the last 3 slots it may see."""
    shape = WarmupShape(prompt_len=6, new_tokens=4, batch_size=2)
    full = prefill_inputs([[1, 2, 3, 4, 5], [6, 7]], shape, pad_id=0)
    out = prefill_inputs([[1, 2, 3, 4, 5], [6, 7]], shape, pad_id=0,
                         window=3)
    col = torch.arange(6)
    band = (col.view(-1, 1) - col.view(1, -1)) < 3
    assert torch.equal(out.mask, full.mask & band)
    assert out.mask[0, 5].tolist() == [False] * 3 + [True] * 3
    steps = DecodeSteps([5, 2], shape, window=3)
    plain = DecodeSteps([5, 2], shape)
    for step in (1, 2, 3):
        got = steps.inputs([9, 9], step).mask
        slot = 6 + step - 1
        near = torch.arange(10) > slot - 3
        assert torch.equal(got, plain.inputs([9, 9], step).mask & near)
        assert got[0, 0, slot]
