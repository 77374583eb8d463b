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

from vllm.spyre_kernels import ops as native
from vllm.model_executor.layers import spyre_linear

pytestmark = pytest.mark.skipif(not native.available(),
                                reason="no C++ compiler for the kernel")


def _op(x, packed, n, bias=None):
    return torch.ops.spyre_kernels.packed_linear(x, packed, n, bias)


def test_pack_weight_layout():
    w = torch.arange(70 * 5, dtype=torch.float32).view(70, 5)
    p = spyre_linear.pack_weight(w)
    assert p.shape == (3, 5, spyre_linear.BLOCK)  # 70 -> 3 blocks of 32
    for n in (0, 31, 32, 69):
        b, c = divmod(n, spyre_linear.BLOCK)
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
    got = _op(x, spyre_linear.pack_weight(w), out_features, b)
    # fp32 sums of up to 576 unit-variance products, in another order
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-4, atol=1e-4)


def test_pack_weight_layout_bf16():
    """Pairs of input features side by side, one 64-element row per pair."""
    w = torch.randn(70, 6).bfloat16()
    p = spyre_linear.pack_weight(w)
    assert p.dtype == torch.bfloat16
    assert p.shape == (3, 3, 2 * spyre_linear.BLOCK)
    for n in (0, 31, 32, 69):
        b, c = divmod(n, spyre_linear.BLOCK)
        for k in range(6):
            assert p[b, k // 2, 2 * c + k % 2] == w[n, k]
    assert not p[2, :, 2 * (70 - 64):].any()


@pytest.mark.parametrize("dtype,out_features,in_features",
                         [(torch.float32, 96, 70), (torch.bfloat16, 64, 576),
                          (torch.bfloat16, 2048, 130)])
def test_pack_weight_in_place_writes_over_the_weight(dtype, out_features,
                                                     in_features):
    w = torch.randn(out_features, in_features).to(dtype)
    expected = spyre_linear.pack_weight(w)
    address = w.data_ptr()
    packed = spyre_linear.pack_weight(w, in_place=True)
    assert packed.data_ptr() == address  # no second copy of the weight
    assert packed.shape == expected.shape and packed.dtype == dtype
    assert torch.equal(packed, expected)


def test_pack_weight_in_place_copies_what_it_does_not_own():
    """Padded layouts, views into a larger tensor and memory-mapped bytes
    are packed into a copy and left as they were."""
    padded = torch.randn(70, 6).bfloat16()
    whole = torch.randn(128, 64)
    for w in (padded, whole[:64], torch.from_numpy(whole.numpy()[64:])):
        before = w.clone()
        packed = spyre_linear.pack_weight(w, in_place=True)
        assert packed.data_ptr() != w.data_ptr()
        assert torch.equal(w, before)
        assert torch.equal(packed, spyre_linear.pack_weight(before))


def _bf16(t: torch.Tensor) -> torch.Tensor:
    """Rounded to bfloat16, held as float32."""
    return t.bfloat16().float()


@pytest.mark.parametrize("rows", [1, 3, 12, 13, 15, 16, 17, 40, 64, 300])
@pytest.mark.parametrize("out_features,in_features", [(100, 70), (64, 576),
                                                      (33, 2), (70, 64)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_bf16_weights_match_rounded_product(rows, out_features, in_features,
                                            with_bias):
    """float32 inputs, bfloat16 weights: the product of the inputs and the
    weights rounded to bfloat16, summed in float32.  On a CPU with AMX,
    16 rows or more with input features in multiples of 32 run on AMX
    tiles (a 16-row half tile at the end of 17, 40 and 300 rows, two
    spans of rows at 300); the rest on the vector tiles."""
    g = torch.Generator().manual_seed(rows * 1000 + out_features + 1)
    w = torch.randn(out_features, in_features, generator=g)
    x = torch.randn(rows, in_features, generator=g)
    b = torch.randn(out_features, generator=g) if with_bias else None
    packed = spyre_linear.pack_weight(w.bfloat16())
    got = _op(x, packed, out_features, b)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, F.linear(_bf16(x), _bf16(w), b),
                               rtol=1e-4, atol=1e-4)
    # bfloat16 inputs give bfloat16 outputs, rounded once.
    got16 = _op(x.bfloat16(), packed, out_features, b)
    assert got16.dtype == torch.bfloat16
    torch.testing.assert_close(got16, got.bfloat16(), rtol=1e-2, atol=1e-2)


def test_bf16_packed_linear_halves_the_bytes():
    linear = nn.Linear(64, 96)
    p32 = spyre_linear.PackedLinear(linear)
    p16 = spyre_linear.PackedLinear(linear, dtype=torch.bfloat16)
    assert p16.packed.nbytes * 2 == p32.packed.nbytes
    x = torch.randn(5, 64)
    torch.testing.assert_close(
        p16(x), F.linear(_bf16(x), _bf16(linear.weight), linear.bias),
        rtol=1e-4, atol=1e-4)
    # A weight update repacks in bfloat16.
    new = torch.randn(96, 64)
    p16.repack(new)
    torch.testing.assert_close(p16(x), F.linear(_bf16(x), _bf16(new),
                                                linear.bias),
                               rtol=1e-4, atol=1e-4)


def test_bf16_prompt_reads_the_one_packed_weight():
    """A bfloat16 layer holds its weight once, packed: a prompt's many
    rows (AMX tiles where the CPU has them) and a decode step's few read
    the same buffer, and a weight update reaches both."""
    linear = nn.Linear(64, 96)
    layer = spyre_linear.PackedLinear(linear, dtype=torch.bfloat16)
    assert [n for n, _ in layer.named_buffers()] == ["packed", "bias"]
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randn(2, 20, 64, generator=gen)
    step = torch.randn(3, 1, 64, generator=gen)

    def kernel_product(x, w):
        return F.linear(_bf16(x), _bf16(w), linear.bias)

    for weight in (linear.weight.detach(), torch.randn(96, 64,
                                                       generator=gen)):
        layer.repack(weight)
        for x in (prompt, step):
            torch.testing.assert_close(layer(x), kernel_product(x, weight),
                                       rtol=1e-4, atol=1e-4)


def test_vllm_layers_on_the_packed_kernel():
    """vLLM's linear layers (``use_spyre_linears``): the linear layer and
    the output head hold only their packed bfloat16 weight, and any
    number of rows (``[B * L, K]`` flattened, as vLLM's models pass them)
    multiplies on the kernel."""
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.spyre_linear_method import (
        PackedHeadMethod, PackedLinearMethod, use_spyre_linears)
    from vllm.model_executor.layers.vocab_parallel_embedding import \
        UnquantizedEmbeddingMethod

    class Layer(nn.Module):
        def __init__(self, method, n=96, k=64):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(n, k), requires_grad=False)
            self.quant_method = method

    model = nn.Module()
    model.proj = Layer(UnquantizedLinearMethod())
    model.lm_head = Layer(UnquantizedEmbeddingMethod())
    weights = {n: m.weight.detach().clone()
               for n, m in (("proj", model.proj), ("lm_head", model.lm_head))}
    assert use_spyre_linears(model, torch.bfloat16, True) == 2
    assert type(model.proj.quant_method) is PackedLinearMethod
    assert type(model.lm_head.quant_method) is PackedHeadMethod
    for name in weights:
        layer = getattr(model, name)
        assert layer.weight.numel() == 0
        assert not hasattr(layer, "spyre_bf16")
    bias = torch.randn(96)
    for rows in (3, 14, 40):
        x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(3))
        for name, b in (("proj", bias), ("lm_head", None)):
            layer = getattr(model, name)
            torch.testing.assert_close(
                layer.quant_method.apply(layer, x, b),
                F.linear(_bf16(x), _bf16(weights[name]), b),
                rtol=1e-4, atol=1e-4)


