"""Burst and soak of the Spyre OpenAI server: nothing lost, nothing leaked.

``burst``: N completion requests sent at once (concurrency N), each with its
own ``request_id``.  Every request must either complete with exactly its
``max_tokens`` or get an explicit HTTP error; every answer must carry the id
it was sent with, once (none lost, none duplicated or crossed); and the
server's own count of finished requests must grow by the number completed.

``soak``: N streaming requests at concurrency C, drawn from a pool of
``--distinct`` requests of random prompt lengths and ``max_tokens`` (fixed
seed); about a third are dropped by the client at a random token.  Each
distinct request is first run alone: the greedy reference.  Reported: the
server's resident memory (API server, engine and worker processes) after
the first ``--baseline`` requests and at the end, and their ratio (within
5 %); running and waiting requests and KV cache usage at the end (all 0:
every slot or block is free); completed streams whose tokens differ from
their reference (0).

``features``: the soak with every feature on at once
(``spyre_support.feature_soak``): continuous batching with prefix caching,
chunked prefill (``--chunk`` tokens a step) and structured output, a pool
asking in turn for plain, structured, prompt-log-probability, ``n`` = 2
and long-prompt (``--long-prompt``) requests, half sharing a prefix.  The
same checks, memory at the end within 3 % of its level after the first
quarter of the requests, and as many server processes as then (no grammar
compiler left behind).

Each run starts ``vllm serve`` on loopback (static batching over
``--static-shapes``, or continuous batching with ``--batching cb``), or
uses ``--url`` (then without the memory figures).  The exit code is
non-zero if any check fails.

    python benchmarks/serving_soak.py burst [--batching static|cb]
        [--requests 500] [--backend eager] [--json FILE]
    python benchmarks/serving_soak.py soak [--batching static|cb]
        [--requests 2000] [--concurrency 16] [--json FILE]
    python benchmarks/serving_soak.py features [--requests 2000]
        [--concurrency 16] [--max-model-len 1024] [--chunk 256]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
from dataclasses import asdict
from pathlib import Path

import httpx

from spyre_support.feature_soak import feature_requests, server_args
from spyre_support.paths import SMOLLM2_DIR
from spyre_support.server import Server
from spyre_support.soak import (burst, random_requests, soak, soak_plan,
                                tree_rss, tree_size)

DEFAULT_MODEL = str(SMOLLM2_DIR)


# ---- command line ----------------------------------------------------------

def server_env(args) -> tuple[dict, tuple]:
    env = {"VLLM_SPYRE_DYNAMO_BACKEND": args.backend}
    if args.kind == "features":
        env["VLLM_SPYRE_USE_CB"] = "1"
        return env, server_args(args.max_model_len, args.chunk,
                                args.max_num_seqs)
    if args.batching == "cb":
        env["VLLM_SPYRE_USE_CB"] = "1"
        return env, ("--max-num-seqs", str(args.max_num_seqs),
                     "--max-model-len", str(args.max_model_len))
    p, g, b = (int(x) for x in args.static_shapes.split(":"))
    env.update(VLLM_SPYRE_WARMUP_PROMPT_LENS=str(p),
               VLLM_SPYRE_WARMUP_NEW_TOKENS=str(g),
               VLLM_SPYRE_WARMUP_BATCH_SIZES=str(b))
    return env, ()


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("kind", choices=["burst", "soak", "features"])
    ap.add_argument("--url", help="a running server; default: start one")
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--batching", choices=["static", "cb"], default="static")
    ap.add_argument("--backend", choices=["eager", "inductor"],
                    default="eager")
    ap.add_argument("--static-shapes", default="128:32:8",
                    help="prompt_len:new_tokens:batch_size of the static "
                    "server")
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--max-model-len", type=int,
                    help="continuous batching: 256; features: 1024")
    ap.add_argument("--chunk", type=int, default=256,
                    help="features: tokens prefilled a step")
    ap.add_argument("--long-prompt", default="300:700",
                    help="features: min:max tokens of the long prompts")
    ap.add_argument("--requests", type=int,
                    help="burst: 500 (all at once); soak: 2000")
    ap.add_argument("--concurrency", type=int, default=16, help="soak")
    ap.add_argument("--distinct", type=int, default=100,
                    help="soak: distinct requests the plan draws from")
    ap.add_argument("--baseline", type=int, default=200,
                    help="soak: requests after which memory is first read")
    ap.add_argument("--max-prompt", type=int, default=120)
    ap.add_argument("--min-tokens", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--start-timeout", type=float, default=1800)
    ap.add_argument("--json", help="write the result here")
    args = ap.parse_args()
    if args.requests is None:
        args.requests = 500 if args.kind == "burst" else 2000
    if args.max_model_len is None:
        args.max_model_len = 1024 if args.kind == "features" else 256
    if args.kind == "features":
        args.batching = "cb"
    return args


def run(args, url: str, model: str, rss, processes) -> tuple[dict, bool]:
    tokens = (args.min_tokens, args.max_tokens)
    if args.kind == "burst":
        reqs = random_requests(args.requests, args.seed, args.max_prompt,
                               tokens)
        result = asyncio.run(burst(url, model, reqs))
    elif args.kind == "soak":
        pool = random_requests(args.distinct, args.seed, args.max_prompt,
                               tokens)
        plan = soak_plan(args.requests, pool, args.seed)
        result = asyncio.run(soak(url, model, pool, plan, args.concurrency,
                                  args.baseline, rss))
    else:
        long_prompt = tuple(int(x) for x in args.long_prompt.split(":"))
        pool = feature_requests(args.distinct, args.seed, args.max_prompt,
                                tokens, long_prompt)
        plan = soak_plan(args.requests, pool, args.seed)
        args.baseline = args.requests // 4
        result = asyncio.run(soak(url, model, pool, plan, args.concurrency,
                                  args.baseline, rss, processes,
                                  rss_within=0.03))
    return dict(asdict(result), ok=result.ok), result.ok


def print_table(kind: str, f: dict) -> None:
    s = f["settings"]
    print(f"\n{kind}: {s['requests']} requests, {s['batching']} batching, "
          f"{s['backend']}, {Path(s['model']).name}")
    if kind == "burst":
        print("| requests | completed | HTTP errors | lost | duplicated or "
              "crossed | server finished | wall |")
        print("|---|---|---|---|---|---|---|")
        print(f"| {f['requests']} | {f['completed']} | {f['http_errors']} "
              f"| {f['lost']} | {f['duplicated_or_crossed']} "
              f"| {f['server_finished']} | {f['wall_s']:.0f} s |")
    else:
        end = f["end_metrics"]
        mib = (lambda v: "n/a" if v is None else f"{v:.0f} MiB")  # noqa
        ratio = "n/a" if f["rss_ratio"] is None else f"{f['rss_ratio']:.3f}"
        print(f"| requests | completed | dropped | errors | mismatched "
              f"| RSS after {s['baseline']} | RSS at end | ratio "
              "| running / waiting / KV in use at end | wall |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        print(f"| {f['requests']} | {f['completed']} | {f['dropped']} "
              f"| {f['errors']} | {f['mismatched']} "
              f"| {mib(f['rss_baseline_mib'])} | {mib(f['rss_end_mib'])} "
              f"| {ratio} | {end['vllm:num_requests_running']:g} / "
              f"{end['vllm:num_requests_waiting']:g} / "
              f"{end['vllm:gpu_cache_usage_perc']:g} | {f['wall_s']:.0f} s |")
        if f["processes_end"] is not None:
            print(f"server processes after {s['baseline']}: "
                  f"{f['processes_baseline']}, at end: {f['processes_end']}")
    for sample in f["error_samples"]:
        print("  ", sample)


def main() -> int:
    args = parse_args()
    if args.url:
        model = httpx.get(args.url + "/v1/models",
                          timeout=30).json()["data"][0]["id"]
        figures, ok = run(args, args.url.rstrip("/"), model, None, None)
    else:
        env, cli = server_env(args)
        print(f"starting vllm serve {args.model} ({args.batching}, "
              f"{args.backend}): " + " ".join(f"{k}={v}"
                                             for k, v in env.items())
              + " " + " ".join(cli), flush=True)
        server = Server(Path(args.model), env, cli)
        try:
            server.wait_healthy(timeout=args.start_timeout)
            figures, ok = run(args, server.url, args.model,
                              lambda: tree_rss(server.proc.pid),
                              lambda: tree_size(server.proc.pid))
        finally:
            server.stop()
    figures["settings"] = {k: v for k, v in vars(args).items()}
    print_table(args.kind, figures)
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")
    print("PASSED" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
