"""Quantized linear weights on the CPU: held compact, dequantized in
registers by ``spyre_kernels::quant_linear``.

A decode step reads every weight once, so its time is the bytes per
weight.  A quantized checkpoint's codes stay as they are on disk (one byte
per weight for int8 and FP8, half a byte for int4) and its scales beside
them; the kernel (``vllm/spyre_kernels/quant.cpp``) widens
each code to float32 in registers, scales it and multiplies it by the
float32 inputs.  So a layer computes exactly ``x @ dequantize(...).T``, the
format's own reference.

``QuantWeight`` is one layer's weight as a format defines it: integer or
FP8 codes ``[N, K]`` and, per group of ``group_size`` input features and
per output, a scale and (asymmetric formats) a zero point:
``weight = (code - zero) * scale``.  ``pack`` lays it out for the kernel;
``dequantize`` gives the float32 weight (the reference, and the path off
the kernels).  Checkpoints hold integer codes packed into int32 words:
``unpack_int32`` reads them out, ``pack_words`` lays them out for the
kernel straight from the words.

A prompt is bound by arithmetic instead.  Under the bfloat16 precision on
a CPU with AMX, a product of ``DENSE_ROWS`` rows or more dequantizes the
layer's weight into a bfloat16 scratch and multiplies on oneDNN's AMX
tiles (the kernel's ``dense_rows``, which the quantization method sets),
as a bfloat16 layer's prompt does.  Without AMX, tiles of ``DOT_ROWS``
rows or more multiply bfloat16 pairs (``kernel_rows``).
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Optional

import torch

#: Output columns per packed block (kBlock in vllm/spyre_kernels/quant.cpp).
BLOCK = 32

#: Code kinds, as the kernel numbers them.
KINDS = {"int8": 0, "fp8": 1, "int4": 2}
KIND_NAMES = {number: name for name, number in KINDS.items()}

#: FP8 codes widen to 2^-8 times their value (a half float's exponent
#: bias, against e4m3's): the packed scales carry the 2^8.
_FP8_CODE_SCALE = 256.0


@dataclass
class QuantWeight:
    """One linear layer's quantized weight, ``[N, K]``.

    ``codes``: int8 (``int8``: -128..127; ``int4``: 0..15) or
    ``torch.float8_e4m3fn`` (``fp8``).  ``scales``: float32 ``[N, G]``,
    ``G = ceil(K / group_size)`` (the last group may be shorter, as GPTQ
    groups 576 features by 128); ``group_size`` None: ``K / G``.
    ``zeros``: float32 ``[N, G]`` or None (symmetric)."""

    kind: str
    codes: torch.Tensor
    scales: torch.Tensor
    zeros: Optional[torch.Tensor] = None
    group_size: Optional[int] = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown code kind {self.kind!r}: "
                             f"{', '.join(KINDS)}")
        n, k = self.codes.shape
        groups = self.scales.shape[1]
        if self.group_size is None:
            self.group_size = k // groups if groups and k % groups == 0 \
                else 0
        if self.scales.shape[0] != n or self.group_size <= 0 or \
                groups != -(-k // self.group_size):
            raise ValueError(
                f"scales of shape {tuple(self.scales.shape)} for a weight "
                f"of {n} x {k} in groups of {self.group_size}: need "
                f"[{n}, ceil({k} / group size)]")
        if self.zeros is not None and self.zeros.shape != self.scales.shape:
            raise ValueError("zero points must have the scales' shape")

    @property
    def out_features(self) -> int:
        return self.codes.shape[0]

    @property
    def in_features(self) -> int:
        return self.codes.shape[1]

    def _per_feature(self, t: torch.Tensor) -> torch.Tensor:
        return t.repeat_interleave(self.group_size,
                                   dim=1)[:, :self.in_features]

    def dequantize(self) -> torch.Tensor:
        """The float32 weight ``(code - zero) * scale``."""
        codes = self.codes.to(torch.float32)
        if self.zeros is not None:
            codes = codes - self._per_feature(self.zeros)
        return codes * self._per_feature(self.scales)


@dataclass
class PackedQuant:
    """A ``QuantWeight`` laid out for ``spyre_kernels::quant_linear``."""

    packed: torch.Tensor
    scales: torch.Tensor
    offsets: Optional[torch.Tensor]
    kind: int
    group_size: int
    out_features: int
    #: One zero point for every weight, where there are no offsets.
    zero_point: float = 0.0


def _blocked(t: torch.Tensor, blocks: int) -> torch.Tensor:
    """[N, G] -> [blocks, G, BLOCK] float32, zero-padded columns."""
    n, g = t.shape
    out = t.new_zeros(blocks * BLOCK, g, dtype=torch.float32)
    out[:n] = t
    return out.view(blocks, BLOCK, g).transpose(1, 2).contiguous()


def pack(weight: QuantWeight) -> PackedQuant:
    """Codes in column blocks ``[N / 32][K][32]`` bytes (int4: two codes
    per byte, columns c and c + 16 of the block), scales and offsets
    ``[N / 32][G][32]`` float32, where ``code * scale + offset`` is the
    weight; no offsets where every zero point is 0, nor, for integer
    codes, where all are the same (symmetric int4: 8), which the kernel
    subtracts once per group (``zero_point``; FP8 codes are read scaled by
    2^-8, so their zero points stay offsets)."""
    n, k = weight.codes.shape
    blocks = -(-n // BLOCK)
    if weight.kind == "fp8":
        codes = weight.codes.view(torch.uint8)
        scales = weight.scales * _FP8_CODE_SCALE
    else:
        # int4 codes are 0..15: a view where they are held in bytes.
        codes = weight.codes.view(torch.uint8) if weight.codes.dtype in (
            torch.int8, torch.uint8) else weight.codes.to(torch.uint8)
        scales = weight.scales
    # By input feature, [K, N]: a view where the codes are held so (GPTQ
    # packs them along K), whose blocks of 32 columns are 32-byte runs:
    # the layout is one copy of runs, not a transpose of single bytes.
    by_input = codes.t()
    if n % BLOCK:
        wide = by_input.new_zeros(k, blocks * BLOCK)
        wide[:, :n] = by_input
        by_input = wide
    packed = by_input.reshape(k, blocks, BLOCK).permute(1, 0, 2)
    if weight.kind == "int4":
        packed = packed[..., :BLOCK // 2] | (packed[..., BLOCK // 2:] << 4)
    return _with_groups(packed.contiguous(), weight.kind, scales,
                        weight.scales, weight.zeros, weight.group_size, n)


def unpack_int32(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Codes packed ``32 / bits`` to an int32 along ``dim``, the first in
    the lowest bits, as unsigned 8-bit integers (uint8).  8- and 4-bit
    codes are read from the words' bytes (a byte per code, or its two
    halves), one pass over them; other widths one shift at a time.  Never
    every code widened to 32 bits (an output head's are a gigabyte).
    Along dim 0 (GPTQ's weights), where the native kernels are loaded,
    ``spyre_kernels::unpack_codes`` writes each row of codes in one
    contiguous pass instead of a transpose of single bytes."""
    from vllm.spyre_kernels import ops  # as in kernel_rows
    if dim == 0 and packed.dim() == 2 and ops.loaded():
        return torch.ops.spyre_kernels.unpack_codes(packed, bits)
    per = 32 // bits
    sizes = list(packed.shape)
    sizes.insert(dim + 1, per)
    if bits in (8, 4):
        # [..., 4]: each word's bytes, its lowest first.
        words = packed.contiguous().view(torch.uint8).view(
            *packed.shape, 4)
        if sys.byteorder == "big":
            words = words.flip(-1)
        codes = words if bits == 8 else torch.stack(
            (words & 15, words >> 4), dim=-1).view(*packed.shape, 8)
        out = codes.movedim(-1, dim + 1).contiguous()
    else:
        out = torch.empty(sizes, dtype=torch.uint8)
        for i in range(per):
            out.select(dim + 1, i).copy_(
                (packed >> (bits * i)) & ((1 << bits) - 1))
    sizes.pop(dim + 1)
    sizes[dim] *= per
    return out.view(sizes)


