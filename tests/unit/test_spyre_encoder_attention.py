"""The C++ encoder attention kernel (``spyre_kernels::encoder_attention``)
against SDPA with the block-diagonal mask, on texts packed as
``packed_inputs`` packs them: float32 to rounding, bfloat16 products as
close as PyTorch's own bfloat16 SDPA, head sizes that do not fill a vector,
texts longer than a 16-row pass, the strided projections FMS hands it, and
a clear error for a malformed text layout."""
from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from vllm.attention.ops import spyre_encoder_attention as encoder_attention
from vllm.spyre_kernels import ops as native
from vllm.config.spyre import WarmupShape
from vllm.core.spyre_pooling_shapes import first_fit
from vllm.worker.spyre_pooling_inputs import packed_inputs

pytestmark = pytest.mark.skipif(not native.available(),
                                reason="no C++ compiler for the kernel")


def _packed(B, L, seed):
    """A [B, L] packing of random texts, some rows part empty."""
    rng = random.Random(seed)
    shape = WarmupShape(L, 0, B)
    lengths: list[int] = []
    for _ in range(40):
        n = rng.choice([1, 2, 5, 17, 33, L // 2, L])
        if sum(lengths) + n <= B * L * 3 // 4 and \
                first_fit(lengths + [n], shape) is not None:
            lengths.append(n)
    placements = first_fit(lengths, shape)
    return packed_inputs([[1] * n for n in lengths], [None] * len(lengths),
                         shape, placements, pad_id=0)


def _qkv(B, L, H, D, seed, dtype=torch.float32):
    """Query, keys and values as views of one fused projection, as FMS's
    attention hands them over (strided, the last dimension dense)."""
    gen = torch.Generator().manual_seed(seed)
    fused = torch.randn(B, L, 3 * H * D, generator=gen).to(dtype)
    return [t.view(B, L, H, D) for t in fused.split(H * D, dim=-1)]


def _sdpa(q, k, v, mask, scale, dtype=torch.float32):
    out = F.scaled_dot_product_attention(
        *(t.transpose(1, 2).to(dtype) for t in (q, k, v)),
        attn_mask=mask.unsqueeze(1), scale=scale)
    return out.transpose(1, 2).float()


def _kernel(q, k, v, starts, scale, bf16):
    """The FMS compute op the encoder registers for this setting."""
    from fms.modules import attention
    encoder_attention.register()
    name = (encoder_attention.ATTN_NAME_CPU_BF16 if bf16 else
            encoder_attention.ATTN_NAME_CPU)
    compute = attention.get_attention_type(attn_name=name)["compute_prefill"]
    return compute(q, k, v, q.shape[2], k.shape[2], 0.0, scale,
                   text_starts=starts)


@pytest.mark.parametrize("B, L, H, D", [
    (2, 64, 12, 32),  # all-MiniLM's heads
    (3, 40, 4, 8),  # tiny heads: no whole vector
    (1, 300, 2, 20),  # a 16-lane vector and a tail; texts past 256
    (2, 96, 3, 96),  # 64 + 32 columns
])
def test_float32_matches_sdpa_with_the_mask(B, L, H, D):
    inputs = _packed(B, L, seed=L)
    q, k, v = _qkv(B, L, H, D, seed=D)
    for scale in (None, 0.3):
        ref = _sdpa(q, k, v, inputs.mask, scale)
        got = _kernel(q, k, v, inputs.text_starts, scale, bf16=False)
        assert got.shape == (B, L, H, D) and got.is_contiguous()
        torch.testing.assert_close(got, ref, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("B, L, H, D", [(2, 64, 12, 32), (1, 300, 2, 20),
                                        (2, 96, 3, 96), (3, 40, 4, 9)])
def test_bfloat16_products_as_close_as_pytorch_bfloat16(B, L, H, D):
    """bfloat16 operands (probabilities included), float32 sums: no
    further from float32 than PyTorch's bfloat16 SDPA (float32 where the
    CPU lacks the instruction, closer still)."""
    inputs = _packed(B, L, seed=B + L)
    q, k, v = _qkv(B, L, H, D, seed=1)
    ref = _sdpa(q, k, v, inputs.mask, None)
    theirs = (_sdpa(q, k, v, inputs.mask, None, torch.bfloat16) -
              ref).abs()
    ours = (_kernel(q, k, v, inputs.text_starts, None, bf16=True) -
            ref).abs()
    assert ours.max() <= 1.25 * theirs.max() + 1e-6
    assert ours.mean() <= 1.25 * theirs.mean() + 1e-7


def test_bfloat16_tensors():
    B, L, H, D = 2, 64, 4, 32
    inputs = _packed(B, L, seed=3)
    q, k, v = _qkv(B, L, H, D, seed=3, dtype=torch.bfloat16)
    got = _kernel(q, k, v, inputs.text_starts, None, bf16=False)
    assert got.dtype == torch.bfloat16
    ref = _sdpa(q.float(), k.float(), v.float(), inputs.mask, None)
    torch.testing.assert_close(got.float(), ref, atol=1e-2, rtol=1e-2)


def test_each_text_alone():
    """A text's output does not depend on what shares its row."""
    q, k, v = _qkv(1, 50, 2, 16, seed=4)
    starts = torch.tensor([[0] * 20 + [20] * 30])
    packed = _kernel(q, k, v, starts, None, bf16=False)
    alone = _kernel(q[:, 20:], k[:, 20:], v[:, 20:],
                    torch.zeros(1, 30, dtype=torch.long), None, bf16=False)
    torch.testing.assert_close(packed[:, 20:], alone)


def test_kernel_traced_by_dynamo():
    inputs = _packed(2, 64, seed=6)
    q, k, v = _qkv(2, 64, 4, 16, seed=6)

    def attend(q, k, v, starts):
        return _kernel(q, k, v, starts, None, bf16=False)

    compiled = torch.compile(attend, backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(q, k, v, inputs.text_starts),
                               attend(q, k, v, inputs.text_starts))


@pytest.mark.parametrize("starts, message", [
    ([0, 0, 1, 3], "slot 2 of row 0 has text start 1"),
    ([1, 1, 2, 3], "slot 0 of row 0 has text start 1"),
])
def test_bad_text_layout_is_named(starts, message):
    q, k, v = _qkv(1, 4, 2, 16, seed=7)
    with pytest.raises(RuntimeError, match=message):
        torch.ops.spyre_kernels.encoder_attention(q, k, v, torch.tensor([starts]),
                                                  0.25, False)


def test_mismatched_shapes_are_named():
    q, k, v = _qkv(1, 4, 2, 16, seed=8)
    with pytest.raises(RuntimeError, match="do not match"):
        torch.ops.spyre_kernels.encoder_attention(
            q, k[:, :3], v[:, :3], torch.zeros(1, 4, dtype=torch.long), 0.25,
            False)
