"""The engine's model load against the time to read the checkpoint.

For each model: the checkpoint's safetensors files are dropped from the
page cache (``posix_fadvise(POSIX_FADV_DONTNEED)``, which needs no
privileges) and read once, start to end, into a reused buffer: that is
the time to read the checkpoint from disk.  The files are dropped again
and ``vllm.LLM`` starts in a fresh process; the worker's
``get_startup_timings`` gives its model load (read, convert, quantize and
pack) and its warm-up.  Then the same, with the files in the page cache
(read again, engine started again): the read is the memory copy, and the
load what the engine adds to it.  The issue's target is a load at most
twice the read (``load/read``); the start-up log says where the load's
time went (FMS's loader: the read and the tensors widened; each
quantized layer is packed as it is read).

    python benchmarks/load_time.py [--models DIR,DIR] [--dtype bfloat16]
        [--json PATH]

For the realistic-size checkpoints ``scripts/benchmark_checkpoints.py``
writes:

    python benchmarks/load_time.py --models \\
        models/bench/granite-3.3-2b-bf16,models/bench/granite-3.3-2b-gptq-int8

The disk under a virtual machine may have its own cache, so a "cold"
read can be faster than the device; both cold figures are taken the same
way, one after the other.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from spyre_support.bench import (DEFAULT_MODEL, RESULTS, machine_info, table,
                                 write_json)
from spyre_support.envs import warmup_env
from warmup import start_once

GB = 1e9
#: One small static shape: the warm-up is not what is measured here.
SHAPE = (64, 4, 1)


def checkpoint_files(model: Path) -> list[Path]:
    files = sorted(model.glob("*.safetensors"))
    if not files:
        raise SystemExit(f"{model} holds no .safetensors files")
    return files


def drop_from_page_cache(files: list[Path]) -> None:
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def read_seconds(files: list[Path]) -> tuple[int, float]:
    """Bytes read and seconds taken to read every file start to end."""
    buffer = memoryview(bytearray(64 << 20))
    total = 0
    start = time.perf_counter()
    for path in files:
        with open(path, "rb", buffering=0) as f:
            while n := f.readinto(buffer):
                total += n
    return total, time.perf_counter() - start


def measure(model: Path, dtype: str) -> dict:
    files = checkpoint_files(model)
    env = warmup_env("eager", [SHAPE])
    found: dict = {"model": model.name}
    for state in ("cold", "warm"):
        if state == "cold":
            drop_from_page_cache(files)
        size, read_s = read_seconds(files)
        if state == "cold":
            drop_from_page_cache(files)
        info = start_once(f"{model.name} {state}", str(model), env,
                          dict(dtype=dtype))
        found[state] = dict(read_s=read_s, load_s=info["timings"]["load"],
                            warmup_s=sum(v for k, v in info["timings"].items()
                                         if k.startswith("warmup")),
                            engine_s=info["engine_s"])
        found["bytes"] = size
    return found


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=DEFAULT_MODEL,
                    help="comma-separated checkpoint directories")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--json", default=str(RESULTS / "load_time.json"))
    args = ap.parse_args()
    results = [measure(Path(m), args.dtype) for m in args.models.split(",")]
    rows = []
    for r in results:
        for state in ("cold", "warm"):
            s = r[state]
            rows.append([f"{r['model']} ({state})", f"{r['bytes'] / GB:.2f}",
                         f"{s['read_s']:.2f}",
                         f"{r['bytes'] / s['read_s'] / GB:.2f}",
                         f"{s['load_s']:.2f}",
                         f"{s['load_s'] / s['read_s']:.2f}x",
                         f"{s['warmup_s']:.1f}", f"{s['engine_s']:.1f}"])
    write_json(args.json, dict(args=vars(args), machine=machine_info(),
                               shape=SHAPE, results=results))
    print(f"\n--dtype {args.dtype}, backend eager, one warm-up shape "
          f"{SHAPE}; cold: the files dropped from the page cache first")
    print(table(["checkpoint", "GB", "read s", "read GB/s", "load s",
                 "load/read", "warm-up s", "start-up s"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