def pack_words(words: torch.Tensor, bits: int, dim: int,
               scales: torch.Tensor, zeros: Optional[torch.Tensor],
               group_size: int) -> PackedQuant:
    """``pack`` of a weight straight from its int32 words, ``32 / bits``
    unsigned codes each along the input features (``dim`` 0: GPTQ's
    ``qweight``, ``[K / per, N]``; 1: compressed-tensors'
    ``weight_packed``, ``[N, K / per]``), by
    ``spyre_kernels::pack_code_words``: the packed layer ``pack`` makes of
    ``QuantWeight`` of the unpacked codes (8 bits: as int8, the code's top
    bit flipped; 4 bits: 0..15) and these ``scales`` and ``zeros``
    (``[N, G]`` float32; 8 bits: zero points less 128), without a byte per
    code in between.  The kernels must be loaded."""
    per = 32 // bits
    n, k = words.shape[1 - dim], words.shape[dim] * per
    kind = "int8" if bits == 8 else "int4"
    # Checked as a QuantWeight's are, on codes of the right shape that
    # hold no bytes.
    checked = QuantWeight(kind,
                          torch.zeros((), dtype=torch.int8).expand(n, k),
                          scales, zeros, group_size)
    packed = torch.ops.spyre_kernels.pack_code_words(words, bits, dim, n)
    return _with_groups(packed, kind, scales, scales, zeros,
                        checked.group_size, n)


