"""Prefix caching and chunked prefill under load on the continuous-batching server.

Two workloads, each against two ``vllm serve`` processes it starts in
turn (continuous batching, ``--backend``, default inductor):

* ``shared-prefix``: every request is one system prompt (``--system``
  tokens, default 1,024) and its own question (``--question`` tokens,
  default 32); ``--requests`` of them (64) at ``--concurrency`` (8).
  Without and with ``--enable-prefix-caching``: time to first token
  p50/p99 and output tokens/s, and the ratios.
* ``long-join``: ``--short`` requests (8) decode ``--short-tokens`` tokens
  (64) each; half a second in, ``--long`` prompts (8) of ``--long-tokens``
  tokens (2,000) start arriving, one every half second.  Without and with
  ``--enable-chunked-prefill`` (``--chunk`` tokens, 256): the inter-token
  latency p50/p99 of the short requests, the time to first token of the
  long ones, and the ratios.

Prompts are token ids cut from the benchmark text; every request streams
and must return exactly its ``max_tokens``.

    .venv/bin/python benchmarks/prefix_and_chunks.py                     # both workloads, SmolLM2, inductor
    .venv/bin/python benchmarks/prefix_and_chunks.py --workloads long-join --plot docs/images/prefill.png
"""
from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path
from typing import Optional

import httpx

from spyre_support.bench import (DEFAULT_MODEL, RESULTS, table, text_ids,
                                 write_json)
from spyre_support.envs import cb_env
from spyre_support.load import completion_body, percentile, stream_one

from serving_load import served

WORKLOADS = ("shared-prefix", "long-join")


def window(ids: list[int], start: int, n: int) -> list[int]:
    """``n`` token ids of the text from ``start``, wrapping around."""
    return [ids[(start + i) % len(ids)] for i in range(n)]


def percentiles(values: list[float]) -> dict[str, float]:
    return {"p50_ms": 1e3 * percentile(values, 0.5),
            "p99_ms": 1e3 * percentile(values, 0.99),
            "max_ms": 1e3 * max(values, default=float("nan"))}


async def shared_prefix(url: str, model: str, ids: list[int], args) -> dict:
    system = window(ids, 0, args.system)
    bodies = [completion_body(model, system + window(ids, args.system + 997 * i,
                                           args.question), args.max_tokens)
              for i in range(args.requests)]
    ttfts, itls, counts, errors = [], [], [], []
    sem = asyncio.Semaphore(args.concurrency)
    async with httpx.AsyncClient(timeout=3600) as client:

        async def bounded(body):
            async with sem:
                await stream_one(client, url + "/v1/completions", body, ttfts, itls,
                           counts, errors)

        start = time.perf_counter()
        await asyncio.gather(*(bounded(b) for b in bodies))
        wall = time.perf_counter() - start
    return dict(ttft=percentiles(ttfts), itl=percentiles(itls),
                output_tok_s=sum(counts) / wall, wall_s=wall,
                errors=errors[:5], n_errors=len(errors))


async def long_join(url: str, model: str, ids: list[int], args) -> dict:
    shorts = [completion_body(model, window(ids, 5000 + 101 * i, 32),
                    args.short_tokens) for i in range(args.short)]
    longs = [completion_body(model, window(ids, 20000 + 3001 * i, args.long_tokens),
                   8) for i in range(args.long)]
    short_lists = ([], [], [], [])
    long_lists = ([], [], [], [])
    errors: list[str] = []
    async with httpx.AsyncClient(timeout=3600) as client:
        target = url + "/v1/completions"

        async def late(i, body):
            await asyncio.sleep(0.5 + 0.5 * i)
            await stream_one(client, target, body, *long_lists[:3], errors)

        start = time.perf_counter()
        await asyncio.gather(
            *(stream_one(client, target, b, *short_lists[:3], errors)
              for b in shorts),
            *(late(i, b) for i, b in enumerate(longs)))
        wall = time.perf_counter() - start
    return dict(short_itl=percentiles(short_lists[1]),
                short_ttft=percentiles(short_lists[0]),
                long_ttft=percentiles(long_lists[0]), wall_s=wall,
                errors=errors[:5], n_errors=len(errors))


