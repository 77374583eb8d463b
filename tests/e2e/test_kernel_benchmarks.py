"""The kernel benchmarks on small workloads: each script runs its C++
kernels against PyTorch's ops (linear layers, LoRA products, decode,
encoder and cached attention), and must finish with the same outputs as
the ops they stand for, its JSON and its table."""
from __future__ import annotations

import json

import pytest

from spyre_support import preloaded
from spyre_support.paths import REPO


@pytest.mark.smollm2
def test_linear_benchmark_small(smollm2, tmp_path):
    """benchmarks/linear.py: every kernel over every linear layer of the
    model (float32, bfloat16 and the quantized kernel's int8, FP8 and
    int4, and its integer decode rows), outputs compared with the weights
    each holds, no compilation, JSON and table."""
    out = tmp_path / "linear.json"
    proc = preloaded.run(
        [str(REPO / "benchmarks" / "linear.py"),
         "--model", str(smollm2), "--rows", "1,4", "--repeats", "1",
         "--json", str(out)],
        timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["layers"] == 4 * 30 + 1  # SmolLM2: 30 layers, LM head
    kernels = {(r["kernel"], r["rows"]) for r in result["results"]}
    names = ["aten", "mkl-packed", "spyre-packed", "spyre-bf16",
             "spyre-int8", "spyre-fp8", "spyre-int4", "spyre-int8-bf16in",
             "spyre-fp8-bf16in", "spyre-int4-bf16in", "onednn-bf16"]
    from vllm.model_executor.layers.quantization.spyre_quant_linear import (
        integer_rows)
    from vllm.spyre_kernels.ops import cpu_has
    if cpu_has("avx512_bf16"):  # the kernel's dot and dense paths
        names += [f"spyre-{kind}-{path}" for path in ("dot", "dense")
                  for kind in ("int8", "fp8", "int4")]
    # Decode rows on 16-bit integer inputs: AVX512BW, or AVX2 alone.
    if integer_rows("int8", True):
        names += ["spyre-int8-int16", "spyre-int4-int16"]
    assert kernels == {(k, n) for k in names for n in (1, 4)}
    assert all(r["same"] and r["bytes_per_s"] > 0
               for r in result["results"])
    held = {r["kernel"]: r["weight_bytes"] for r in result["results"]}
    # bfloat16 halves float32's bytes, 8-bit codes halve them again and
    # int4 again (scales aside).
    assert held["spyre-bf16"] == held["spyre-packed"] // 2
    assert held["spyre-int8"] < 0.52 * held["spyre-bf16"]
    assert held["spyre-fp8"] == held["spyre-int8"]
    assert held["spyre-int4"] < 0.6 * held["spyre-int8"]
    assert result["compilations"] == 0
    lines = proc.stdout.strip().splitlines()
    header = next(i for i, line in enumerate(lines)
                  if line.startswith("kernel "))
    assert len(lines) - header == 2 + 2 * len(names)


def test_lora_kernel_benchmark_small(tiny_llama, tmp_path):
    """benchmarks/lora_kernel.py: a decode step's adapter products on the
    kernel and on torch ops, their outputs compared first, the rows on one
    slot and on two; the bytes read grow with the slots used."""
    out = tmp_path / "lora_kernel.json"
    proc = preloaded.run(
        [str(REPO / "benchmarks" / "lora_kernel.py"),
         "--model", str(tiny_llama), "--rows", "3", "--slots", "2",
         "--passes", "2", "--json", str(out)],
        timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    runs = json.loads(out.read_text())["runs"]
    assert set(runs) == {"1", "2"}
    assert all(run["kernel"] > 0 and run["torch-ops"] > 0
               for run in runs.values())
    assert runs["2"]["bytes"] == 2 * runs["1"]["bytes"]
    lines = proc.stdout.strip().splitlines()
    header = next(i for i, line in enumerate(lines)
                  if line.startswith("path "))
    assert len(lines) - header == 2 + 4


@pytest.mark.smollm2
def test_attention_benchmark_small(smollm2, tmp_path):
    """benchmarks/attention.py: the C++ attention kernels against the torch
    ops on SmolLM2's cache geometry; every case agrees, JSON and table."""
    out = tmp_path / "attention.json"
    proc = preloaded.run(
        [str(REPO / "benchmarks" / "attention.py"),
         "--model", str(smollm2), "--batch-sizes", "2", "--contexts",
         "70", "--repeats", "1", "--json", str(out)],
        timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["geometry"] == dict(layers=30, heads=9, kv_heads=3,
                                      head_dim=64)
    cases = [(r["case"], r["batch"], r["ctx"]) for r in result["results"]]
    assert cases == [("paged decode", 2, 70), ("paged mixed", 2, 70),
                     ("paged prefill", 1, 70), ("static decode", 2, 70)]
    assert all(r["same"] and r["kernel_s"] > 0 and r["torch_ops_s"] > 0
               for r in result["results"])
    # The mixed lengths' bytes: 16 to 124 tokens each.
    mixed = result["results"][1]["kv_bytes"] // (2 * 3 * 64 * 4 * 30)
    assert 2 * 16 <= mixed <= 2 * 124
    lines = proc.stdout.strip().splitlines()
    header = next(i for i, line in enumerate(lines)
                  if line.startswith("case "))
    assert len(lines) - header == 2 + 4


def test_cache_step_benchmark_small(smollm2, tmp_path):
    """benchmarks/cache_step.py: the cache ops before and after, vLLM's
    and FMS's, on SmolLM2's geometry; both leave the same caches and
    outputs in every case, JSON and table."""
    out = tmp_path / "cache_step.json"
    proc = preloaded.run(
        [str(REPO / "benchmarks" / "cache_step.py"),
         "--model", str(smollm2), "--batch-sizes", "1,3", "--contexts",
         "70", "--repeats", "1", "--json", str(out)],
        timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    cases = [(r["case"], r["code"], r["batch"])
             for r in result["results"]]
    assert cases == [(case, code, b) for b in (1, 3)
                     for case in ("static decode", "paged decode")
                     for code in ("vllm", "fms")]
    assert all(r["same"] and r["before_s"] > 0 and r["after_s"] > 0
               for r in result["results"])
    lines = proc.stdout.strip().splitlines()
    header = next(i for i, line in enumerate(lines)
                  if line.startswith("case "))
    assert len(lines) - header == 2 + 8


def test_encoder_attention_benchmark_small(tmp_path):
    """benchmarks/encoder_attention.py: SDPA and the kernel, both
    precisions, on one small packing; the float32 kernel agrees, JSON and
    table."""
    from spyre_support.paths import MINILM_DIR
    out = tmp_path / "encoder-attention.json"
    proc = preloaded.run(
        [str(REPO / "benchmarks" / "encoder_attention.py"),
         "--model", str(MINILM_DIR), "--cases", "4x20", "--repeats", "1",
         "--json", str(out)],
        timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (row, ) = json.loads(out.read_text())["results"]
    assert (row["batch"], row["slots"]) == (2, 64)  # three 20-token texts a row
    assert row["same"] is True
    assert set(row["seconds"]) == {"SDPA fp32", "SDPA bf16", "kernel fp32",
                                   "kernel bf16"}
    lines = proc.stdout.strip().splitlines()
    assert lines[-3].startswith("texts x tokens")
    assert lines[-1].startswith("4 x 20")
