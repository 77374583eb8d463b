"""The C++ LoRA op (``spyre_kernels::lora_add_``) against the same products
in torch ops (``spyre_punica._add_masked``).

Rows on different slots and on none (-1), one to three slices of a layer
at adjacent columns, ranks that fill the shrink's blocks of four rows of A
and 16-lane vectors or not, inputs whose width is not a multiple of 16,
an adapter narrower than its slot (a vocabulary's padding), float32 and
bfloat16 adapters and outputs; and the op traced by dynamo (its fake
implementation)."""
from __future__ import annotations

import pytest
import torch

from vllm.lora.punica_wrapper.spyre_punica import (TILE, PunicaWrapperSpyre,
                                                   _add_masked, tile_b_)
from vllm.spyre_kernels import ops as native

pytestmark = pytest.mark.skipif(not native.available(),
                                reason="no C++ compiler for the kernel")

SLOTS = 3


def _slices(T: int, in_: int, R: int, widths: list[int], dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, in_, generator=gen)
    a = [(torch.randn(SLOTS, 1, R, in_, generator=gen) / 4).to(dtype)
         for _ in widths]
    b = [(torch.randn(SLOTS, 1, w, R, generator=gen) / 4).to(dtype)
         for w in widths]
    slots = torch.randint(-1, SLOTS, (T, ), generator=gen)
    return x, a, b, slots


def _tiled(b: torch.Tensor) -> torch.Tensor:
    """``b`` laid out as the op reads it, every slot."""
    b = b.clone()
    for slot in range(b.shape[0]):
        tile_b_(b, slot)
    return b


def _both(x, a, b, slots, widths, out_dtype, scale=0.75):
    """(the op's output, the torch ops' output) from the same start."""
    gen = torch.Generator().manual_seed(1)
    start = torch.randn(x.shape[0], sum(widths), generator=gen).to(out_dtype)
    ours, ref = start.clone(), start.clone().float()
    pairs: list = []
    for ai, bi in zip(a, b):
        pairs += [ai, _tiled(bi)]
    pairs += [None] * (6 - len(pairs))
    padded = list(widths) + [0] * (3 - len(widths))
    torch.ops.spyre_kernels.lora_add_(ours, x, *pairs, slots, scale, *padded)
    offset = 0
    for ai, bi, w in zip(a, b, widths):
        _add_masked(ref[:, offset:offset + w], x, ai.float(), bi.float(),
                    slots, scale)
        offset += w
    return ours, ref


@pytest.mark.parametrize("T, in_, R, widths", [
    (8, 576, 16, [576, 192, 192]),  # SmolLM2's q, k, v at rank 16
    (8, 576, 16, [1536, 1536]),  # its gate and up
    (5, 1536, 8, [576]),  # its down at rank 8
    (3, 40, 4, [24]),  # 40 inputs: no 16-lane blocks for the shrink
    (7, 64, 6, [33, 17]),  # rank 6: one block of four rows of A and two
    (1, 48, 1, [16]),  # rank 1
    (20, 32, 32, [100]),  # a prefill's rows, outputs not a multiple of 16
])
def test_float32_equals_torch_ops(T, in_, R, widths):
    x, a, b, slots = _slices(T, in_, R, widths, torch.float32)
    slots[0] = -1  # at least one row on no adapter
    ours, ref = _both(x, a, b, slots, widths, torch.float32)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)


def test_rows_on_no_adapter_are_untouched():
    x, a, b, slots = _slices(6, 64, 16, [64], torch.float32)
    slots.fill_(-1)
    ours, _ = _both(x, a, b, slots, [64], torch.float32)
    start, _ = _both(x, a, b, slots, [64], torch.float32, scale=0.0)
    assert torch.equal(ours, start)


