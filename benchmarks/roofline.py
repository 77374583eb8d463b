"""Batch-1 decode step time against the memory-bandwidth limit.

At batch 1 a decode step must read every weight of the model once, so it
cannot be faster than weight bytes / memory read bandwidth (the roofline).
This script measures the machine's read bandwidth, counts the model's
weight bytes (each parameter storage once: tied embeddings count once), and
runs the offline.py workload at batch 1 through our engine and, as a
reference, through transformers ``generate``, each in its own process.
``--engines`` names other engines of offline.py instead (ours in bfloat16
or a quantized format, at a realistic size); each of ours is held to its
own limit: the bytes its decode step reads (its packed or quantized
weights, norms and head; not the embedding table, of which a step reads a
row, nor the copies that only prompts multiply) over the bandwidth.  The
measured step is (total - TTFT) / (G - 1), median of the repetitions after
an untimed warm run; any compilation during a timed run fails the script.

The bandwidth is the best of N reads of a 1 GiB float32 tensor (far
larger than the caches; every page touched before timing) by
``stream_read.cpp``, built on first use with PyTorch's C++ extension
loader: one thread per core, each summing a contiguous share as 16
sub-streams of 16-float vector loads, prefetched 1 KiB ahead into L2.  It
replaces ``torch.sum`` over the same tensor, whose figures (21-23 GB/s in
earlier runs) fell below the rate at which our packed linear kernel and
llama.cpp were later seen to stream SmolLM2's weights (about 31 GB/s), so
that limit was not one.  ``torch.sum`` still takes turns with the C++ read
and is reported beside it; taken together, the C++ read was the faster by
3-27 %.  Only figures taken together compare: this machine's bandwidth
drifts between about 22 and 78 GB/s from one minute to the next, so the
read is timed again after the engines have run, and the limit is the
higher of the two readings.  Where the C++ read cannot be built, the
roofline is ``torch.sum``'s, with a note.  Each engine's decode tokens/s
is also given as a ratio to the first engine's (``--engines``' first:
int8 and int4 against bfloat16 above).

    python benchmarks/roofline.py [--model DIR] [--backend inductor]
        [--prompt-len 64] [--new-tokens 64] [--repetitions 3]
        [--bandwidth-gib 1] [--json PATH] [--engines E1,E2,...]

At a realistic size (``scripts/benchmark_checkpoints.py``), on the
default backend, bfloat16 and the quantized formats side by side:

    python benchmarks/roofline.py --model models/bench/granite-3.3-2b-bf16 \
        --engines spyre-eager-bf16,spyre-eager-gptq-int8,spyre-eager-gptq-int4

``--march x86-64-v3`` builds our engines' kernels for that x86 target
instead of this CPU (``ops.load_for``): a CPU with AVX2 and no AVX-512,
measured here against this machine's read limit.
"""
from __future__ import annotations

import argparse
import ctypes
import dataclasses
import functools
import platform
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

from spyre_support.bench import (DEFAULT_MODEL, RESULTS, Workload,
                                 compiled_in_timed_runs, cores, machine_info,
                                 table, write_json)
from _engines import measure, start_engines, stop_engines


STREAM_READ = Path(__file__).with_name("stream_read.cpp")
_NATIVE_FLAG = {"x86_64": "-march=native", "s390x": "-march=native",
                "ppc64le": "-mcpu=native", "aarch64": "-mcpu=native"}


@functools.cache
def stream_read() -> Optional[Callable[[Any, int], float]]:
    """``stream_sum(x, threads)``: the sum of the contiguous float32 CPU
    tensor ``x``, read by ``threads`` threads (``stream_read.cpp``, built on
    first use and cached in ``TORCH_EXTENSIONS_DIR``); None, with a printed
    note, where it cannot be built."""
    import torch
    from torch.utils.cpp_extension import load
    flags = ["-O3", "-fopenmp"]
    native = _NATIVE_FLAG.get(platform.machine())
    if native:
        flags.append(native)
    try:
        path = load(name="spyre_stream_read", sources=[str(STREAM_READ)],
                    extra_cflags=flags, extra_ldflags=["-fopenmp"],
                    is_python_module=False)
    except Exception as e:  # no compiler, or an unsupported platform
        print(f"note: {STREAM_READ.name} could not be built ({e}); the "
              "read bandwidth is torch.sum's", flush=True)
        return None
    kernel = ctypes.CDLL(path).spyre_stream_sum
    kernel.restype = ctypes.c_double
    kernel.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]

    def stream_sum(x: torch.Tensor, threads: int) -> float:
        if (x.dtype != torch.float32 or x.device.type != "cpu"
                or not x.is_contiguous()):
            raise ValueError(
                f"stream_sum reads a contiguous float32 CPU tensor, not "
                f"{x.dtype} on {x.device} (contiguous: {x.is_contiguous()})")
        if threads < 1:
            raise ValueError(f"stream_sum needs threads >= 1, not {threads}")
        return kernel(x.data_ptr(), x.numel(), threads)

    return stream_sum


