"""Quantized linear layers: the kernel, the packing, the config reader.

* ``spyre_kernels::quant_linear`` against ``x @ dequantize(weight).T`` in
  float64 for every code kind (int8, FP8, int4), one group or several,
  with zero points or without, row counts below, at and above the 12-row
  tile, a partial last column block, a bias, bfloat16 inputs, and under
  ``torch.compile`` (the op's fake implementation);
* every FP8 code (subnormals included) read exactly, also by the portable
  code of CPUs without AVX-512 (built for AVX2 in a subprocess);
* the quantization configs Spyre runs, and a clear refusal, naming the
  value and what is supported, for the ones it does not.
"""
from __future__ import annotations

import importlib.util
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vllm.spyre_kernels import ops as native
from vllm.model_executor.layers.quantization import spyre_quant
from vllm.model_executor.layers.quantization import (
    spyre_quant_linear as sql)
from vllm.model_executor.layers.quantization.spyre_quant_linear import (
    QuantWeight, fake_quantize_fp8, pack, quant_linear)

kernel = pytest.mark.skipif(not native.available(),
                            reason="no C++ compiler for the kernel")


def _weight(kind: str, n: int, k: int, groups: int, zeros,
            seed: int = 0, group_size=None) -> QuantWeight:
    """Random codes and scales; ``zeros``: False (none), True (random
    zero points per row and group: offsets) or "uniform" (8 everywhere:
    the layer's one zero point, an FP8 layer's offsets)."""
    g = torch.Generator().manual_seed(seed)
    if kind == "int8":
        codes = torch.randint(-128, 128, (n, k), generator=g,
                              dtype=torch.int8)
    elif kind == "int4":
        codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.int8)
    else:
        codes = (torch.randn(n, k, generator=g) * 40).clamp(
            -448, 448).to(torch.float8_e4m3fn)
    scales = torch.rand(n, groups, generator=g) + 0.05
    if zeros == "uniform":
        z = torch.full((n, groups), 8.0)
    elif zeros:
        z = torch.randint(0, 16, (n, groups), generator=g).float()
    else:
        z = None
    return QuantWeight(kind, codes, scales, z, group_size)


@kernel
@pytest.mark.parametrize("kind", ["int8", "fp8", "int4"])
@pytest.mark.parametrize("n,k,groups,zeros", [(70, 256, 1, False),
                                              (96, 256, 2, True),
                                              (33, 128, 4, False),
                                              (64, 576, 1, True),
                                              (96, 256, 2, "uniform")])
@pytest.mark.parametrize("rows", [1, 5, 12, 13, 30])
def test_kernel_equals_dequantized_product(kind, n, k, groups, zeros, rows):
    w = _weight(kind, n, k, groups, zeros)
    x = torch.randn(rows, k)
    got = quant_linear(x, pack(w), None)
    want = x.double() @ w.dequantize().double().T
    assert got.shape == (rows, n) and got.dtype == torch.float32
    assert torch.allclose(got.double(), want, rtol=1e-5,
                          atol=1e-5 * want.abs().max().item())


@kernel
@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("rows", [1, 3, 16])
def test_kernel_last_group_shorter(kind, rows):
    # 576 features in groups of 128, as GPTQ groups SmolLM2's: 4 + 64.
    w = _weight(kind, 64, 576, 5, True, group_size=128)
    x = torch.randn(rows, 576)
    want = x.double() @ w.dequantize().double().T
    got = quant_linear(x, pack(w), None)
    assert torch.allclose(got.double(), want, rtol=1e-5,
                          atol=1e-5 * want.abs().max().item())
    with pytest.raises(ValueError, match="ceil"):
        QuantWeight(kind, w.codes, w.scales[:, :4], None, 128)


@kernel
@pytest.mark.parametrize("kind", ["int8", "fp8", "int4"])
@pytest.mark.parametrize("rows", [1, 3, 4, 12, 40])
@pytest.mark.parametrize("dot", [0, 4])
@pytest.mark.parametrize("zeros", [True, "uniform"])
def test_kernel_rounding_inputs_to_bfloat16(kind, rows, dot, zeros):
    # The bfloat16 precision: inputs rounded to bfloat16, then (from ``dot``
    # rows on, where the CPU has AVX512_BF16) multiplied as bfloat16 pairs.
    w = _weight(kind, 64, 576, 5, zeros, group_size=128)
    x = torch.randn(rows, 576)
    want = x.bfloat16().double() @ w.dequantize().double().T
    got = quant_linear(x, pack(w), None, round_inputs=True, dot=dot)
    assert torch.allclose(got.double(), want, rtol=2e-5,
                          atol=2e-5 * want.abs().max().item())


