"""The Mamba-2 layer over Spyre's state slots (``spyre_mamba``) against a
plain recurrence and against FMS's own layer, the slots of continuous
batching (``spyre_state_slots``), and the state geometry read off a
config."""
from __future__ import annotations

import copy

import pytest
import torch

from vllm.model_executor.layers import spyre_mamba
from vllm.model_executor.layers.spyre_mamba import (StateLayout, StateRows,
                                                    recurrent_step, ssd_scan)
from vllm.worker.spyre_state_slots import StateSlots


def _inputs(b, L, h, d, n, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(b, L, h, d, generator=gen)
    dt = torch.rand(b, L, h, generator=gen)
    A = -torch.rand(h, generator=gen) * 2
    B = torch.randn(b, L, h, n, generator=gen)
    C = torch.randn(b, L, h, n, generator=gen)
    h0 = torch.randn(b, h, d, n, generator=gen)
    return x, dt, A, B, C, h0


def _recurrence(x, dt, A, B, C, h0):
    """The recurrence one position at a time, in float64."""
    h = h0.double()
    ys = []
    for t in range(x.shape[1]):
        y, h = recurrent_step(x[:, t].double(), dt[:, t].double(),
                              A.double(), B[:, t].double(), C[:, t].double(),
                              h)
        ys.append(y)
    return torch.stack(ys, 1), h


@pytest.mark.parametrize("L, chunk", [(1, 4), (5, 4), (8, 4), (21, 8),
                                      (16, 16), (3, 16)])
def test_scan_equals_the_recurrence(L, chunk):
    x, dt, A, B, C, h0 = _inputs(2, L, 3, 5, 4)
    y, h = ssd_scan(x, dt, A, B, C, h0, chunk)
    ref_y, ref_h = _recurrence(x, dt, A, B, C, h0)
    torch.testing.assert_close(y.double(), ref_y, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(h.double(), ref_h, atol=1e-4, rtol=1e-4)


def _fms_layer(bias: bool, seed: int = 0):
    from fms.modules.ssm import SSM
    torch.manual_seed(seed)
    layer = SSM(nheads=8, emb_dim=96, state_size=16, conv_kernel=4,
                expand=2, use_bias=bias, use_conv_bias=True,
                activation_fn="silu", norm_eps=1e-5, n_groups=2,
                head_dim=24, chunk_size=8)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.3)
        layer.A_log.copy_(torch.log(torch.arange(1, 9).float()))
    return layer


class Layer:
    """FMS's layer, and a copy with Spyre's forward over a 4-slot pool."""

    def __init__(self, bias: bool = True):
        self.fms = _fms_layer(bias)
        self.spyre = copy.deepcopy(self.fms)
        holder = torch.nn.ModuleList([self.spyre])
        assert spyre_mamba.use_spyre_ssm(holder) == 1
        self.pool = StateLayout.of(holder).allocate(4)

    def reference(self, x):
        with torch.no_grad():
            return self.fms(x, None)[0]

    def step(self, x, slots, fresh, valid=None):
        valid = (torch.ones(x.shape[:2], dtype=torch.bool)
                 if valid is None else valid)
        (state, ) = self.pool.steps(torch.tensor(slots),
                                    torch.tensor(fresh), valid)
        with torch.no_grad():
            return self.spyre(x, None, state)[0]


X = torch.randn(2, 21, 96, generator=torch.Generator().manual_seed(1))


def test_whole_prompt_equals_fms():
    layer = Layer(bias=False)
    torch.testing.assert_close(layer.step(X, [0, 1], [True, True]),
                               layer.reference(X), atol=1e-4, rtol=1e-4)


def test_chunks_and_decode_steps_carry_the_state():
    """13 positions, 4 more, then one at a time: the outputs of the whole
    sequence."""
    layer = Layer()
    ref = layer.reference(X)
    outs = [layer.step(X[:, :13], [2, 3], [True, True]),
            layer.step(X[:, 13:17], [2, 3], [False, False])]
    outs += [layer.step(X[:, t:t + 1], [2, 3], [False, False])
             for t in range(17, 21)]
    torch.testing.assert_close(torch.cat(outs, 1), ref, atol=1e-4,
                               rtol=1e-4)


@pytest.mark.parametrize("pad", [2, 9])
def test_left_padding_changes_nothing_even_with_a_projection_bias(pad):
    """A left-padded first chunk, then a left-padded later chunk (padding
    shorter and longer than the convolution's history): the unpadded
    outputs.  FMS's own layer lets the bias leak through padding."""
    layer = Layer(bias=True)
    ref = layer.reference(X)
    noise = torch.randn(2, pad, 96)
    valid = torch.ones(2, pad + 10, dtype=torch.bool)
    valid[:, :pad] = False
    first = layer.step(torch.cat([noise, X[:, :10]], 1), [0, 1],
                       [True, True], valid)
    later = layer.step(torch.cat([noise, X[:, 10:20]], 1), [0, 1],
                       [False, False], valid)
    last = layer.step(X[:, 20:], [0, 1], [False, False])
    got = torch.cat([first[:, pad:], later[:, pad:], last], 1)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


def test_a_fresh_row_ignores_what_its_slot_held():
    layer = Layer()
    layer.step(X[:, :7], [0, 1], [True, True])
    again = layer.step(X, [0, 1], [True, True])
    torch.testing.assert_close(again, layer.reference(X), atol=1e-4,
                               rtol=1e-4)


def test_rows_use_their_own_slots():
    """Two sequences in slots 3 and 1 decode together after prefills in
    other orders."""
    layer = Layer()
    ref = layer.reference(X)
    layer.step(X[1:, :20], [1], [True])
    layer.step(X[:1, :20], [3], [True])
    out = layer.step(X[:, 20:], [3, 1], [False, False])
    torch.testing.assert_close(out, ref[:, 20:], atol=1e-4, rtol=1e-4)


def test_state_rows():
    rows = StateRows.prefill(slot=2, rows=2, length=4, real=5, first=True)
    assert rows.slots.tolist() == [2, 2]
    assert rows.fresh.tolist() == [True, False]
    assert rows.valid.tolist() == [[False, False, False, True],
                                   [True, True, True, True]]
    later = StateRows.prefill(slot=2, rows=1, length=4, real=4, first=False)
    assert later.fresh.tolist() == [False]
    decode = StateRows.decode([4, 0], rows=3, spare=7)
    assert decode.slots.tolist() == [4, 0, 7]
    assert decode.valid.shape == (3, 1) and not decode.fresh.any()


def test_state_slots():
    slots = StateSlots(2)
    a = slots.start("a")
    assert slots.start("a") == a  # recomputed: the slot it holds
    b = slots.start("b")
    assert {a, b} == {0, 1} and slots.spare == 2
    with pytest.raises(RuntimeError, match="All 2 Mamba-2 state slots"):
        slots.start("c")
    slots.release(["a", "unknown"])
    assert slots.start("c") == a and slots.of("b") == b
    with pytest.raises(RuntimeError, match="holds no Mamba-2 state slot"):
        slots.of("a")
    assert slots.held == 2


def test_layout_from_configs():
    from transformers import BambaConfig, GraniteMoeHybridConfig
    bamba = StateLayout.from_config(BambaConfig(
        hidden_size=96, num_hidden_layers=4, attn_layer_indices=[1],
        mamba_n_heads=8, mamba_d_head=24, mamba_expand=2, mamba_d_state=16,
        mamba_n_groups=2, mamba_d_conv=4))
    assert bamba == StateLayout(layers=3, conv_dim=192 + 2 * 2 * 16,
                                conv_history=3, heads=8, head_dim=24,
                                state_size=16)
    assert bamba.slot_bytes() == 3 * (256 * 3 + 8 * 24 * 16) * 4
    dense = GraniteMoeHybridConfig(num_hidden_layers=2,
                                   layer_types=["attention"] * 2)
    assert StateLayout.from_config(dense) is None
    hybrid = GraniteMoeHybridConfig(num_hidden_layers=3, layer_types=[
        "mamba", "attention", "mamba"])
    assert StateLayout.from_config(hybrid).layers == 2
    from transformers import LlamaConfig
    assert StateLayout.from_config(LlamaConfig()) is None


def test_layer_caches_interleave():
    kv = [("k0", "v0"), ("k1", "v1")]
    steps = ["s0", "s1"]
    assert spyre_mamba.layer_caches([True, False, True, False], kv,
                                    steps) == ["s0", kv[0], "s1", kv[1]]
