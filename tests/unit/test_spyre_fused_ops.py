"""The norm and rotary kernels of ``eager``
(vllm/spyre_kernels/elementwise.cpp) against FMS's own
modules, and ``spyre_fused_ops.use_fused_ops`` on a tiny FMS LLaMA.

The rotary embedding must equal FMS's bit for bit (same products, same
sums, no multiply-add), on the strided query and key views that FMS's
fused projection hands it, at every batch and length; the norm sums its
squares in another order, so it is held to a float32 rounding."""
from __future__ import annotations

import copy

import pytest
import torch
from fms.modules.layernorm import LayerNormParameterized
from fms.modules.positions import RotaryEmbedding

from vllm.spyre_kernels import ops as native
from vllm.model_executor.layers import spyre_fused_ops
from vllm.model_executor.layers.spyre_fused_ops import (
    KernelRMSNorm, KernelRotaryEmbedding, use_fused_ops)

pytestmark = pytest.mark.skipif(not native.available(),
                                reason="no C++ compiler for the kernels")

HEAD = 64


def _rotary(**kwargs) -> RotaryEmbedding:
    rotary = RotaryEmbedding(HEAD, 100_000.0, 256, **kwargs)
    rotary.compute_freqs_cis(torch.device("cpu"), 256)
    return rotary


def _qk(batch: int, length: int, heads: int = 9, kvheads: int = 3,
        seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Query and key as FMS makes them: views into one fused projection."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(batch, length, (heads + 2 * kvheads) * HEAD,
                      generator=g)
    q = qkv[..., :heads * HEAD].view(batch, length, heads, HEAD)
    k = qkv[..., heads * HEAD:(heads + kvheads) * HEAD].view(
        batch, length, kvheads, HEAD)
    return q, k


@pytest.mark.parametrize("batch,length", [(1, 1), (8, 1), (1, 64), (3, 5),
                                          (4, 100)])
def test_rotary_equals_fms_bit_for_bit(batch, length):
    reference = _rotary()
    kernel = _rotary()
    kernel.__class__ = KernelRotaryEmbedding
    q, k = _qk(batch, length)
    g = torch.Generator().manual_seed(1)
    positions = torch.randint(0, 256 - length, (batch, 1), generator=g) + \
        torch.arange(length)
    want_q, want_k = reference.adjusted_qk(q, k, positions)
    got_q, got_k = kernel.adjusted_qk(q, k, positions)
    assert got_q.shape == want_q.shape and got_k.shape == want_k.shape
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)


def test_rotary_names_a_position_outside_its_table():
    q, k = _qk(1, 1)
    table = _rotary().cached_freqs[None][1]
    with pytest.raises(RuntimeError, match="position 300 outside the table "
                       "of 256"):
        torch.ops.spyre_kernels.rotary_qk(q, k, table, torch.tensor([[300]]))


def test_rotary_falls_back_to_fms_off_float32():
    """bfloat16 heads take FMS's own code, with its result."""
    reference = _rotary()
    kernel = _rotary()
    kernel.__class__ = KernelRotaryEmbedding
    q, k = (t.to(torch.bfloat16) for t in _qk(2, 3))
    positions = torch.arange(3).repeat(2, 1)
    for got, want in zip(kernel.adjusted_qk(q, k, positions),
                         reference.adjusted_qk(q, k, positions)):
        assert got.dtype == torch.bfloat16 and torch.equal(got, want)


@pytest.mark.parametrize("rows", [1, 8, 512])
@pytest.mark.parametrize("width", [576, 50])
def test_rms_norm_matches_fms(rows, width):
    torch.manual_seed(0)
    reference = LayerNormParameterized(width, eps=1e-5,
                                       use_high_precision_pow=True)
    reference.weight.data.normal_()
    kernel = copy.deepcopy(reference)
    kernel.__class__ = KernelRMSNorm
    x = torch.randn(rows, 1, width) * 3
    got = kernel(x)
    assert got.shape == x.shape
    torch.testing.assert_close(got, reference(x), rtol=2e-6, atol=2e-6)


def test_rms_norm_falls_back_to_fms_off_float32():
    reference = LayerNormParameterized(64, eps=1e-5)
    reference.weight.data.normal_()
    kernel = copy.deepcopy(reference)
    kernel.__class__ = KernelRMSNorm
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    assert torch.equal(kernel(x), reference(x))


@pytest.fixture(scope="module")
def tiny_pair():
    """A tiny FMS LLaMA, and a copy on the kernels."""
    from fms.models.llama import LLaMA, LLaMAConfig
    torch.manual_seed(0)
    model = LLaMA(LLaMAConfig(src_vocab_size=100, emb_dim=64, nheads=4,
                              kvheads=2, nlayers=2, hidden_grow_factor=2.0,
                              max_expected_seq_len=64))
    model.reset_parameters()
    model.post_init()
    model.eval().requires_grad_(False)
    fused = copy.deepcopy(model)
    return model, fused, use_fused_ops(fused)


def test_every_norm_and_the_rotary_embedding_move(tiny_pair):
    """Two layers of two norms and the final norm; one rotary embedding,
    shared by both layers' attention; names and parameters unchanged."""
    model, fused, counts = tiny_pair
    assert counts == (5, 1)
    assert sum(isinstance(m, KernelRMSNorm) for m in fused.modules()) == 5
    encoders = {id(m.position_encoder) for m in fused.modules()
                if hasattr(m, "position_encoder")}
    assert len(encoders) == 1
    assert type(fused.base_model.rot_emb) is KernelRotaryEmbedding
    assert list(fused.state_dict()) == list(model.state_dict())


def test_fused_model_matches(tiny_pair):
    """Logits of the model on the kernels, eagerly and traced by dynamo
    (the ops' fake implementations), against FMS's."""
    model, fused, _ = tiny_pair
    ids = torch.randint(0, 100, (3, 11),
                        generator=torch.Generator().manual_seed(3))
    want = model(ids)
    torch.testing.assert_close(fused(ids), want, rtol=1e-5, atol=1e-5)
    traced = torch.compile(fused, backend="eager", fullgraph=True,
                           dynamic=False)
    torch.testing.assert_close(traced(ids), want, rtol=1e-5, atol=1e-5)


def test_other_configurations_stay_with_fms():
    """A LayerNorm with a mean or a shift, a partial or YaRN rotary
    embedding: left to FMS."""
    holder = torch.nn.Module()
    holder.mean = LayerNormParameterized(8, use_mean=True)
    holder.shift = LayerNormParameterized(8, elementwise_shift=True)
    holder.attn = torch.nn.Module()
    holder.attn.position_encoder = _rotary(partial_rope=0.5)
    holder.other = torch.nn.Module()
    holder.other.position_encoder = RotaryEmbedding(
        HEAD, 10_000.0, 256, scaling={"rope_type": "yarn", "factor": 2.0,
                                      "original_max_position_embeddings":
                                      128})
    assert spyre_fused_ops.use_fused_ops(holder) == (0, 0)
    assert type(holder.mean) is LayerNormParameterized
    assert type(holder.attn.position_encoder) is RotaryEmbedding