@kernel
@pytest.mark.parametrize("kind", ["int8", "fp8", "int4"])
@pytest.mark.parametrize("n,k,groups,zeros,group_size",
                         [(70, 256, 1, False, None), (64, 576, 5, True, 128),
                          (64, 576, 5, "uniform", 128)])
def test_dense_rows_multiply_the_bfloat16_weight(kind, n, k, groups, zeros,
                                                 group_size):
    """From ``dense`` rows on, rounded inputs multiply the weight
    dequantized to bfloat16 on oneDNN (where the kernel is built with
    AVX512_BF16): the product of bfloat16 inputs and weights, rounded to
    bfloat16, then the bias; fewer rows stay on the tiles, whose float32
    sums are not rounded."""
    if not (platform.machine() == "x86_64" and
            native.cpu_has("avx512_bf16")):
        pytest.skip("the dense path is built with AVX512_BF16 only")
    w = _weight(kind, n, k, groups, zeros, group_size=group_size)
    x = torch.randn(40, k, generator=torch.Generator().manual_seed(1))
    bias = torch.randn(n)
    weight16 = w.dequantize().bfloat16()
    want = torch.nn.functional.linear(x.bfloat16(), weight16).float()
    got = quant_linear(x, pack(w), None, round_inputs=True, dense=40)
    # Rounded to bfloat16; the sums' order is oneDNN's.
    assert torch.equal(got, got.bfloat16().float())
    assert torch.allclose(got, want, rtol=8e-3, atol=8e-3 * want.abs().max())
    assert torch.equal(quant_linear(x, pack(w), bias, round_inputs=True,
                                    dense=40), got + bias)
    tiles = quant_linear(x, pack(w), None, round_inputs=True, dense=41)
    assert not torch.equal(tiles, tiles.bfloat16().float())


@kernel
def test_kernel_bias_batch_dims_and_bfloat16():
    w = _weight("int4", 40, 128, 2, True)
    bias = torch.randn(40)
    x = torch.randn(3, 7, 128)
    want = x @ w.dequantize().T + bias
    got = quant_linear(x, pack(w), bias)
    assert got.shape == (3, 7, 40)
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-3)
    got16 = quant_linear(x.bfloat16(), pack(w), bias)
    assert got16.dtype == torch.bfloat16
    assert torch.allclose(got16.float(),
                          x.bfloat16().float() @ w.dequantize().T + bias,
                          rtol=2e-2, atol=5e-2)


@kernel
@pytest.mark.parametrize("kind", ["int8", "fp8", "int4"])
@pytest.mark.parametrize("rows", [1, 3, 5, 12])
def test_bfloat16_inputs_read_and_outputs_rounded_in_the_kernel(kind, rows):
    """A bfloat16 input (the bfloat16 precision's activations) is read as
    it is and its outputs rounded to bfloat16 as they are stored: exactly
    the float32 input's result, bias added, then rounded (the group sums
    of the offsets included)."""
    w = _weight(kind, 70, 576, 5, True, group_size=128)
    x = torch.randn(rows, 576).bfloat16()
    bias = torch.randn(70).bfloat16()
    got = quant_linear(x, pack(w), bias, round_inputs=True)
    assert got.dtype == torch.bfloat16
    want = quant_linear(x.float(), pack(w), bias.float(), round_inputs=True)
    assert torch.equal(got, want.bfloat16())


@pytest.mark.parametrize("amx", [True, False])
def test_kernel_rows_follow_the_cpu(monkeypatch, amx):
    """With AMX, prompts of DENSE_ROWS rows on oneDNN and float32 tiles
    below (faster there than bfloat16 pairs at every height); without it,
    bfloat16 pairs from DOT_ROWS rows; float32 inputs neither."""
    from vllm.model_executor.layers.quantization import (
        spyre_quant_linear as sql)
    monkeypatch.setattr(native, "has_amx_bf16", lambda: amx)
    for kind in ("int8", "fp8", "int4"):
        assert sql.kernel_rows(kind, False) == (0, 0)
        assert sql.kernel_rows(kind, True) == (
            (sql.DENSE_ROWS[kind], 0) if amx else (0, sql.DOT_ROWS))


