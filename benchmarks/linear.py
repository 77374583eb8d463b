"""The linear layers of one decode step, per kernel, against bandwidth.

Loads the model's weights (FMS), then times one pass over every linear
layer of the model (for SmolLM2: 4 per layer and the LM head, each weight
read once) at several row counts (the batch size of a decode step) with
three kernels:

* ``aten``: ``torch.nn.functional.linear`` on the plain weight (MKL);
* ``mkl-packed``: ``mkl._mkl_linear`` on a weight packed for that row
  count, what inductor's ``freezing`` uses for float32;
* ``spyre-packed``: ``spyre_cpu::packed_linear`` (our kernel), one packed
  copy for every row count.

Reports the best of N passes, the weight bytes read per second, and the
ratio to ``mkl-packed``; the machine's read bandwidth (as in roofline.py)
is printed first for reference.  Outputs of the three kernels are compared,
and any dynamo compilation during the passes fails the run (the kernels
run eagerly; none is expected).

    python benchmarks/linear.py [--model DIR] [--rows 1,8,16,64]
        [--repeats 7] [--json PATH]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from _common import (DEFAULT_MODEL, RESULTS, compile_count, cores,
                     machine_info, parse_ints, table, write_json)
from _engines import load_fms_model
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


def kernels(rows: int):
    """name -> (prepare(weight), apply(x, prepared))."""
    import torch
    import torch.nn.functional as F

    from vllm.attention.ops import spyre_native as native
    from vllm.model_executor.layers import spyre_linear
    ops = {
        "aten": (lambda w: w, lambda x, w: F.linear(x, w)),
        "mkl-packed": (
            lambda w: (torch.ops.mkl._mkl_reorder_linear_weight(w, rows), w),
            lambda x, p: torch.ops.mkl._mkl_linear(x, p[0], p[1], None,
                                                   rows)),
    }
    if native.available():
        ops["spyre-packed"] = (
            lambda w: (spyre_linear.pack_weight(w), w.shape[0]),
            lambda x, p: torch.ops.spyre_cpu.packed_linear(x, p[0], p[1]))
    return ops


def time_pass(weights, prepare, apply, rows: int, repeats: int):
    """Best time of one pass over every weight, and the outputs."""
    import torch
    prepared = [prepare(w) for w in weights]
    gen = torch.Generator().manual_seed(0)
    inputs = {k: torch.randn(rows, k, generator=gen)
              for k in {w.shape[1] for w in weights}}

    def one_pass():
        return [apply(inputs[w.shape[1]], p)
                for w, p in zip(weights, prepared)]

    outputs = one_pass()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        one_pass()
        best = min(best, time.perf_counter() - start)
    return best, outputs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--rows", type=parse_ints, default=[1, 8, 16, 64])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json", default=str(RESULTS / "linear.json"))
    args = ap.parse_args()

    import torch
    torch.set_num_threads(cores())
    bandwidth = read_bandwidth(1.0)
    print(f"memory read bandwidth {bandwidth / 1e9:.2f} GB/s", flush=True)
    weights = load_linears(args.model)
    nbytes = sum(w.numel() * w.element_size() for w in weights)

    results, mismatches = [], 0
    compiles_before = compile_count()
    for n in args.rows:
        ref_out = None
        for name, (prepare, apply) in kernels(n).items():
            with torch.inference_mode():
                best, out = time_pass(weights, prepare, apply, n,
                                      args.repeats)
            if ref_out is None:
                ref_out = out
            same = all(torch.allclose(a, b, rtol=1e-3, atol=1e-4)
                       for a, b in zip(out, ref_out))
            mismatches += not same
            results.append(dict(kernel=name, rows=n, seconds=best,
                                bytes_per_s=nbytes / best, same=same))
            print(f"{name} rows={n}: {best * 1e3:.2f} ms", flush=True)
    compiled = compile_count() - compiles_before
    mkl = {r["rows"]: r["seconds"] for r in results
           if r["kernel"] == "mkl-packed"}
    rows = [[r["kernel"], r["rows"], f"{r['seconds'] * 1e3:.2f}",
             f"{r['bytes_per_s'] / 1e9:.2f}",
             f"{mkl[r['rows']] / r['seconds']:.2f}x",
             "yes" if r["same"] else "NO"] for r in results]

    write_json(args.json, dict(args=vars(args), machine=machine_info(),
                               bandwidth_bytes_per_s=bandwidth,
                               weight_bytes=nbytes, layers=len(weights),
                               results=results, compilations=compiled))
    print(f"\nmodel {Path(args.model).name}: {len(weights)} linear layers, "
          f"{nbytes / 1e6:.1f} MB of weights, best of {args.repeats}, "
          f"{cores()} cores, read bandwidth {bandwidth / 1e9:.2f} GB/s")
    print(table(["kernel", "rows", "ms per pass", "GB/s",
                 "vs mkl-packed", "same output"], rows))
    if mismatches:
        print(f"FAILED: {mismatches} kernel(s) disagree with aten")
    if compiled:
        print(f"FAILED: {compiled} compilation(s) during the timed passes")
    return 1 if mismatches or compiled else 0


if __name__ == "__main__":
    sys.exit(main())
