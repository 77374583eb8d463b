"""Batch-1 decode step time against the memory-bandwidth limit.

At batch 1 a decode step must read every weight of the model once, so it
cannot be faster than weight bytes / memory read bandwidth (the roofline).
This script measures the machine's read bandwidth (best of N ``torch.sum``
over a 1 GiB float32 tensor on every core), counts the model's weight bytes
(each parameter storage once: tied embeddings count once), and runs the
offline.py workload at batch 1 through our engine and, as a reference,
through transformers ``generate``, each in its own process.  The measured
step is (total - TTFT) / (G - 1), median of the repetitions after an
untimed warm run; any compilation during a timed run fails the script.

    python benchmarks/roofline.py [--model DIR] [--backend inductor]
        [--prompt-len 64] [--new-tokens 64] [--repetitions 3]
        [--bandwidth-gib 1] [--json PATH]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from _common import (DEFAULT_MODEL, RESULTS, Workload, cores, machine_info,
                     table, write_json)
from _engines import measure, start_engines, stop_engines


def read_bandwidth(gib: float, repeats: int = 10) -> float:
    """Bytes/s of the fastest of ``repeats`` sums over ``gib`` GiB of
    float32, with one intra-op thread per core."""
    import torch
    torch.set_num_threads(cores())
    x = torch.ones(int(gib * 2**30) // 4, dtype=torch.float32)  # touched
    x.sum()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - start)
    return x.numel() * x.element_size() / best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--backend", default="inductor",
                    choices=["inductor", "eager"],
                    help="compile backend of our engine")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repetitions", type=int, default=3)
    ap.add_argument("--bandwidth-gib", type=float, default=1.0,
                    help="size of the tensor summed to measure bandwidth")
    ap.add_argument("--json", default=str(RESULTS / "roofline.json"))
    args = ap.parse_args()
    if args.new_tokens < 2 or args.repetitions < 1:
        ap.error("--new-tokens must be >= 2 and --repetitions >= 1")

    # Before any engine exists, so nothing else runs on the cores.
    bandwidth = read_bandwidth(args.bandwidth_gib)
    print(f"memory read bandwidth {bandwidth / 1e9:.2f} GB/s", flush=True)

    work = Workload.build(args.model, args.prompt_len, args.new_tokens, [1])
    ours = f"spyre-{args.backend}"
    engines = [ours, "hf"]
    children = start_engines(engines, work)
    try:
        timings, ids = measure(children, work, args.repetitions)
    finally:
        stop_engines(children)

    weight_bytes = children["hf"][1]["weight_bytes"]
    roofline_s = weight_bytes / bandwidth
    same_ids = ids[ours, 1][-1] == ids["hf", 1][-1]
    results, rows = {}, []
    for engine in engines:
        s = timings[engine, 1].summary()
        percent = roofline_s / s["step_s"] * 100
        results[engine] = dict(runs=timings[engine, 1].runs, median=s,
                               percent_of_limit=percent)
        rows.append([engine, f"{s['step_s'] * 1e3:.2f}",
                     f"{roofline_s * 1e3:.2f}", f"{percent:.1f}%",
                     f"{s['decode_tok_s']:.1f}", s["compiles"]])
    compiled = sum(r["median"]["compiles"] for r in results.values())
    write_json(args.json, dict(
        args=vars(args), machine=machine_info(),
        bandwidth_bytes_per_s=bandwidth, weight_bytes=weight_bytes,
        roofline_step_s=roofline_s, engines=results,
        ids_equal_to_hf=same_ids, compilations=compiled))

    print(f"\nmodel {Path(args.model).name}, batch 1, P={args.prompt_len}, "
          f"G={args.new_tokens}, median of {args.repetitions}, "
          f"{cores()} cores")
    facts = [("memory read bandwidth", f"{bandwidth / 1e9:.2f} GB/s"),
             ("weight bytes per step", f"{weight_bytes / 1e6:.1f} MB"),
             ("roofline step", f"{roofline_s * 1e3:.2f} ms"),
             (f"ids {ours} == hf", str(same_ids))]
    width = max(len(k) for k, _ in facts)
    for key, value in facts:
        print(f"{key.ljust(width)}  {value}")
    print(table(["engine", "step ms", "roofline ms", "% of limit",
                 "decode tok/s", "compiles"], rows))
    if compiled:
        print(f"FAILED: {compiled} compilation(s) during timed runs")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
