"""int8 and int4 codes on inputs held as 16-bit integers
(``quant_int16.h``): the decode path of int8 and int4 layers at the
bfloat16 precision, for up to ``INT_ROWS`` rows where the CPU has
AVX512BW, ``INT_ROWS_AVX2`` where it has AVX2 and no AVX-512 (the AVX2
build's tiles are checked against these bit for bit in
``test_spyre_quant.py::test_kernel_without_avx512``).

Each span of features (the weight's group, or a part of 256, 128 or 64
features of a longer one) holds its bfloat16 inputs as 16-bit integers
against 2^(E - 14), E the exponent of the span's largest magnitude.  The
tests rebuild those integers here and check the kernel's product against
them in float64, for groups of 128 with a shorter last one, per-channel
scales over 2048 and 8192 features, offsets and a zero point; that an
input within 2^7 of its span's largest is held exactly; which heights
take the path; and which CPUs.
"""
from __future__ import annotations

import platform

import pytest
import torch

from vllm.spyre_kernels import ops as native
from vllm.model_executor.layers.quantization import (
    spyre_quant_linear as sql)
from vllm.model_executor.layers.quantization.spyre_quant_linear import (
    QuantWeight, pack, quant_linear)

integer_path = pytest.mark.skipif(
    not (platform.machine() == "x86_64" and sql.integer_rows("int8", True)
         and native.available()),
    reason="the integer tiles are built with AVX512BW or AVX2 alone")


def _int8_weight(n: int, k: int, group: int, zeros, seed: int = 0,
                 kind: str = "int8"):
    g = torch.Generator().manual_seed(seed)
    groups = -(-k // group)
    low, high = (-128, 128) if kind == "int8" else (0, 16)
    codes = torch.randint(low, high, (n, k), generator=g, dtype=torch.int8)
    scales = torch.rand(n, groups, generator=g) * 0.01 + 0.001
    if zeros == "offsets":
        z = torch.randint(-4, 5, (n, groups), generator=g).float()
    elif zeros == "uniform":
        z = torch.full((n, groups), 3.0)
    else:
        z = None
    return QuantWeight(kind, codes, scales, z, group)


def _span(group: int) -> int:
    if group <= 256:
        return group
    return next(s for s in (256, 128, 64) if group % s == 0)


def held_as_int16(x: torch.Tensor, span: int) -> torch.Tensor:
    """The bfloat16 inputs as the kernel holds them, in float64: each
    span's values rounded (to nearest, ties to even) to multiples of
    2^(E - 14), E the exponent of the span's largest magnitude."""
    x = x.bfloat16().double()
    out = torch.empty_like(x)
    for s in range(0, x.shape[1], span):
        part = x[:, s:s + span]
        e = torch.frexp(part.abs().amax(1)).exponent  # in [2^(e-1), 2^e)
        up = torch.pow(2.0, (15 - e).double())[:, None]
        out[:, s:s + span] = torch.round(part * up) / up
    return out


@integer_path
@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("rows", [1, 2, 3, 4])
# (36, 404, 202): spans of 202 features, which leave a pair of rows after
# the span loop's whole passes on every build.
@pytest.mark.parametrize("n,k,group", [(70, 576, 128), (64, 2048, 2048),
                                       (40, 8192, 8192), (33, 512, 64),
                                       (36, 404, 202)])
@pytest.mark.parametrize("zeros", [None, "offsets", "uniform"])
def test_product_of_the_integer_inputs(kind, rows, n, k, group, zeros):
    """The kernel's product equals, to float32 rounding, the product of
    the inputs as held (rebuilt here) by the codes times their scales, plus
    the bfloat16 inputs by the zero points' part; and it is
    this path that ran: the float32 tiles' product of the bfloat16 inputs
    differs."""
    w = _int8_weight(n, k, group, zeros, kind=kind)
    # Inputs over four orders of magnitude, so that some are rounded.
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, k, generator=g) * torch.pow(
        10.0, -4 * torch.rand(rows, k, generator=g))
    # The codes multiply the inputs as held; a zero point's or offset's
    # part multiplies the group's sum of the bfloat16 inputs, as on the
    # float32 tiles.
    codes = QuantWeight(kind, w.codes, w.scales, None,
                        group).dequantize().double()
    shift = w.dequantize().double() - codes
    want = (held_as_int16(x, _span(group)) @ codes.T +
            x.bfloat16().double() @ shift.T)
    got = quant_linear(x, pack(w), None, round_inputs=True, ints=4)
    assert torch.allclose(got.double(), want, rtol=2e-6,
                          atol=2e-6 * want.abs().max().item())
    floats = quant_linear(x, pack(w), None, round_inputs=True, ints=0)
    assert not torch.equal(got, floats)
    # The integers' rounding moves the product far less than rounding the
    # inputs to bfloat16 (which the precision does anyway) moves it.
    weight = w.dequantize().double().T
    exact = x.bfloat16().double() @ weight
    bf16_rounding = (exact - x.double() @ weight).abs().max()
    assert (got.double() - exact).abs().max() < bf16_rounding / 8


