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

``--cb`` compares instead the start of a continuous-batching engine
(``VLLM_SPYRE_USE_CB=1``, ``--max-model-len`` 2048, ``--max-num-seqs`` 16:
its warm-up compiles one prefill graph and one decode graph whatever
the lengths) with the start of a static engine of ONE shape, the first of
the given prompt lengths, new tokens and batch sizes (64, 64, 1), each
with its own empty compile cache, and prints the ratio CB / static.

    python benchmarks/warmup.py [--model DIR] [--prompt-lens 64]
        [--new-tokens 64] [--batch-sizes 1,4,8,16] [--backend inductor]
        [--json PATH] [--keep-cache]
    python benchmarks/warmup.py --cb [--max-model-len 2048]
        [--max-num-seqs 16] [--backend inductor] [--json PATH]

``--graph-cache`` measures the project's compiled-graph cache
(``TORCH_SENDNN_CACHE_ENABLE=1``): a static engine of the given shapes
(default 64/64 x batch 1, 4, 8) and a CB engine, each started cold (empty
graph cache) and then warm (the graph cache the cold start filled), every
start in a fresh process with an empty ``TORCHINDUCTOR_CACHE_DIR``, so that
only the graph cache counts.  The C++ kernels of the packed linear layers
and of decode attention are built once beforehand (``TORCH_EXTENSIONS_DIR``
is kept, as it is across restarts of a server).

    python benchmarks/warmup.py --graph-cache [--batch-sizes 1,4,8]
        [--max-model-len 2048] [--max-num-seqs 16] [--json PATH]