def test_an_adapter_narrower_than_its_slot_adds_to_its_columns_only():
    """The head's adapter over a padded vocabulary: the output has fewer
    columns than B has rows."""
    x, a, b, slots = _slices(4, 64, 8, [80], torch.float32)
    out = torch.zeros(4, 72)
    ref = torch.zeros(4, 72)
    torch.ops.spyre_kernels.lora_add_(out, x, a[0], _tiled(b[0]), None, None,
                                      None, None, slots, 1.0, 72, 0, 0)
    _add_masked(ref, x, a[0], b[0], slots, 1.0)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_bfloat16_adapters(out_dtype):
    """bfloat16 matrices (``--lora-dtype``), products and sums in float32;
    a bfloat16 output rounded once."""
    widths = [96, 32]
    x, a, b, slots = _slices(6, 128, 16, widths, torch.bfloat16)
    ours, ref = _both(x, a, b, slots, widths, out_dtype)
    tol = 1e-5 if out_dtype == torch.float32 else 2e-2
    torch.testing.assert_close(ours.float(), ref, rtol=tol, atol=tol)


def test_traced_by_dynamo():
    widths = [64, 32]
    x, a, b, slots = _slices(4, 64, 8, widths, torch.float32)

    b = [_tiled(bi) for bi in b]

    def add(out):
        torch.ops.spyre_kernels.lora_add_(out, x, a[0], b[0], a[1], b[1],
                                          None, None, slots, 0.5, 64, 32, 0)
        return out

    compiled = torch.compile(add, backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(torch.zeros(4, 96)),
                               add(torch.zeros(4, 96)))


@pytest.mark.parametrize("n", [48, 40, 7])
def test_tiles_of_b(n):
    """``tile_b_``: output ``o``'s value at rank ``r`` moves to its tile's
    row ``r``, lane ``o % TILE`` (the last tile as wide as its outputs);
    the other slots keep their layout."""
    R = 5
    b = torch.arange(2 * n * R, dtype=torch.float32).view(2, 1, n, R)
    tiled = b.clone()
    tile_b_(tiled, 1)
    assert torch.equal(tiled[0], b[0])
    flat = tiled[1].view(-1)
    for o in range(n):
        start = o - o % TILE
        lanes = min(TILE, n - start)
        for r in range(R):
            assert flat[start * R + r * lanes + o % TILE] == b[1, 0, o, r]


def test_more_slices_than_one_call_takes():
    """The punica wrapper on the op: a layer of five slices (the op takes
    three) adds each slice's product to its own columns."""
    widths = (32, 16, 48, 16, 24)
    x, a, b, slots = _slices(6, 64, 8, list(widths), torch.float32)
    punica = PunicaWrapperSpyre(64, 8, "cpu")
    punica.native = True
    punica._token_lora_indices[:6] = slots
    y = torch.randn(6, sum(widths))
    ref = y.clone()
    punica.add_lora_linear(y, x, tuple(a), tuple(_tiled(bi) for bi in b),
                           None, 0.5, widths)
    offset = 0
    for ai, bi, w in zip(a, b, widths):
        _add_masked(ref[:, offset:offset + w], x, ai, bi, slots, 0.5)
        offset += w
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)


def test_the_head_product_runs_only_while_a_slot_adapts_the_head():
    """``add_lora_logits`` skips the product while no slot's adapter has
    the output head (``head_slots``, filled as slots are), and adds it once
    one has."""
    x, a, b, slots = _slices(4, 64, 8, [80], torch.float32)
    punica = PunicaWrapperSpyre(64, 8, "cpu")
    punica.native = True
    punica._sampler_indices[:4] = slots
    logits = torch.randn(4, 80)
    start = logits.clone()
    punica.head_slots = {0: False, 1: False}
    punica.add_lora_logits(logits, x, a[0], _tiled(b[0]), 1.0)
    assert torch.equal(logits, start)
    punica.head_slots[1] = True
    punica.add_lora_logits(logits, x, a[0], _tiled(b[0]), 1.0)
    _add_masked(start, x, a[0], b[0], slots, 1.0)
    torch.testing.assert_close(logits, start, rtol=1e-5, atol=1e-5)