def servers(workload: str, args) -> list[tuple[str, tuple]]:
    """(name, extra ``vllm serve`` arguments) of the two servers."""
    if workload == "shared-prefix":
        length = args.system + args.question + args.max_tokens
        base = ("--max-num-seqs", str(args.concurrency), "--max-model-len",
                str(-(-length // 64) * 64))
        return [("no cache", base),
                ("prefix caching", base + ("--enable-prefix-caching", ))]
    length = args.long_tokens + 8
    base = ("--max-num-seqs", str(args.short + args.long),
            "--max-model-len", str(-(-length // 64) * 64))
    return [("whole prefills", base),
            (f"chunks of {args.chunk}",
             base + ("--enable-chunked-prefill", "--max-num-batched-tokens",
                     str(args.chunk)))]


def run(workload: str, args, ids: list[int]) -> dict:
    from spyre_support.server import Server
    env = cb_env(args.backend)
    out = {}
    for name, cli in servers(workload, args):
        print(f"[{workload}] {name}: vllm serve {' '.join(cli)} (backend "
              f"{args.backend}; warm-up takes a while)", flush=True)
        with Server(Path(args.model), env, cli) as server:
            model = served(server.url)
            drive = shared_prefix if workload == "shared-prefix" else \
                long_join
            out[name] = asyncio.run(drive(server.url, model, ids, args))
        if out[name]["n_errors"]:
            print(f"[{workload}] {name}: {out[name]['n_errors']} errors, "
                  f"e.g. {out[name]['errors'][0]}", flush=True)
    return out


def report(results: dict) -> None:
    if "shared-prefix" in results:
        r = results["shared-prefix"]
        rows = [[n, f"{m['ttft']['p50_ms']:.0f}", f"{m['ttft']['p99_ms']:.0f}",
                 f"{m['output_tok_s']:.1f}", f"{m['wall_s']:.1f}",
                 m["n_errors"]] for n, m in r.items()]
        print("\nshared prefix")
        print(table(["server", "TTFT p50 ms", "TTFT p99 ms", "output tok/s",
                     "wall s", "errors"], rows))
        a, b = r["no cache"], r["prefix caching"]
        print(f"prefix caching / no cache: TTFT p50 "
              f"{b['ttft']['p50_ms'] / a['ttft']['p50_ms']:.2f}x, output "
              f"tok/s {b['output_tok_s'] / a['output_tok_s']:.2f}x")
    if "long-join" in results:
        r = results["long-join"]
        rows = [[n, f"{m['short_itl']['p50_ms']:.0f}",
                 f"{m['short_itl']['p99_ms']:.0f}",
                 f"{m['short_itl']['max_ms']:.0f}",
                 f"{m['long_ttft']['p50_ms']:.0f}", f"{m['wall_s']:.1f}",
                 m["n_errors"]] for n, m in r.items()]
        print("\nlong prompts joining running decodes")
        print(table(["server", "running ITL p50 ms", "running ITL p99 ms",
                     "running ITL max ms", "long TTFT p50 ms", "wall s",
                     "errors"], rows))
        names = list(r)
        a, b = r[names[0]], r[names[1]]
        print(f"{names[1]} / {names[0]}: running ITL p99 "
              f"{b['short_itl']['p99_ms'] / a['short_itl']['p99_ms']:.2f}x, "
              f"long TTFT p50 "
              f"{b['long_ttft']['p50_ms'] / a['long_ttft']['p50_ms']:.2f}x")


def plot(path: str, results: dict, args) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    panels = [w for w in WORKLOADS if w in results]
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.6),
                             squeeze=False)
    for ax, workload in zip(axes[0], panels):
        r = results[workload]
        names = list(r)
        if workload == "shared-prefix":
            key = "ttft"
            title = f"shared {args.system:,}-token prefix: TTFT"
        else:
            key = "short_itl"
            title = (f"{args.long_tokens:,}-token prompts joining: ITL of "
                     "the running")
        x = range(len(names))
        ax.bar([i - 0.2 for i in x], [r[n][key]["p50_ms"] for n in names],
               0.4, label="p50")
        ax.bar([i + 0.2 for i in x], [r[n][key]["p99_ms"] for n in names],
               0.4, label="p99")
        ax.set_xticks(list(x), names)
        ax.set_ylabel("ms")
        ax.set_title(title)
        ax.legend()
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--backend", default="inductor",
                    choices=["eager", "inductor"])
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--system", type=int, default=1024)
    ap.add_argument("--question", type=int, default=32)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=32,
                    help="max_tokens of the shared-prefix requests")
    ap.add_argument("--short", type=int, default=8)
    ap.add_argument("--short-tokens", type=int, default=64)
    ap.add_argument("--long", type=int, default=8)
    ap.add_argument("--long-tokens", type=int, default=2000)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--json", default=str(RESULTS / "prefix-and-chunks.json"))
    ap.add_argument("--plot", help="write the plot here")
    args = ap.parse_args(argv)
    args.workloads = [w for w in args.workloads.split(",") if w]
    if any(w not in WORKLOADS for w in args.workloads):
        ap.error(f"--workloads: choose from {','.join(WORKLOADS)}")
    return args


def main() -> int:
    args = parse_args()
    ids = text_ids(args.model)
    results = {w: run(w, args, ids) for w in args.workloads}
    report(results)
    write_json(args.json, dict(model=args.model, backend=args.backend,
                               args={k: v for k, v in vars(args).items()
                                     if k not in ("json", "plot")},
                               results=results))
    if args.plot:
        plot(args.plot, results, args)
    errors = sum(m["n_errors"] for r in results.values() for m in r.values())
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