@kernel
def test_every_fp8_code_is_read_exactly():
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F]  # no NaN codes
    codes = codes.view(torch.float8_e4m3fn).view(-1, 1).repeat(1, 32)
    w = QuantWeight("fp8", codes, torch.ones(codes.shape[0], 1))
    got = quant_linear(torch.eye(32)[:1], pack(w), None)[0]
    assert torch.equal(got, codes[:, 0].float())


@kernel
def test_kernel_under_torch_compile():
    w = pack(_weight("int8", 48, 64, 1, False))

    def f(x):
        return torch.relu(quant_linear(x, w, None)) * 2

    x = torch.randn(4, 64)
    torch._dynamo.reset()
    compiled = torch.compile(f, backend="inductor", fullgraph=True)
    assert torch.allclose(compiled(x), f(x), rtol=1e-5, atol=1e-5)


def test_pack_layout():
    w = _weight("int4", 40, 8, 1, False)
    p = pack(w)
    assert p.packed.shape == (2, 8, 16) and p.packed.dtype == torch.uint8
    # column 3 (low nibble of byte 3) and column 19 (its high nibble)
    assert torch.equal(p.packed[0, :, 3] & 15, w.codes[3].to(torch.uint8))
    assert torch.equal(p.packed[0, :, 3] >> 4, w.codes[19].to(torch.uint8))
    assert p.scales.shape == (2, 1, 32) and not p.scales[1, 0, 8:].any()
    # The kernel reads int4 codes as they are (0..15): no zero point needs
    # no offsets, one for every weight (8: symmetric formats) neither (the
    # kernel subtracts it once per group); zero points that differ are
    # offsets, -zero * scale.
    assert p.offsets is None and p.zero_point == 0
    w8 = QuantWeight("int4", w.codes, w.scales, torch.full_like(w.scales, 8.))
    assert pack(w8).offsets is None and pack(w8).zero_point == 8
    zeros = torch.full_like(w.scales, 8.)
    zeros[0, 0] = 7
    mixed = pack(QuantWeight("int4", w.codes, w.scales, zeros))
    assert mixed.zero_point == 0
    assert torch.equal(mixed.offsets[0, 0], -zeros[:32, 0] * w.scales[:32, 0])
    assert pack(_weight("int8", 40, 8, 1, False)).offsets is None


def test_fake_quantize_fp8_static_and_dynamic():
    x = torch.tensor([[0.1, -3.0, 1000.0], [0.0, 0.0, 0.0]])
    s = torch.tensor([0.5])
    got = fake_quantize_fp8(x, s)
    assert got[0, 2] == 448 * 0.5  # saturated, not NaN
    assert got[0, 1] == -3.0
    dyn = fake_quantize_fp8(x, None)
    assert dyn[0, 2] == 1000.0 and torch.equal(dyn[1], x[1])


GPTQ = dict(quant_method="gptq", bits=4, group_size=128, desc_act=False,
            sym=True, checkpoint_format="gptq")


def _fp8_group(strategy="tensor", inputs=("tensor", False)):
    group = {"targets": ["Linear"],
             "weights": {"num_bits": 8, "type": "float", "symmetric": True,
                         "strategy": strategy, "dynamic": False}}
    if inputs:
        group["input_activations"] = {
            "num_bits": 8, "type": "float", "symmetric": True,
            "strategy": inputs[0], "dynamic": inputs[1]}
    return {"quant_method": "compressed-tensors", "format": "float-quantized",
            "config_groups": {"group_0": group}, "ignore": ["lm_head"]}