def _with_groups(packed: torch.Tensor, kind: str,
                 packed_scales: torch.Tensor, scales: torch.Tensor,
                 zeros: Optional[torch.Tensor], group_size: int,
                 n: int) -> PackedQuant:
    """A ``PackedQuant`` of packed codes and their groups' scales and
    offsets: none where every zero point is 0, nor, for integer codes,
    where all are the same, which becomes the layer's ``zero_point``."""
    blocks = packed.shape[0]
    offsets, zero = None, 0.0
    if zeros is not None and zeros.numel():
        if kind != "fp8" and bool((zeros == zeros.flatten()[0]).all()):
            zero = float(zeros.flatten()[0])
        else:
            offsets = _blocked(-zeros * scales, blocks)
    return PackedQuant(packed, _blocked(packed_scales, blocks), offsets,
                       KINDS[kind], group_size, n, zero)


#: Rows (positions of the step's sequences together) from which rounded
#: inputs multiply on oneDNN where the CPU has AMX, per code kind: where
#: ``benchmarks/linear.py`` found the dense path faster than the float32
#: tiles (prompts, and decode batches that large).
DENSE_ROWS = {"int8": 80, "fp8": 48, "int4": 64}

#: Rows from which rounded inputs multiply as bfloat16 pairs
#: (``vdpbf16ps``) where the CPU has AVX512_BF16 but not AMX (AMD's Zen
#: 4, where they beat the float32 tiles from 4 rows); on AMX machines the
#: float32 tiles are faster at every height below ``DENSE_ROWS``.
DOT_ROWS = 4


def kernel_rows(kind: str, round_inputs: bool) -> tuple[int, int]:
    """``(dense, dot)`` for a layer of ``kind`` codes: the row counts from
    which ``quant_linear`` multiplies on oneDNN, and as bfloat16 pairs (0:
    never); both only with rounded inputs (the bfloat16 precision)."""
    # Imported here: the module stays importable on its own (packing and
    # the op's wrapper), as tests/quant_kernel_portable.py loads it.
    from vllm.spyre_kernels.ops import has_amx_bf16
    if not round_inputs:
        return 0, 0
    if has_amx_bf16():
        return DENSE_ROWS[kind], 0
    return 0, DOT_ROWS


#: Rows up to which int8 and int4 codes multiply the inputs held as 16-bit
#: integers (``vpdpwssd``, or ``vpmaddwd`` and an add; quant_int16.h)
#: where the CPU has AVX512BW: a decode step's few rows, where the float32
#: tiles are bound by widening codes (from ``DOT_ROWS`` rows the bfloat16
#: pairs take them on AMD's Zen 4).
INT_ROWS = 3
#: The same where the CPU has AVX2 and no AVX-512: the integer tiles'
#: largest height, where ``benchmarks/linear.py --march x86-64-v3`` found
#: them faster than the float32 tiles at every height (no bfloat16 pairs
#: there).
INT_ROWS_AVX2 = 4


def integer_rows(kind: str, round_inputs: bool) -> int:
    """``quant_linear``'s ``ints`` for a layer of ``kind`` codes: int8 and
    int4 codes with rounded inputs (the bfloat16 precision), where the
    kernels are built with AVX512BW or with AVX2 alone; else 0."""
    from vllm.spyre_kernels.ops import cpu_has
    if kind not in ("int8", "int4") or not round_inputs:
        return 0
    if cpu_has("avx512bw"):
        return INT_ROWS
    if cpu_has("avx2") and not cpu_has("avx512f"):
        return INT_ROWS_AVX2
    return 0


def quant_linear(x: torch.Tensor, weight: PackedQuant,
                 bias: Optional[torch.Tensor],
                 round_inputs: bool = False, dense: int = 0,
                 dot: int = 0, ints: int = 0) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` on the kernel, in ``x``'s dtype;
    ``round_inputs``: ``x`` rounded to bfloat16 first (the bfloat16
    precision); ``dense``: from this many rows on, they multiply on
    oneDNN over the weight dequantized to bfloat16 instead; ``dot``: from
    this many rows on, the tiles multiply bfloat16 pairs (``vdpbf16ps``)
    where the kernel is built with AVX512_BF16 (0: never; both with
    rounded inputs only; ``kernel_rows`` chooses them for this CPU);
    ``ints``: up to this many rows, int8 and int4 codes multiply bfloat16
    inputs held as 16-bit integers (``integer_rows``)."""
    return torch.ops.spyre_kernels.quant_linear(
        x, weight.packed, weight.scales, weight.offsets, weight.kind,
        weight.group_size, weight.out_features, weight.zero_point, bias,
        round_inputs, dense, dot, ints)


def fake_quantize_fp8(x: torch.Tensor,
                      scale: Optional[torch.Tensor]) -> torch.Tensor:
    """The input as an FP8 activation sees it: divided by its scale,
    rounded to ``float8_e4m3fn`` (nearest, saturated at +-448) and scaled
    back, in ``x``'s dtype.  ``scale`` None: dynamic, per token, the row's
    largest magnitude over 448."""
    finfo = torch.finfo(torch.float8_e4m3fn)
    if scale is None:
        scale = x.abs().amax(dim=-1, keepdim=True).float() / finfo.max
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = (x.float() / scale).clamp(finfo.min, finfo.max)
    return (q.to(torch.float8_e4m3fn).float() * scale).to(x.dtype)