def test_bf16_packs_only_even_input_widths():
    model = nn.Sequential(nn.Linear(6, 8), nn.Linear(8, 3), nn.Linear(3, 4))
    assert spyre_linear.pack_linears(model, torch.bfloat16) == 2
    assert type(model[2]) is nn.Linear


def test_keeps_leading_dims_and_reads_strided_input():
    g = torch.Generator().manual_seed(7)
    w = torch.randn(96, 40, generator=g)
    x = torch.randn(3, 40, 5, generator=g).transpose(1, 2)  # [3, 5, 40]
    got = _op(x, spyre_linear.pack_weight(w), 96)
    assert got.shape == (3, 5, 96)
    torch.testing.assert_close(got, F.linear(x, w), rtol=1e-5, atol=1e-5)


def test_errors_name_the_mismatch():
    packed = spyre_linear.pack_weight(torch.randn(40, 8))
    with pytest.raises(RuntimeError, match="input has 9 features, the "
                       "weight 8"):
        _op(torch.randn(2, 9), packed, 40)
    with pytest.raises(RuntimeError, match="a float32 weight takes float32 "
                       "inputs.*Double"):
        _op(torch.randn(2, 8, dtype=torch.float64), packed, 40)
    with pytest.raises(RuntimeError, match="input BFloat16"):
        _op(torch.randn(2, 8, dtype=torch.bfloat16), packed, 40)
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
    n = spyre_linear.pack_linears(packed)
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
             if isinstance(m, spyre_linear.PackedLinear)}
    assert heads.pop("head") == "base_model.embedding.weight"
    assert set(heads.values()) == {None}


def test_pack_linears_packs_untied_weights_in_their_storage():
    """Each untied layer's packed weight takes its old weight's storage;
    the head tied to the embedding gets its own copy and the embedding keeps
    its values."""
    from fms.models.llama import LLaMA, LLaMAConfig
    torch.manual_seed(0)
    model = LLaMA(LLaMAConfig(src_vocab_size=128, emb_dim=64, nheads=4,
                              kvheads=2, nlayers=1, hidden_grow_factor=2.0,
                              tie_heads=True, max_expected_seq_len=64))
    model.reset_parameters()
    model.post_init()  # ties the head to the embedding
    model.eval().requires_grad_(False)
    addresses = {name: m.weight.data_ptr()
                 for name, m in model.named_modules()
                 if isinstance(m, torch.nn.Linear)}
    embedding = model.base_model.embedding.weight.clone()
    spyre_linear.pack_linears(model)
    layers = {name: m for name, m in model.named_modules()
              if isinstance(m, spyre_linear.PackedLinear)}
    assert layers.keys() == addresses.keys()
    for name, layer in layers.items():
        shared = layer.packed.data_ptr() == addresses[name]
        assert shared == (name != "head"), name
    assert torch.equal(model.base_model.embedding.weight, embedding)
    assert torch.equal(layers["head"].packed,
                       spyre_linear.pack_weight(embedding))


def test_repack_replaces_the_weight_in_place():
    layer = spyre_linear.PackedLinear(torch.nn.Linear(8, 40))
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
    from vllm.model_executor.layers.spyre_linear import (Bf16Linear,
                                                         bf16_linears)
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