@integer_path
@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_inputs_within_two_to_the_seven_of_the_largest_are_exact(kind):
    """Inputs whose magnitudes lie within a factor 2^7 of their span's
    largest are held exactly: the product equals the exact product of the
    bfloat16 inputs to float32 rounding."""
    w = _int8_weight(64, 1024, 128, "uniform", kind=kind)
    g = torch.Generator().manual_seed(3)
    sign = torch.randint(0, 2, (2, 1024), generator=g) * 2 - 1
    x = sign * torch.pow(2.0, 6.9 * torch.rand(2, 1024, generator=g))
    x = x.bfloat16()
    got = quant_linear(x.float(), pack(w), None, round_inputs=True, ints=3)
    assert torch.equal(held_as_int16(x.float(), 128), x.double())
    want = x.double() @ w.dequantize().double().T
    assert torch.allclose(got.double(), want, rtol=2e-6,
                          atol=2e-6 * want.abs().max().item())


@integer_path
@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_heights_above_ints_stay_on_the_float_tiles(kind):
    w = _int8_weight(70, 576, 128, "offsets", kind=kind)
    x = torch.randn(4, 576) * 1e-3
    assert torch.equal(
        quant_linear(x, pack(w), None, round_inputs=True, ints=3),
        quant_linear(x, pack(w), None, round_inputs=True, ints=0))
    # Float32 inputs unrounded (the float32 precision) never take it.
    assert torch.equal(quant_linear(x[:1], pack(w), None, ints=3),
                       quant_linear(x[:1], pack(w), None, ints=0))


@integer_path
def test_zero_and_non_finite_spans():
    """A span of zeros adds nothing; an infinite input makes its rows'
    outputs NaN, as it makes them infinite or NaN in float32."""
    w = _int8_weight(32, 256, 128, None)
    x = torch.randn(2, 256)
    x[0, :128] = 0.0
    x[1, 200] = float("inf")
    got = quant_linear(x, pack(w), None, round_inputs=True, ints=3)
    want0 = held_as_int16(x[:1], 128) @ w.dequantize().double().T
    assert torch.allclose(got[0].double(), want0[0], rtol=2e-6,
                          atol=2e-6 * want0.abs().max().item())
    assert not torch.isfinite(got[1]).any()


@pytest.mark.parametrize("flags,rows", [
    ({"avx2", "avx512f", "avx512bw"}, sql.INT_ROWS),
    ({"avx2"}, sql.INT_ROWS_AVX2),
    ({"avx2", "avx512f"}, 0),  # AVX-512 without BW: the float32 tiles
    (set(), 0),
])
def test_integer_rows_follow_the_kind_and_the_cpu(monkeypatch, flags, rows):
    monkeypatch.setattr(native, "cpu_has", lambda flag: flag in flags)
    for kind in ("int8", "int4"):
        assert sql.integer_rows(kind, True) == rows
        assert sql.integer_rows(kind, False) == 0
    assert sql.integer_rows("fp8", True) == 0
