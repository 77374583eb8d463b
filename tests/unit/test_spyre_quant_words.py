"""Quantized codes in a checkpoint's int32 words (GPTQ's ``qweight`` along
dim 0, compressed-tensors' ``weight_packed`` along dim 1): read back by
``unpack_int32`` in either byte order, and laid out for the kernel straight
from the words by ``pack_words`` as ``pack`` lays out the unpacked codes."""
from __future__ import annotations

import pytest
import torch

from vllm.model_executor.layers.quantization.spyre_quant_linear import (
    QuantWeight, pack, pack_words, unpack_int32)
from vllm.spyre_kernels import ops as native

kernel = pytest.mark.skipif(not native.available(),
                            reason="no C++ compiler for the kernel")


def test_unpack_int32_orders():
    codes = torch.arange(16, dtype=torch.int32).view(2, 8) % 16
    packed = torch.zeros(2, 1, dtype=torch.int32)
    for j in range(8):
        packed[:, 0] |= codes[:, j] << (4 * j)
    codes = codes.to(torch.uint8)
    assert torch.equal(unpack_int32(packed, 4, 1), codes)
    assert torch.equal(unpack_int32(packed.t(), 4, 0),
                       codes.t())
    # 8-bit codes, negative int32 words included (a top code of 128+).
    codes8 = torch.tensor([[0, 127, 128, 255], [1, 2, 254, 200]])
    packed8 = torch.zeros(2, 1, dtype=torch.int32)
    for j in range(4):
        packed8[:, 0] |= (codes8[:, j] << (8 * j)).to(torch.int32)
    assert torch.equal(unpack_int32(packed8, 8, 1),
                       codes8.to(torch.uint8))


@pytest.mark.parametrize("native", [False, True], ids=["torch", "kernel"])
@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("dim", [0, 1])
def test_unpack_int32_reads_every_word_like_shifts(bits, dim, native,
                                                   monkeypatch):
    """Random words, every bit pattern's sign included: the codes read
    from the words' bytes (8 and 4 bits), by shifts (2) or, along dim 0
    with the kernels loaded, by ``spyre_kernels::unpack_codes`` are each
    word's fields, lowest first, along ``dim``."""
    from vllm.spyre_kernels import ops
    if native and not ops.available():
        pytest.skip("no C++ compiler for the kernels")
    monkeypatch.setattr(ops, "loaded", lambda: native)
    torch.manual_seed(bits)
    packed = torch.randint(-2**31, 2**31 - 1, (6, 10), dtype=torch.int32)
    per, mask = 32 // bits, (1 << bits) - 1
    wide = packed.to(torch.int64) & 0xFFFFFFFF
    fields = torch.stack([(wide >> (bits * i)) & mask for i in range(per)],
                         dim=dim + 1)
    expected = fields.flatten(dim, dim + 1).to(torch.uint8)
    assert torch.equal(unpack_int32(packed, bits, dim),
                       expected)


@kernel
@pytest.mark.parametrize("dim", [0, 1], ids=["gptq", "compressed"])
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("n", [96, 1000])
@pytest.mark.parametrize("zeros", ["uniform", "random", None])
def test_code_words_pack_as_their_unpacked_codes(dim, bits, n, zeros):
    """Int32 words of codes laid out by ``spyre_kernels::pack_code_words``
    (``pack_words``), along the input features as GPTQ holds them (dim 0)
    or compressed-tensors (dim 1): the same packed codes, scales, offsets
    and zero point as ``pack`` of the codes unpacked first (8 bits: their
    top bit flipped into int8), a partial last block of columns (1000)
    and every word's bit pattern included."""
    torch.manual_seed(n + bits + dim)
    k, group = 384, 128
    shape = (k * bits // 32, n) if dim == 0 else (n, k * bits // 32)
    words = torch.randint(-2**31, 2**31 - 1, shape, dtype=torch.int32)
    scales = torch.rand(n, k // group) + 0.05
    z = {"uniform": torch.full_like(scales, 8.0), None: None,
         "random": torch.randint(0, 16, scales.shape).float()}[zeros]
    codes = unpack_int32(words, bits, dim)
    if dim == 0:
        codes = codes.t()
    if bits == 8:
        codes = codes ^ 128
    kind = "int8" if bits == 8 else "int4"
    want = pack(QuantWeight(kind, codes.view(torch.int8), scales, z, group))
    got = pack_words(words, bits, dim, scales, z, group)
    assert got.packed.shape == want.packed.shape
    assert torch.equal(got.packed, want.packed)
    assert torch.equal(got.scales, want.scales)
    assert (got.offsets is None) == (want.offsets is None) == (
        zeros != "random")
    if want.offsets is not None:
        assert torch.equal(got.offsets, want.offsets)
    assert (got.kind, got.group_size, got.out_features, got.zero_point) == (
        want.kind, want.group_size, want.out_features, want.zero_point)
    with pytest.raises(ValueError, match="scales of shape"):
        pack_words(words, bits, dim, scales[:, :1], None, group)
