"""Start-up cost of our engine per warm-up shape, with a cold and a warm
compile cache.

Starts ``vllm.LLM`` twice, each time in a fresh process: first with an
empty ``TORCHINDUCTOR_CACHE_DIR`` and ``TORCH_EXTENSIONS_DIR`` (cold: every
graph is compiled from scratch, and the packed linear kernel is built
during the load), then with the same, now filled, directories (warm:
inductor and AOTAutograd reuse their cached artifacts; dynamo still
traces).  The worker's ``get_startup_timings`` gives the seconds of the
model load and of each shape's warm-up.  The shapes are every combination of the given
prompt lengths (rounded up to a multiple of 64), new tokens and batch
sizes.  With ``--backend eager`` nothing is cached, so both runs cost the
same.

    python benchmarks/warmup.py [--model DIR] [--prompt-lens 64]
        [--new-tokens 64] [--batch-sizes 1,4,8,16] [--backend inductor]
        [--json PATH] [--keep-cache]
"""
from __future__ import annotations

import argparse
import itertools
import shutil
import sys
import tempfile
import time
from pathlib import Path

from _common import (DEFAULT_MODEL, RESULTS, Child, cores, machine_info,
                     padded_prompt_len, parse_ints, spyre_env, table,
                     write_json)


class StartupProbe:
    """Lives in the child: starts the engine, reports its timings."""

    def __init__(self, model: str) -> None:
        from vllm import LLM
        start = time.perf_counter()
        llm = LLM(model=model)
        self.engine_s = time.perf_counter() - start
        self.timings = llm.collective_rpc("get_startup_timings")[0]

    def info(self) -> dict:
        return dict(engine_s=self.engine_s, timings=self.timings)


def start_once(label: str, model: str, env: dict) -> dict:
    print(f"[{label}] starting the engine ...", flush=True)
    child = Child(label, StartupProbe, model, env=env)
    try:
        info = child.result()
    finally:
        child.close()
    print(f"[{label}] engine started in {info['engine_s']:.1f} s",
          flush=True)
    return info


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--prompt-lens", default="64")
    ap.add_argument("--new-tokens", default="64")
    ap.add_argument("--batch-sizes", default="1,4,8,16")
    ap.add_argument("--backend", default="inductor",
                    choices=["inductor", "eager"])
    ap.add_argument("--json", default=str(RESULTS / "warmup.json"))
    ap.add_argument("--keep-cache", action="store_true",
                    help="keep the compile cache directory")
    args = ap.parse_args()

    prompt_lens = sorted({padded_prompt_len(p)
                          for p in parse_ints(args.prompt_lens)})
    if prompt_lens != sorted(set(parse_ints(args.prompt_lens))):
        print(f"prompt lengths rounded up to multiples of 64: "
              f"{prompt_lens}", flush=True)
    shapes = list(itertools.product(prompt_lens,
                                    parse_ints(args.new_tokens),
                                    parse_ints(args.batch_sizes)))
    cache = tempfile.mkdtemp(prefix="warmup-inductor-cache-")
    env = dict(spyre_env(args.backend, shapes),
               TORCHINDUCTOR_CACHE_DIR=cache,
               TORCH_EXTENSIONS_DIR=str(Path(cache) / "extensions"))
    try:
        cold = start_once("cold", args.model, env)
        warm = start_once("warm", args.model, env)
    finally:
        if args.keep_cache:
            print(f"compile cache kept in {cache}")
        else:
            shutil.rmtree(cache, ignore_errors=True)

    def total(info: dict) -> float:
        return sum(v for k, v in info["timings"].items()
                   if k.startswith("warmup"))

    phases = [(k, cold["timings"][k], warm["timings"].get(k, float("nan")))
              for k in cold["timings"]]
    phases += [("all warm-ups", total(cold), total(warm)),
               ("engine start-up (wall)", cold["engine_s"], warm["engine_s"])]
    rows = [[name, f"{c:.1f}", f"{w:.1f}", f"{c / w:.2f}x"]
            for name, c, w in phases]
    write_json(args.json, dict(
        args=vars(args), machine=machine_info(),
        shapes=[dict(prompt_len=p, new_tokens=g, batch_size=b)
                for p, g, b in shapes],
        cold=cold, warm=warm))
    print(f"\nmodel {Path(args.model).name}, backend {args.backend}, "
          f"{len(shapes)} shape(s), {cores()} cores; cold: empty "
          "TORCHINDUCTOR_CACHE_DIR and TORCH_EXTENSIONS_DIR, warm: the "
          "same directories again")
    print(table(["phase", "cold s", "warm s", "cold/warm"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