def read_bandwidths(gib: float, repeats: int = 10) -> dict[str, float]:
    """Bytes/s of the fastest of ``repeats`` reads of ``gib`` GiB of
    float32 by each reader, the readers taking turns so that their figures
    come from the same minutes: "stream_read" (``stream_read.cpp``, one
    thread per core; absent where it cannot be built) and "torch.sum" (one
    intra-op thread per core)."""
    import torch
    torch.set_num_threads(cores())
    x = torch.ones(int(gib * 2**30) // 4, dtype=torch.float32)  # touched
    readers = {"torch.sum": x.sum}
    stream_sum = stream_read()
    if stream_sum is not None:
        readers = {"stream_read": lambda: stream_sum(x, cores()), **readers}
    best = dict.fromkeys(readers, float("inf"))
    for read in readers.values():
        read()
    for _ in range(repeats):
        for name, read in readers.items():
            start = time.perf_counter()
            read()
            best[name] = min(best[name], time.perf_counter() - start)
    nbytes = x.numel() * x.element_size()
    return {name: nbytes / seconds for name, seconds in best.items()}


def read_bandwidth(gib: float, repeats: int = 10) -> float:
    """The roofline's read bandwidth, bytes/s: stream_read's, or
    torch.sum's where the C++ read cannot be built."""
    rates = read_bandwidths(gib, repeats)
    return rates.get("stream_read", rates["torch.sum"])


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
                    help="size of the tensor read to measure bandwidth")
    ap.add_argument("--json", default=str(RESULTS / "roofline.json"))
    ap.add_argument("--engines", default=None,
                    help="offline.py engines to run instead of "
                    "spyre-<backend> and hf")
    ap.add_argument("--march", default=None,
                    help="build our engines' kernels for this x86 target, "
                    "not this CPU (x86-64-v3: AVX2 without AVX-512)")
    args = ap.parse_args()
    if args.new_tokens < 2 or args.repetitions < 1:
        ap.error("--new-tokens must be >= 2 and --repetitions >= 1")

    # Before any engine exists, so nothing else runs on the cores; and
    # again once they are gone (a shared host's read rate drifts within
    # minutes): the limit is the higher of the two.
    rates = read_bandwidths(args.bandwidth_gib)
    reader = "stream_read" if "stream_read" in rates else "torch.sum"
    for name, rate in rates.items():
        print(f"memory read bandwidth, {name}: {rate / 1e9:.2f} GB/s",
              flush=True)

    work = dataclasses.replace(
        Workload.build(args.model, args.prompt_len, args.new_tokens, [1]),
        kernel_target=args.march)
    ours = f"spyre-{args.backend}"
    engines = args.engines.split(",") if args.engines else [ours, "hf"]
    children = start_engines(engines, work)
    try:
        timings, ids = measure(children, work, args.repetitions)
    finally:
        stop_engines(children)
    rates_after = read_bandwidths(args.bandwidth_gib)
    bandwidth = max(rates[reader], rates_after[reader])
    print(f"memory read bandwidth after the runs, {reader}: "
          f"{rates_after[reader] / 1e9:.2f} GB/s", flush=True)

    # The model's weights, as transformers holds them, or else as the
    # first of ours reads them.
    reference = "hf" if "hf" in engines else engines[0]
    weight_bytes = children[reference][1].get(
        "weight_bytes", children[reference][1].get("step_bytes"))
    roofline_s = weight_bytes / bandwidth
    same_ids = (ids[ours, 1][-1] == ids["hf", 1][-1]
                if {ours, "hf"} <= set(engines) else None)
    results, rows = {}, []
    first = timings[engines[0], 1].summary()["decode_tok_s"]
    for engine in engines:
        s = timings[engine, 1].summary()
        read = children[engine][1].get("step_bytes", weight_bytes)
        limit_s = read / bandwidth
        percent = limit_s / s["step_s"] * 100
        results[engine] = dict(runs=timings[engine, 1].runs, median=s,
                               step_bytes=read, roofline_step_s=limit_s,
                               percent_of_limit=percent)
        rows.append([engine, f"{read / 1e6:.1f}", f"{s['step_s'] * 1e3:.2f}",
                     f"{limit_s * 1e3:.2f}", f"{percent:.1f}%",
                     f"{s['decode_tok_s']:.2f}",
                     f"{s['decode_tok_s'] / first:.2f}x", s["compiles"]])
    compiled = sum(r["median"]["compiles"] for r in results.values())
    write_json(args.json, dict(
        args=vars(args), machine=machine_info(),
        bandwidth_bytes_per_s=bandwidth, bandwidth_reader=reader,
        read_bandwidths_bytes_per_s=rates,
        read_bandwidths_after_bytes_per_s=rates_after,
        weight_bytes=weight_bytes,
        roofline_step_s=roofline_s, engines=results,
        ids_equal_to_hf=same_ids, compilations=compiled))

    print(f"\nmodel {Path(args.model).name}, batch 1, P={args.prompt_len}, "
          f"G={args.new_tokens}, median of {args.repetitions}, "
          f"{cores()} cores")
    facts = [(f"read bandwidth, {name}", f"{rate / 1e9:.2f} GB/s")
             for name, rate in rates.items()]
    facts.append((f"read bandwidth after, {reader}",
                  f"{rates_after[reader] / 1e9:.2f} GB/s (the limit: the "
                  "higher)"))
    facts += [("weight bytes per step", f"{weight_bytes / 1e6:.1f} MB"),
              ("roofline step", f"{roofline_s * 1e3:.2f} ms ({reader})")]
    if same_ids is not None:
        facts.append((f"ids {ours} == hf", str(same_ids)))
    width = max(len(k) for k, _ in facts)
    for key, value in facts:
        print(f"{key.ljust(width)}  {value}")
    print(table(["engine", "MB read per step", "step ms", "roofline ms",
                 "% of limit", "decode tok/s", f"vs {engines[0]}",
                 "compiles"], rows))
    if compiled_in_timed_runs(compiled):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
