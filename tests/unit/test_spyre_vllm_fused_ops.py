"""vLLM's RMS norm, rotary embedding and ``SiluAndMul`` on the kernels of
vllm/spyre_kernels/vllm_elementwise.cpp against vLLM's own native
forwards, and ``spyre_vllm_fused_ops.use_kernel_ops`` on vLLM's layers.

Each kernel takes the native forward's steps in its order and dtypes.
The rotary embedding equals it bit for bit (NeoX and neighbour pairs, a
partial rotary dim, strided query and key views as a fused projection
gives them); the norm sums its squares in another order and the
activation's exponential may differ in float32's last bit, so their float32
outputs are held to a float32 rounding and bfloat16 ones to one bfloat16
rounding (and most are equal); the new residual, a plain sum, is equal bit
for bit."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from vllm.spyre_kernels import ops as native
from vllm.model_executor.layers.activation import SiluAndMul
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.model_executor.layers.spyre_vllm_fused_ops import use_kernel_ops

pytestmark = pytest.mark.skipif(not native.available(),
                                reason="no C++ compiler for the kernels")


def _norm(hidden: int, dtype: torch.dtype, seed: int = 0) -> RMSNorm:
    norm = RMSNorm(hidden, eps=1e-5, dtype=dtype)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(hidden, generator=g) + 0.5)
    return norm


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    if want.dtype == torch.float32:
        assert torch.allclose(got, want, rtol=1e-6, atol=1e-6)
        return
    assert torch.allclose(got.float(), want.float(), rtol=2**-7, atol=0)
    assert (got == want).float().mean() > 0.98


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 2048), (3, 5, 576), (7, 100)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_kernel_equals_the_native_forward(dtype, shape, with_residual):
    norm = _norm(shape[-1], dtype)
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(*shape, generator=g) * 3).to(dtype)
    residual = (torch.randn(*shape, generator=g).to(dtype)
                if with_residual else None)
    want = norm.forward_native(x, residual)
    got, total = torch.ops.spyre_kernels.add_rms_norm(
        x, residual, norm.weight, norm.variance_epsilon)
    if with_residual:
        _close(got, want[0])
        assert torch.equal(total, want[1])
    else:
        _close(got, want)
        assert total.numel() == 0


class _Layer(nn.Module):
    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.input_layernorm = _norm(64, dtype, seed=2)
        self.post_attention_layernorm = _norm(64, dtype, seed=3)
        self.gemma_like = RMSNorm(64, eps=1e-6, has_weight=False,
                                  dtype=dtype)
        self.act = SiluAndMul()

    def forward(self, x, residual):
        h, residual = self.input_layernorm(x, residual)
        h, residual = self.post_attention_layernorm(h * 2, residual)
        return self.act(self.gemma_like(h)), residual


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_use_kernel_ops_moves_the_layers_it_takes(monkeypatch, dtype):
    """The two norms with a weight and the activation move to the kernels
    (a norm without a weight keeps its native forward); the layer's
    outputs equal the native forward's, and each moved layer calls its
    kernel once per call."""
    layer = _Layer(dtype)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(2, 64, generator=g).to(dtype)
    residual = torch.randn(2, 64, generator=g).to(dtype)
    want = layer(x, residual)
    assert use_kernel_ops(layer) == (2, 0, 1)
    calls = []
    ops = torch.ops.spyre_kernels

    class Counting:
        add_rms_norm = staticmethod(
            lambda *a: calls.append("norm") or ops.add_rms_norm(*a))
        silu_and_mul = staticmethod(
            lambda *a: calls.append("act") or ops.silu_and_mul(*a))

    monkeypatch.setattr(torch.ops, "spyre_kernels", Counting)
    got = layer(x, residual)
    assert calls == ["norm", "norm", "act"]
    _close(got[0], want[0])
    _close(got[1], want[1])


def test_other_dtypes_keep_the_native_forward():
    """An input of another dtype than the weight's runs vLLM's own
    forward (the kernel takes one dtype)."""
    norm = _norm(32, torch.float32)
    use_kernel_ops(norm)
    x = torch.randn(2, 32).bfloat16()
    assert torch.equal(norm(x), norm.forward_native(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 2048), (4, 7, 96)])
def test_silu_and_mul_equals_the_native_forward(dtype, shape):
    act = SiluAndMul()
    x = (torch.randn(*shape, generator=torch.Generator().manual_seed(5))
         * 4).to(dtype)
    _close(torch.ops.spyre_kernels.silu_and_mul(x), act.forward_native(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("rotary_dim", [64, 32])
@pytest.mark.parametrize("tokens", [1, 5])
def test_rotary_equals_the_native_forward_bit_for_bit(dtype, neox,
                                                      rotary_dim, tokens):
    """Query and key as vLLM's attention hands them: views into one
    fused q/k/v projection, 4 query and 2 key heads of 64; positions out
    of order; the native forward's own table, in the model's dtype."""
    rope = get_rope(64, rotary_dim, 4096, 10000.0, neox, None, dtype)
    g = torch.Generator().manual_seed(tokens)
    qkv = torch.randn(tokens, (4 + 2 * 2) * 64, generator=g).to(dtype)
    q, k, _ = qkv.split([4 * 64, 2 * 64, 2 * 64], dim=-1)
    positions = torch.randint(0, 4096, (tokens, ), generator=g)
    want_q, want_k = rope.forward_native(positions, q, k)
    use_kernel_ops(rope)
    got_q, got_k = rope(positions, q, k)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    # No key (cross-layer key/value sharing): the query alone.
    only_q, none = rope(positions, q, None)
    assert torch.equal(only_q, want_q) and none is None


def test_rotary_calls_the_kernel_does_not_take_keep_the_native_forward():
    """int32 positions, offsets, and heads not in rows of tokens run
    vLLM's own forward."""
    rope = get_rope(64, 64, 4096, 10000.0, True, None, torch.float32)
    use_kernel_ops(rope)
    q, k = torch.randn(3, 128), torch.randn(3, 64)
    positions = torch.tensor([5, 9, 2])
    for args in [(positions.int(), q, k), (positions, q, k, positions),
                 (positions, q.view(3, 2, 64), k.view(3, 1, 64))]:
        got = rope(*args)
        want = rope.forward_native(*args)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
