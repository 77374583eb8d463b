"""The linear layers of one decode step, per kernel, against bandwidth.

Loads the model's weights (FMS), then times one pass over every linear
layer of the model (for SmolLM2: 4 per layer and the LM head, each weight
read once) at several row counts (the batch size of a decode step) with
three kernels:

* ``aten``: ``torch.nn.functional.linear`` on the plain weight (MKL);
* ``mkl-packed``: ``mkl._mkl_linear`` on a weight packed for that row
  count, what inductor's ``freezing`` uses for float32;
* ``spyre-packed``: ``spyre_kernels::packed_linear`` (our kernel), one packed
  copy for every row count;
* ``spyre-bf16``: the same kernel on bfloat16 weights (``--dtype
  bfloat16``; from 16 rows on AMX tiles where the CPU has them);
* ``spyre-int8``, ``spyre-fp8``, ``spyre-int4``: ``spyre_kernels::quant_linear``
  (docs/quantization.md) on the weights quantized here by round to
  nearest: int8 and FP8 per output channel, int4 per group of 64 (which
  divides SmolLM2's features), symmetric; ``spyre-<kind>-bf16in``: the
  same under ``--dtype bfloat16`` (inputs rounded to bfloat16; tiles of
  ``DOT_ROWS`` rows or more on ``vdpbf16ps`` where the CPU has AVX512_BF16
  and no AMX; an int8 layer's rows stay on the float32 tiles there);
  ``spyre-<kind>-int16``: int8 and int4 rows up to ``INT_ROWS`` on
  16-bit integer inputs where the CPU has AVX512BW, ``INT_ROWS_AVX2``
  where it has AVX2 alone (quant_int16.h), as the engine runs decode
  steps; ``spyre-<kind>-dot``: the same
  inputs, every row count on ``vdpbf16ps`` tiles, and
  ``spyre-<kind>-dense``: on oneDNN over the weight dequantized to
  bfloat16 per call (AMX where the CPU has it; what a prompt of
  ``DENSE_ROWS`` rows or more runs there), both where the CPU has
  AVX512_BF16; ``onednn-bf16``: a bfloat16 weight on oneDNN (AMX where
  the CPU has it), the peer of ``spyre-bf16``'s AMX tiles.  The dense kernels round their outputs to
  bfloat16.

Reports the best of N passes, the bytes each kernel's weights are held in
and read per second, and the ratio of its time to ``mkl-packed``'s; the
machine's read bandwidth (as in roofline.py) is printed first for
reference.  Outputs are compared with ``aten``'s on the weights each
kernel holds (bfloat16 or dequantized: exact products, up to the order of
the sums), and any dynamo compilation during the passes fails the run
(the kernels run eagerly; none is expected).

    python benchmarks/linear.py [--model DIR] [--rows 1,8,16,64]
        [--repeats 7] [--kernels aten,mkl-packed,spyre-packed,...]
        [--march TARGET] [--json PATH]

``--march x86-64-v3`` builds the kernels for that x86 target instead of
this CPU (``ops.load_for``): what a CPU with AVX2 and no AVX-512 runs,
measured here.  The paths the CPU's own flags choose (``spyre-<kind>-dot``,
``-dense``) then run the target's tiles instead.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from spyre_support.bench import (DEFAULT_MODEL, RESULTS, cores, machine_info,
                                 parse_ints, table, write_json)
from spyre_support.engines import compile_count
from _drivers import load_fms_model
from roofline import read_bandwidth


def load_linears(model_dir: str) -> list:
    """Float32 weights of every linear layer, each storage once."""
    import torch
    model = load_fms_model(model_dir)
    seen, weights = set(), []
    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            w = m.weight.detach()
            if w.data_ptr() not in seen:
                seen.add(w.data_ptr())
                weights.append(w.contiguous())
    return weights


def quantize_rtn(w, kind: str):
    """``w`` quantized by round to nearest, symmetric: int8 and FP8 per
    output channel, int4 per group of 64 (codes 0..15, zero point 8)."""
    import torch

    from vllm.model_executor.layers.quantization.spyre_quant_linear import (
        QuantWeight)
    if kind == "int4":
        g = w.view(w.shape[0], -1, 64)
        scale = g.abs().amax(-1) / 7
        codes = (torch.round(g / scale[..., None]) + 8).clamp(0, 15)
        return QuantWeight("int4", codes.view_as(w).to(torch.int8), scale,
                           torch.full_like(scale, 8.0), 64)
    amax = w.abs().amax(-1, keepdim=True)
    if kind == "int8":
        scale = amax / 127
        return QuantWeight("int8", torch.round(w / scale).clamp(
            -127, 127).to(torch.int8), scale)
    scale = amax / 448
    return QuantWeight("fp8", (w / scale).to(torch.float8_e4m3fn), scale)


#: The weights of one quantized kind, packed and dequantized, kept while
#: the kernels of that kind run at every row count (the kernels' loop is
#: grouped by kind, so one kind is held at a time).
_QUANTIZED: dict = {}


def quantized(w, kind: str):
    """``w`` quantized to ``kind`` and packed for the kernel: (packed, the
    weight it stands for, bytes held)."""
    from vllm.model_executor.layers.quantization import spyre_quant_linear
    key = (kind, w.data_ptr())
    if key not in _QUANTIZED:
        if any(k != kind for k, _ in _QUANTIZED):
            _QUANTIZED.clear()
        q = quantize_rtn(w, kind)
        p = spyre_quant_linear.pack(q)
        held = sum(t.numel() * t.element_size()
                   for t in (p.packed, p.scales, p.offsets) if t is not None)
        _QUANTIZED[key] = (p, q.dequantize(), held)
    return _QUANTIZED[key]


def kernels(rows: int):
    """name -> (prepare(weight) -> (held, weight it stands for, bytes[,
    whether it rounds its inputs to bfloat16]), apply(x, held))."""
    import torch
    import torch.nn.functional as F

    from vllm.spyre_kernels import ops as native
    from vllm.model_executor.layers import spyre_linear
    from vllm.model_executor.layers.quantization import spyre_quant_linear

    def plain(w):
        return w, w, w.numel() * w.element_size()

    ops = {
        "aten": (plain, lambda x, w: F.linear(x, w)),
        "mkl-packed": (
            lambda w: ((torch.ops.mkl._mkl_reorder_linear_weight(w, rows),
                        w), w, w.numel() * w.element_size()),
            lambda x, p: torch.ops.mkl._mkl_linear(x, p[0], p[1], None,
                                                   rows)),
    }
    if native.available():
        ops["spyre-packed"] = (
            lambda w: ((spyre_linear.pack_weight(w), w.shape[0]), w,
                       w.numel() * w.element_size()),
            lambda x, p: torch.ops.spyre_kernels.packed_linear(x, p[0], p[1]))

        def bf16(w):
            b = w.to(torch.bfloat16)
            return ((spyre_linear.pack_weight(b), w.shape[0]),
                    b.float(), b.numel() * 2, True)

        ops["spyre-bf16"] = (
            bf16, lambda x, p: torch.ops.spyre_kernels.packed_linear(
                x, p[0], p[1]))
        for kind in ("int8", "fp8", "int4"):
            def prepare(w, kind=kind):
                return quantized(w, kind)
            ops[f"spyre-{kind}"] = (
                prepare,
                lambda x, p: spyre_quant_linear.quant_linear(x, p, None))
            # --dtype bfloat16: inputs rounded, bfloat16 pairs from
            # DOT_ROWS rows where the engine uses them on this CPU.
            dot = spyre_quant_linear.kernel_rows(kind, True)[1]
            ops[f"spyre-{kind}-bf16in"] = (
                lambda w, prepare=prepare: (*prepare(w), True),
                lambda x, p, dot=dot: spyre_quant_linear.quant_linear(
                    x, p, None, round_inputs=True, dot=dot))
            # int8 decode rows on 16-bit integer inputs, where the engine
            # takes them (spyre_quant_linear.integer_rows; quant_int16.h).
            # Checked to the loose tolerance (its inputs are held to 2^-15
            # of each span's largest; tests/unit/test_spyre_quant_int16.py
            # holds it to that).
            ints = spyre_quant_linear.integer_rows(kind, True)
            if ints:
                ops[f"spyre-{kind}-int16"] = (
                    lambda w, prepare=prepare: (*prepare(w), True, True),
                    lambda x, p, ints=ints: spyre_quant_linear.quant_linear(
                        x, p, None, round_inputs=True, ints=ints))
            # The same, every row count on oneDNN over the weight
            # dequantized to bfloat16 per call (what DENSE_ROWS rows or
            # more run where the CPU has AMX); the kernel has that path
            # where it is built with AVX512_BF16.
            if native.cpu_has("avx512_bf16"):
                ops[f"spyre-{kind}-dot"] = (
                    lambda w, prepare=prepare: (*prepare(w), True),
                    lambda x, p: spyre_quant_linear.quant_linear(
                        x, p, None, round_inputs=True, dot=1))
                ops[f"spyre-{kind}-dense"] = (
                    lambda w, prepare=prepare: (*prepare(w), True, True),
                    lambda x, p: spyre_quant_linear.quant_linear(
                        x, p, None, round_inputs=True, dense=1))
    # oneDNN's own bfloat16 product, for the kernel's AMX tiles.
    ops["onednn-bf16"] = (
        lambda w: (w.to(torch.bfloat16), w.to(torch.bfloat16).float(),
                   w.numel() * 2, True, True),
        lambda x, p: spyre_linear.onednn_bf16_linear(x, p, None))
    return ops


def time_pass(weights, prepare, apply, rows: int, repeats: int):
    """Best time of one pass over every weight, the bytes the weights are
    held in, and whether the outputs equal ``aten``'s on the weights the
    kernel stands for."""
    import torch
    import torch.nn.functional as F
    prepared = [prepare(w) for w in weights]
    gen = torch.Generator().manual_seed(0)
    inputs = {k: torch.randn(rows, k, generator=gen)
              for k in {w.shape[1] for w in weights}}

    def one_pass():
        return [apply(inputs[w.shape[1]], p[0])
                for w, p in zip(weights, prepared)]

    outputs = one_pass()
    def reference(x, p):
        if len(p) > 3 and p[3]:
            x = x.to(torch.bfloat16).float()
        return F.linear(x, p[1])

    def close(out, want, rounded):
        if rounded:  # weights and outputs rounded to bfloat16
            return torch.allclose(out, want, rtol=1e-2,
                                  atol=1e-2 * want.abs().max().item())
        return torch.allclose(out, want, rtol=1e-3, atol=1e-4)

    same = all(
        close(out, reference(inputs[w.shape[1]], p), len(p) > 4 and p[4])
        for w, p, out in zip(weights, prepared, outputs))
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        one_pass()
        best = min(best, time.perf_counter() - start)
    return best, sum(p[2] for p in prepared), same


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--rows", type=parse_ints, default=[1, 8, 16, 64])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--kernels", default=None,
                    help="comma-separated subset (default: all that run "
                    "here; mkl-packed always, for the ratio)")
    ap.add_argument("--march", default=None,
                    help="build the kernels for this x86 target, not this "
                    "CPU (x86-64-v3: AVX2 without AVX-512)")
    ap.add_argument("--json", default=str(RESULTS / "linear.json"))
    args = ap.parse_args()

    import torch
    if args.march:
        from vllm.spyre_kernels import ops as native
        if not native.load_for(args.march):
            print(f"the kernels could not be built for {args.march}")
            return 1
    torch.set_num_threads(cores())
    bandwidth = read_bandwidth(1.0)
    print(f"memory read bandwidth {bandwidth / 1e9:.2f} GB/s", flush=True)
    weights = load_linears(args.model)
    nbytes = sum(w.numel() * w.element_size() for w in weights)

    wanted = set(args.kernels.split(",")) | {"mkl-packed"} \
        if args.kernels else None
    results, mismatches = [], 0
    compiles_before = compile_count()
    # Kernel by kernel, every row count, so that what a kernel prepares
    # once (a quantized kind) serves all of them.
    for name in kernels(args.rows[0]):
        if wanted is not None and name not in wanted:
            continue
        for n in args.rows:
            prepare, apply = kernels(n)[name]
            with torch.inference_mode():
                best, held, same = time_pass(weights, prepare, apply, n,
                                             args.repeats)
            mismatches += not same
            results.append(dict(kernel=name, rows=n, seconds=best,
                                weight_bytes=held, bytes_per_s=held / best,
                                same=same))
            print(f"{name} rows={n}: {best * 1e3:.2f} ms", flush=True)
    compiled = compile_count() - compiles_before
    mkl = {r["rows"]: r["seconds"] for r in results
           if r["kernel"] == "mkl-packed"}
    rows = [[r["kernel"], r["rows"], f"{r['seconds'] * 1e3:.2f}",
             f"{r['weight_bytes'] / 1e6:.1f}",
             f"{r['bytes_per_s'] / 1e9:.2f}",
             f"{mkl[r['rows']] / r['seconds']:.2f}x",
             "yes" if r["same"] else "NO"] for r in results]

    write_json(args.json, dict(args=vars(args), machine=machine_info(),
                               bandwidth_bytes_per_s=bandwidth,
                               weight_bytes=nbytes, layers=len(weights),
                               results=results, compilations=compiled))
    print(f"\nmodel {Path(args.model).name}: {len(weights)} linear layers, "
          f"{nbytes / 1e6:.1f} MB of float32 weights, best of "
          f"{args.repeats}, {cores()} cores, read bandwidth "
          f"{bandwidth / 1e9:.2f} GB/s. MB: the bytes each kernel's weights "
          "are held in; GB/s: those bytes over the time; same output: "
          "equal to aten on the weights the kernel holds")
    print(table(["kernel", "rows", "ms per pass", "MB", "GB/s",
                 "vs mkl-packed", "same output"], rows))
    if mismatches:
        print(f"FAILED: {mismatches} kernel(s) disagree with aten on "
              "their weights")
    if compiled:
        print(f"FAILED: {compiled} compilation(s) during the timed passes")
    return 1 if mismatches or compiled else 0


if __name__ == "__main__":
    sys.exit(main())
