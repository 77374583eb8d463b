"""The packed CPU linear kernel against ``torch.nn.functional.linear``.

Sizes are chosen to hit every path: row counts below, at and above the
12-row register tile (split into near-equal tiles), output counts that do
not fill the last 32-column block, odd input widths, bias or none, and
inputs of more than two dimensions.  Then a tiny FMS model with every
linear layer packed must give the logits of the unpacked model, eagerly
and traced (the op's fake implementation)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from vllm.model_executor.model_loader import spyre_cpu_linear

pytestmark = pytest.mark.skipif(not spyre_cpu_linear.available(),
                                reason="no C++ compiler for the kernel")


def _op(x, packed, n, bias=None):
    return torch.ops.spyre_cpu.packed_linear(x, packed, n, bias)


def test_pack_weight_layout():
    w = torch.arange(70 * 5, dtype=torch.float32).view(70, 5)
    p = spyre_cpu_linear.pack_weight(w)
    assert p.shape == (3, 5, spyre_cpu_linear.BLOCK)  # 70 -> 3 blocks of 32
    for n in (0, 31, 32, 69):
        b, c = divmod(n, spyre_cpu_linear.BLOCK)
        assert torch.equal(p[b, :, c], w[n])
    assert not p[2, :, 70 - 64:].any()  # padding columns are zero


@pytest.mark.parametrize("rows", [1, 2, 7, 12, 13, 16, 25, 64])
@pytest.mark.parametrize("out_features,in_features", [(100, 70), (64, 576),
                                                      (33, 1)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_linear(rows, out_features, in_features, with_bias):
    g = torch.Generator().manual_seed(rows * 1000 + out_features)
    w = torch.randn(out_features, in_features, generator=g)
    x = torch.randn(rows, in_features, generator=g)
    b = torch.randn(out_features, generator=g) if with_bias else None
    got = _op(x, spyre_cpu_linear.pack_weight(w), out_features, b)
    # fp32 sums of up to 576 unit-variance products, in another order
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-4, atol=1e-4)


def test_keeps_leading_dims_and_reads_strided_input():
    g = torch.Generator().manual_seed(7)
    w = torch.randn(96, 40, generator=g)
    x = torch.randn(3, 40, 5, generator=g).transpose(1, 2)  # [3, 5, 40]
    got = _op(x, spyre_cpu_linear.pack_weight(w), 96)
    assert got.shape == (3, 5, 96)
    torch.testing.assert_close(got, F.linear(x, w), rtol=1e-5, atol=1e-5)


def test_errors_name_the_mismatch():
    packed = spyre_cpu_linear.pack_weight(torch.randn(40, 8))
    with pytest.raises(RuntimeError, match="input has 9 features, the "
                       "weight 8"):
        _op(torch.randn(2, 9), packed, 40)
    with pytest.raises(RuntimeError, match="float32 only"):
        _op(torch.randn(2, 8, dtype=torch.float64), packed, 40)
    with pytest.raises(RuntimeError, match="65 outputs"):
        _op(torch.randn(2, 8), packed, 65)


@pytest.fixture(scope="module")
def tiny_pair():
    """A tiny FMS LLaMA with tied embeddings, and a packed copy."""
    import copy

    from fms.models.llama import LLaMA, LLaMAConfig
    torch.manual_seed(0)
    model = LLaMA(LLaMAConfig(src_vocab_size=100, emb_dim=64, nheads=4,
                              kvheads=2, nlayers=2, hidden_grow_factor=2.0,
                              tie_heads=True, max_expected_seq_len=64))
    model.reset_parameters()
    model.post_init()
    model.eval().requires_grad_(False)
    packed = copy.deepcopy(model)
    n = spyre_cpu_linear.pack_linears(packed)
    return model, packed, n


def test_pack_linears_replaces_every_linear(tiny_pair):
    model, packed, n = tiny_pair
    # fused qkv, attention out, fused gate/up, down per layer; LM head
    assert n == 4 * 2 + 1
    assert not [m for m in packed.modules()
                if isinstance(m, torch.nn.Linear)]
    # The tied embedding keeps its weight for the lookup; the head's packed
    # copy remembers it, the other layers are tied to nothing.
    torch.testing.assert_close(packed.base_model.embedding.weight,
                               model.base_model.embedding.weight)
    heads = {name: m.tied_to for name, m in packed.named_modules()
             if isinstance(m, spyre_cpu_linear.PackedLinear)}
    assert heads.pop("head") == "base_model.embedding.weight"
    assert set(heads.values()) == {None}


def test_repack_replaces_the_weight_in_place():
    layer = spyre_cpu_linear.PackedLinear(torch.nn.Linear(8, 40))
    buffer = layer.packed
    new = torch.randn(40, 8)
    layer.repack(new)
    assert layer.packed is buffer  # compiled graphs keep reading it
    torch.testing.assert_close(layer(torch.eye(8)), new.t() + layer.bias)
    with pytest.raises(ValueError, match=r"shape \(8, 40\) for a packed "
                       "layer of 40 x 8"):
        layer.repack(new.t())


@torch.inference_mode()
def test_packed_model_matches(tiny_pair):
    model, packed, _ = tiny_pair
    ids = torch.randint(0, 100, (3, 11), generator=torch.Generator()
                        .manual_seed(3))
    torch.testing.assert_close(packed(ids), model(ids), rtol=1e-4, atol=1e-4)
    traced = torch.compile(packed, backend="aot_eager", fullgraph=True,
                           dynamic=False)
    torch.testing.assert_close(traced(ids), model(ids), rtol=1e-4,
                               atol=1e-4)


def test_bf16_linear_rounds_the_product_operands_only():
    """``Bf16Linear``: the weight and input rounded to bfloat16, the
    product and the bias in float32; ``bf16_linears`` swaps every plain
    linear layer."""
    from vllm.model_executor.model_loader.spyre_cpu_linear import (
        Bf16Linear, bf16_linears)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(48, 32), nn.GELU(),
                          nn.Linear(32, 8, bias=False))
    x = torch.randn(5, 48)
    expected = model(x)
    layer = model[0]
    exact = torch.nn.functional.linear(
        x.to(torch.bfloat16).float(), layer.weight.to(torch.bfloat16).float(),
        layer.bias)
    assert bf16_linears(model) == 2
    assert all(isinstance(model[i], Bf16Linear) for i in (0, 2))
    assert model[0].weight.dtype == torch.bfloat16
    assert model[0].bias.dtype == torch.float32 and model[2].bias is None
    out = model[0](x)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, exact, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(model(x), expected, rtol=0.05, atol=0.05)