def test_configs_spyre_runs():
    c = spyre_quant.SpyreQuantConfig.from_config(GPTQ)
    assert c.gptq.bits == 4 and c.gptq.group_size == 128
    assert not c.head_quantized
    assert c.describe() == "GPTQ 4-bit group 128, symmetric"
    c = spyre_quant.SpyreQuantConfig.from_config(
        {**GPTQ, "bits": 8, "group_size": -1, "lm_head": True})
    assert c.head_quantized and c.gptq.strategy == "channel"
    c = spyre_quant.SpyreQuantConfig.from_config(_fp8_group())
    assert c.describe() == "FP8 (tensor weight scales, static input scales)"
    c = spyre_quant.SpyreQuantConfig.from_config(
        _fp8_group("channel", ("token", True)))
    assert c.targets["Linear"].activations == "dynamic"
    c = spyre_quant.SpyreQuantConfig.from_config(_fp8_group(inputs=None))
    assert c.targets["Linear"].activations is None
    w4 = {"quant_method": "compressed-tensors", "format": "pack-quantized",
          "config_groups": {"g": {"targets": ["Linear"], "weights": {
              "num_bits": 4, "type": "int", "symmetric": True,
              "strategy": "group", "group_size": 128}}}}
    c = spyre_quant.SpyreQuantConfig.from_config(w4)
    assert c.describe() == "int 4-bit group 128, symmetric"


@pytest.mark.parametrize("config,named", [
    ({**GPTQ, "bits": 3}, "GPTQ with bits=3"),
    ({**GPTQ, "desc_act": True}, "desc_act=true"),
    ({**GPTQ, "checkpoint_format": "marlin"}, "checkpoint_format='marlin'"),
    ({**GPTQ, "group_size": 0}, "group_size=0"),
    (_fp8_group("block"), "strategy 'block'"),
    (_fp8_group(inputs=("group", False)), "strategy 'group'"),
    ({**_fp8_group(), "kv_cache_scheme": {"num_bits": 8}},
     "kv_cache_scheme"),
    ({**_fp8_group(), "format": "marlin-24"}, "format 'marlin-24'"),
    ({"quant_method": "awq", "bits": 4}, "quant_method 'awq'"),
])
def test_configs_refused_with_value_and_list(config, named):
    with pytest.raises(ValueError) as e:
        spyre_quant.SpyreQuantConfig.from_config(config)
    assert named in str(e.value)
    assert "Supported quantization: GPTQ (4 or 8 bits" in str(e.value)


def test_int8_activations_refused():
    config = _fp8_group()
    group = config["config_groups"]["group_0"]
    group["weights"]["type"] = group["input_activations"]["type"] = "int"
    config["format"] = "int-quantized"
    with pytest.raises(ValueError, match="format 'int-quantized'"):
        spyre_quant.SpyreQuantConfig.from_config(config)
    config["format"] = "pack-quantized"
    with pytest.raises(ValueError, match="int8 weights with quantized inputs"):
        spyre_quant.SpyreQuantConfig.from_config(config)


@pytest.mark.skipif(platform.machine() != "x86_64",
                    reason="builds the kernel for x86-64-v3 (AVX2)")
@pytest.mark.parametrize("vnni", [
    False,
    pytest.param(True, marks=pytest.mark.skipif(
        not native.cpu_has("avx_vnni"), reason="the CPU has no AVX-VNNI")),
])
def test_kernel_without_avx512(tmp_path, vnni):
    """The portable code (GCC vector extensions: Power, Z, AVX2-only x86)
    built for AVX2 in a subprocess gives the dequantized product too,
    every FP8 code exactly; and its integer tiles for decode rows
    (``vpmaddwd`` and an add, or AVX-VNNI's ``vpdpwssd``) give the
    products this machine's own build gives, bit for bit."""
    script = Path(__file__).resolve().parent.parent / \
        "quant_kernel_portable.py"
    saved = tmp_path / "integer_products.pt"
    done = subprocess.run([sys.executable, str(script)] +
                          (["--avx-vnni"] if vnni else []) + [str(saved)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and done.stdout.strip().endswith("OK"), \
        done.stdout[-2000:] + done.stderr[-4000:]
    if not (native.available() and sql.integer_rows("int8", True)):
        return  # this machine's build has no integer tiles to compare
    spec = importlib.util.spec_from_file_location("quant_kernel_portable",
                                                  script)
    portable = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(portable)
    products = torch.load(saved)
    cases = portable.integer_cases(sql)
    assert sorted(products) == sorted(cases)
    for name, (w, x) in cases.items():
        got = quant_linear(x, pack(w), None, round_inputs=True, ints=3)
        assert torch.equal(got, products[name]), name