"""
from __future__ import annotations

import argparse
import itertools
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

from spyre_support.bench import (Child, DEFAULT_MODEL, RESULTS, cores,
                                 machine_info, parse_ints, table, write_json)
from spyre_support.envs import cb_env, padded_prompt_len, warmup_env


class StartupProbe:
    """Lives in the child: starts the engine, reports its timings."""

    def __init__(self, model: str, engine_args: Optional[dict] = None) -> None:
        from vllm import LLM
        start = time.perf_counter()
        llm = LLM(model=model, **(engine_args or {}))
        self.engine_s = time.perf_counter() - start
        self.timings = llm.collective_rpc("get_startup_timings")[0]
        self.graphs = llm.collective_rpc("get_graph_cache_stats")[0]

    def info(self) -> dict:
        return dict(engine_s=self.engine_s, timings=self.timings,
                    graphs=self.graphs)


def start_once(label: str, model: str, env: dict,
               engine_args: Optional[dict] = None) -> dict:
    print(f"[{label}] starting the engine ...", flush=True)
    child = Child(label, StartupProbe, model, engine_args, env=env)
    try:
        info = child.result()
    finally:
        child.close()
    print(f"[{label}] engine started in {info['engine_s']:.1f} s",
          flush=True)
    return info


def warmup_total(info: dict) -> float:
    """Seconds of every warm-up phase of one engine start."""
    return sum(v for k, v in info["timings"].items()
               if k.startswith("warmup"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--prompt-lens", default="64")
    ap.add_argument("--new-tokens", default="64")
    ap.add_argument("--batch-sizes", default="1,4,8,16")
    ap.add_argument("--backend", default="inductor",
                    choices=["inductor", "eager"])
    ap.add_argument("--cb", action="store_true",
                    help="a continuous-batching start against one static "
                    "shape's")
    ap.add_argument("--graph-cache", action="store_true",
                    help="cold and warm starts with the graph cache, "
                    "static and CB")
    ap.add_argument("--max-model-len", type=int, default=2048,
                    help="--max-model-len of the CB engine")
    ap.add_argument("--max-num-seqs", type=int, default=16,
                    help="--max-num-seqs of the CB engine")
    ap.add_argument("--json", help="default: benchmarks/results/warmup.json "
                    "(--cb: warmup-cb.json)")
    ap.add_argument("--keep-cache", action="store_true",
                    help="keep the compile cache directory")
    args = ap.parse_args()
    if args.json is None:
        args.json = str(RESULTS / (
            "warmup-graph-cache.json" if args.graph_cache else
            "warmup-cb.json" if args.cb else "warmup.json"))
    if args.graph_cache:
        return graph_cache_cold_warm(args)
    return cb_against_static(args) if args.cb else shapes_cold_warm(args)


def shapes_cold_warm(args) -> int:
    """Every shape, with a cold and then a warm compile cache."""
    prompt_lens = sorted({padded_prompt_len(p)
                          for p in parse_ints(args.prompt_lens)})
    if prompt_lens != sorted(set(parse_ints(args.prompt_lens))):
        print(f"prompt lengths rounded up to multiples of 64: "
              f"{prompt_lens}", flush=True)
    shapes = list(itertools.product(prompt_lens,
                                    parse_ints(args.new_tokens),
                                    parse_ints(args.batch_sizes)))
    cache = tempfile.mkdtemp(prefix="warmup-inductor-cache-")
    env = dict(warmup_env(args.backend, shapes),
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

    phases = [(k, cold["timings"][k], warm["timings"].get(k, float("nan")))
              for k in cold["timings"]]
    phases += [("all warm-ups", warmup_total(cold), warmup_total(warm)),
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


def cb_against_static(args) -> int:
    """A CB engine start and a one-shape static start, each on an empty
    compile cache of its own."""
    shape = (padded_prompt_len(parse_ints(args.prompt_lens)[0]),
             parse_ints(args.new_tokens)[0], parse_ints(args.batch_sizes)[0])
    cb_args = dict(max_model_len=args.max_model_len,
                   max_num_seqs=args.max_num_seqs)
    runs = {
        "cb": (f"continuous batching (max_model_len={args.max_model_len}, "
               f"max_num_seqs={args.max_num_seqs})",
               cb_env(args.backend), cb_args),
        "static": ("static, one shape (prompt_len={}, new_tokens={}, "
                   "batch_size={})".format(*shape),
                   dict(warmup_env(args.backend, [shape]),
                        VLLM_SPYRE_USE_CB="0"), None),
    }
    found = {}
    for label, (what, env, engine_args) in runs.items():
        cache = tempfile.mkdtemp(prefix=f"warmup-{label}-inductor-cache-")
        env = dict(env, TORCHINDUCTOR_CACHE_DIR=cache,
                   TORCH_EXTENSIONS_DIR=str(Path(cache) / "extensions"))
        try:
            found[label] = start_once(label, args.model, env, engine_args)
        finally:
            if args.keep_cache:
                print(f"compile cache kept in {cache}")
            else:
                shutil.rmtree(cache, ignore_errors=True)
        found[label].update(what=what, warmup_s=warmup_total(found[label]),
                            load_s=found[label]["timings"]["load"])

    cb, st = found["cb"], found["static"]
    ratios = {k: cb[k] / st[k] for k in ("load_s", "warmup_s", "engine_s")}
    write_json(args.json, dict(
        args=vars(args), machine=machine_info(),
        static_shape=dict(prompt_len=shape[0], new_tokens=shape[1],
                          batch_size=shape[2]),
        cb=cb, static=st, ratios=ratios))
    rows = [[i["what"], f"{i['load_s']:.1f}", f"{i['warmup_s']:.1f}",
             f"{i['engine_s']:.1f}"] for i in (cb, st)]
    rows.append(["CB / static"] + [f"{ratios[k]:.2f}x" for k in
                                   ("load_s", "warmup_s", "engine_s")])
    print(f"\nmodel {Path(args.model).name}, backend {args.backend}, "
          f"{cores()} cores; each start on an empty TORCHINDUCTOR_CACHE_DIR "
          "and TORCH_EXTENSIONS_DIR")
    print(table(["engine start", "load s", "warm-up s", "start-up (wall) s"],
                rows))
    print(f"CB warm-up / static-shape warm-up: {ratios['warmup_s']:.2f}x")
    return 0


def graph_cache_cold_warm(args) -> int:
    """Static (every shape) and CB engines, each started cold then warm on
    one graph cache, every start on an empty inductor cache."""
    if args.batch_sizes == "1,4,8,16":
        args.batch_sizes = "1,4,8"
    shapes = list(itertools.product(
        sorted({padded_prompt_len(p) for p in parse_ints(args.prompt_lens)}),
        parse_ints(args.new_tokens), parse_ints(args.batch_sizes)))
    cb_args = dict(max_model_len=args.max_model_len,
                   max_num_seqs=args.max_num_seqs)
    engines = {
        "static": ("static, {} shape(s): prompt_len {}, new_tokens {}, "
                   "batch sizes {}".format(len(shapes), args.prompt_lens,
                                           args.new_tokens,
                                           args.batch_sizes),
                   dict(warmup_env(args.backend, shapes),
                        VLLM_SPYRE_USE_CB="0"), None),
        "cb": (f"continuous batching (max_model_len={args.max_model_len}, "
               f"max_num_seqs={args.max_num_seqs})",
               cb_env(args.backend), cb_args),
    }
    found: dict = {}
    for label, (what, env, engine_args) in engines.items():
        graphs = tempfile.mkdtemp(prefix=f"warmup-{label}-graph-cache-")
        try:
            for phase in ("cold", "warm"):
                inductor = tempfile.mkdtemp(prefix="warmup-inductor-cache-")
                run_env = dict(env, TORCH_SENDNN_CACHE_ENABLE="1",
                               TORCH_SENDNN_CACHE_DIR=graphs,
                               TORCHINDUCTOR_CACHE_DIR=inductor)
                try:
                    info = start_once(f"{label} {phase}", args.model, run_env,
                                      engine_args)
                finally:
                    shutil.rmtree(inductor, ignore_errors=True)
                info.update(what=what, warmup_s=warmup_total(info),
                            load_s=info["timings"]["load"])
                found[(label, phase)] = info
        finally:
            shutil.rmtree(graphs, ignore_errors=True)

    rows, ratios = [], {}
    for label, (what, _, _) in engines.items():
        cold, warm = found[(label, "cold")], found[(label, "warm")]
        for phase, info in (("cold", cold), ("warm", warm)):
            g = info["graphs"]
            rows.append([
                f"{what}: {phase}", f"{info['load_s']:.1f}",
                f"{info['warmup_s']:.1f}", f"{info['engine_s']:.1f}",
                f"{g.get('compiled', 0)} compiled, {g.get('loaded', 0)} "
                "loaded"
            ])
        ratios[label] = {k: cold[k] / warm[k]
                         for k in ("warmup_s", "engine_s")}
        rows.append([
            f"{label}: cold / warm", "",
            f"{ratios[label]['warmup_s']:.1f}x",
            f"{ratios[label]['engine_s']:.1f}x", ""
        ])
    write_json(args.json, dict(
        args=vars(args), machine=machine_info(),
        shapes=[dict(prompt_len=p, new_tokens=g, batch_size=b)
                for p, g, b in shapes],
        starts={f"{k[0]} {k[1]}": v for k, v in found.items()},
        ratios=ratios))
    print(f"\nmodel {Path(args.model).name}, backend {args.backend}, "
          f"{cores()} cores; graph cache on (TORCH_SENDNN_CACHE_ENABLE=1); "
          "every start in a fresh process on an empty "
          "TORCHINDUCTOR_CACHE_DIR")
    print(table(["engine start", "load s", "warm-up s", "start-up (wall) s",
                 "graphs"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
