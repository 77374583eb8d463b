"""Load benchmark of the Spyre OpenAI server; continuous vs static batching.

Sends N streaming completion requests with a fixed concurrency and reports
requests/s, output tokens/s, time to first token (TTFT) and inter-token
latency (ITL), p50 and p99, plus the error count.  Every request must
stream exactly its ``max_tokens`` (EOS ignored); any error makes the exit
code non-zero.

Workloads (``--workload``):

* ``default``: short prompts of random words, ``--max-tokens`` (16) each;
* ``mixed``: prompt lengths drawn uniformly from ``--min-prompt`` to
  ``--max-prompt`` tokens (16..512) and ``max_tokens`` from
  ``--min-tokens`` to ``--max-tokens`` (8..128), from a fixed ``--seed``.
  Prompts are sent as token ids, windows of benchmarks/data/text.txt
  tokenized by the model's tokenizer, so their lengths are exact.

Without ``--url`` the script starts ``vllm serve`` on the model itself, on
loopback, once per mode of ``--modes``, runs the same requests and stops
it:

* ``static``: static batching over the warm-up shapes ``--static-shapes``
  (``prompt_len:new_tokens:batch_size,...``; default workload:
  ``64:<max-tokens>:<batch-size>``, mixed: ``256:128:8,512:128:4``, which
  an operator would configure for it: every request fits the 512 shape,
  about half of them also the 256 one, with twice the batch);
* ``cb``: continuous batching (``VLLM_SPYRE_USE_CB=1``) with
  ``--max-num-seqs`` (16) and ``--max-model-len`` (default: the longest
  prompt plus the most tokens, in whole 64-token blocks: 640).  Several
  ``--max-num-seqs`` values (``16,8``) start one CB server each, named
  ``cb-16``, ``cb-8``, every one compared with static.

The default workload runs ``static`` with ``eager``, as before; the mixed
workload runs ``cb,static`` with ``inductor`` and prints one side-by-side
table with each server's warm-up seconds (from its log), a CB/static ratio
line and JSON.

    python benchmarks/serving_load.py [--url http://127.0.0.1:8000]
        [--requests 200] [--concurrency 16] [--max-tokens 16] [--json FILE]
    python benchmarks/serving_load.py --workload mixed [--modes cb,static]
        [--serve-args '--dtype bfloat16 --enable-prefix-caching']
        [--backend inductor] [--static-shapes 256:128:8,512:128:4]
        [--max-num-seqs 16[,8]] [--max-model-len 640] [--json FILE]
        [--plot PATH] [--start-timeout 3600]

The comparison's plot is written only with ``--plot``; the one in
docs/continuous-batching.md:

    python benchmarks/serving_load.py --workload mixed --max-num-seqs 10,11
        --plot docs/images/continuous-batching.png
"""
from __future__ import annotations

import argparse
import asyncio
import json
import re
import shlex
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Optional

import httpx

from spyre_support.bench import (RESULTS, machine_info, mixed_requests,
                                 parse_ints, text_ids, write_json)
from spyre_support.envs import TORCH_OPS, backend_env, cb_max_model_len
from spyre_support.load import (LoadResult, completion_body, default_bodies,
                                send)
from spyre_support.paths import SMOLLM2_DIR

from _serving_report import plot, print_comparison, ratios

MIXED_SHAPES = "256:128:8,512:128:4"
MODES = ("cb", "static")


def print_table(r: LoadResult) -> None:
    print(f"\nrequests {r.requests}  concurrency {r.concurrency}  "
          f"errors {r.errors}  wall {r.wall_s:.1f} s")
    print("| requests/s | tokens/s | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 |")
    print("|---|---|---|---|---|---|")
    print(f"| {r.req_per_s:.2f} | {r.tok_per_s:.1f} | {r.ttft_p50_ms:.0f} ms "
          f"| {r.ttft_p99_ms:.0f} ms | {r.itl_p50_ms:.0f} ms "
          f"| {r.itl_p99_ms:.0f} ms |")


# ---- self-started servers, one per mode ------------------------------------

def parse_shapes(text: str) -> list[tuple[int, int, int]]:
    """'256:128:8,512:128:4' -> [(256, 128, 8), (512, 128, 4)]."""
    shapes = []
    for item in text.split(","):
        parts = item.strip().split(":")
        if len(parts) != 3:
            raise ValueError(f"shape {item!r} is not prompt_len:new_tokens:"
                             "batch_size")
        shapes.append(tuple(int(p) for p in parts))
    return shapes


def server_setup(mode: str, args,
                 max_num_seqs: Optional[int] = None) -> tuple[dict, tuple,
                                                               str]:
    """Environment, extra ``vllm serve`` arguments and a description of
    the server of ``mode`` (``cb``: with ``max_num_seqs``, by default the
    first of ``--max-num-seqs``)."""
    extra = tuple(shlex.split(args.serve_args))
    if mode == "cb":
        seqs = max_num_seqs or args.max_num_seqs[0]
        env = {**backend_env(args.backend), "VLLM_SPYRE_USE_CB": "1"}
        cli = ("--max-num-seqs", str(seqs),
               "--max-model-len", str(args.max_model_len)) + extra
        return env, cli, (f"continuous batching, --max-num-seqs {seqs} "
                          f"--max-model-len {args.max_model_len} "
                          f"{args.serve_args}").strip()
    shapes = parse_shapes(args.static_shapes)
    env = {**backend_env(args.backend), "VLLM_SPYRE_USE_CB": "0"}
    for i, name in enumerate(("PROMPT_LENS", "NEW_TOKENS", "BATCH_SIZES")):
        env[f"VLLM_SPYRE_WARMUP_{name}"] = ",".join(str(s[i]) for s in shapes)
    return env, extra, ("static batching, warm-up shapes " + ", ".join(
        f"(prompt_len={p}, new_tokens={g}, batch_size={b})"
        for p, g, b in shapes) + f" {args.serve_args}").strip()


def misfits(mode: str, args, sizes: list[tuple[int, int]]) -> list:
    """The (prompt length, max_tokens) the server of ``mode`` could not
    hold; None where the prompt length is not known (word prompts)."""
    if mode == "cb":
        return [s for s in sizes if s[0] is not None and
                s[0] + s[1] > args.max_model_len]
    shapes = parse_shapes(args.static_shapes)
    return [s for s in sizes if not any(
        (s[0] is None or s[0] <= p) and s[1] <= g for p, g, _ in shapes)]


def startup_from_log(log: str) -> dict[str, float]:
    """Seconds of the model load and of the whole warm-up, as the Spyre
    model runners log them."""
    found = {}
    for key, pattern in (
            ("load_s", r"Spyre model load took ([\d.]+) s"),
            ("warmup_s", r"Spyre warm-up of \d+ shape\(s\) took ([\d.]+) s"),
            ("warmup_s",
             r"Spyre continuous-batching warm-up took ([\d.]+) s")):
        match = re.search(pattern, log)
        if match:
            found[key] = float(match.group(1))
    return found


def runs(args) -> list[tuple[str, str, Optional[int]]]:
    """(name, mode, max_num_seqs) of every server to start: one per mode,
    and under ``cb`` one per ``--max-num-seqs`` value (named ``cb-N`` when
    there are several)."""
    out = []
    for mode in args.modes:
        if mode != "cb":
            out.append((mode, mode, None))
        elif len(args.max_num_seqs) == 1:
            out.append(("cb", "cb", args.max_num_seqs[0]))
        else:
            out.extend((f"cb-{n}", "cb", n) for n in args.max_num_seqs)
    return out


def run_mode(mode: str, args, make_bodies, max_num_seqs: Optional[int] = None,
             name: Optional[str] = None) -> dict:
    """Starts the server of ``mode``, sends the workload, stops it."""
    from spyre_support.server import Server, metric
    env, cli, what = server_setup(mode, args, max_num_seqs)
    mode = name or mode
    print(f"[{mode}] starting vllm serve {args.model}: {what}, backend "
          f"{args.backend} (warm-up takes a while)", flush=True)
    print(f"[{mode}] environment: " + " ".join(
        f"{k}={v}" for k, v in env.items()), flush=True)
    start = time.perf_counter()
    server = Server(Path(args.model), env, cli)
    try:
        server.wait_healthy(timeout=args.start_timeout)
        startup = dict(healthy_after_s=time.perf_counter() - start,
                       **startup_from_log(server.log()))
        print(f"[{mode}] healthy after {startup['healthy_after_s']:.1f} s "
              f"(warm-up {startup.get('warmup_s', float('nan')):.1f} s); "
              f"sending {args.requests} requests", flush=True)
        result = asyncio.run(send(server.url, make_bodies(served(server.url)),
                                  args.concurrency))
        preemptions = int(metric(server, "vllm:num_preemptions_total"))
    finally:
        server.stop()
    print(f"[{mode}] {result.tok_per_s:.1f} output tokens/s, "
          f"{result.errors} errors, {preemptions} preemptions", flush=True)
    return dict(server=dict(description=what, env=env, args=list(cli),
                            backend=args.backend, log=str(server.log_path)),
                startup=startup, preemptions=preemptions,
                result=asdict(result))


def served(url: str) -> str:
    """The id of the model a server serves."""
    return httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]


# ---- command line ----------------------------------------------------------

def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    """The command line ``argv`` (default: the script's), with the
    defaults that depend on the workload filled in."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", help="a running server; default: start one "
                    "per mode")
    ap.add_argument("--model", default=str(SMOLLM2_DIR))
    ap.add_argument("--workload", choices=["default", "mixed"],
                    default="default")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, help="max_tokens of every "
                    "request (default workload, 16); the largest drawn "
                    "(mixed, 128)")
    ap.add_argument("--min-tokens", type=int, default=8,
                    help="the smallest max_tokens drawn (mixed)")
    ap.add_argument("--min-prompt", type=int, default=16,
                    help="the shortest prompt drawn, in tokens (mixed)")
    ap.add_argument("--max-prompt", type=int, default=512,
                    help="the longest prompt drawn, in tokens (mixed)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--serve-args", default="",
                    help="more `vllm serve` arguments for every server "
                    "started, e.g. '--dtype bfloat16 --enable-prefix-caching'")
    ap.add_argument("--modes", help="servers to start, of cb,static "
                    "(default workload: static; mixed: cb,static)")
    ap.add_argument("--backend", choices=["eager", "inductor", TORCH_OPS],
                    help="VLLM_SPYRE_DYNAMO_BACKEND of the servers "
                    "(default workload: eager; mixed: inductor)")
    ap.add_argument("--batch-size", type=int, default=8,
                    help="batch size of the static shape (default workload)")
    ap.add_argument("--static-shapes", help="warm-up shapes of the static "
                    "server, prompt_len:new_tokens:batch_size,... (default "
                    f"workload: 64:<max-tokens>:<batch-size>; mixed: "
                    f"{MIXED_SHAPES})")
    ap.add_argument("--max-num-seqs", type=parse_ints, default=[16],
                    help="--max-num-seqs of the CB server; several "
                    "(16,8) start one CB server each")
    ap.add_argument("--max-model-len", type=int, help="--max-model-len of "
                    "the CB server (default: the longest request, in whole "
                    "64-token blocks)")
    ap.add_argument("--start-timeout", type=float, default=3600,
                    help="seconds a server may take to become healthy")
    ap.add_argument("--json", help="write the result here (mixed default: "
                    "benchmarks/results/serving-cb-vs-static.json)")
    ap.add_argument("--plot", help="write the comparison's plot here "
                    "(default: no plot)")
    args = ap.parse_args(argv)
    mixed = args.workload == "mixed"
    if args.max_tokens is None:
        args.max_tokens = 128 if mixed else 16
    if args.modes is None:
        args.modes = "cb,static" if mixed else "static"
    if args.backend is None:
        args.backend = "inductor" if mixed else "eager"
    if args.static_shapes is None:
        args.static_shapes = (MIXED_SHAPES if mixed else
                              f"64:{args.max_tokens}:{args.batch_size}")
    if args.max_model_len is None:
        # The default workload's prompts: 40 words of at most 2 tokens.
        args.max_model_len = cb_max_model_len(
            args.max_prompt if mixed else 80, args.max_tokens)
    if mixed and args.json is None:
        args.json = str(RESULTS / "serving-cb-vs-static.json")
    modes = args.modes.split(",")
    if not modes or any(m not in MODES for m in modes):
        ap.error(f"--modes {args.modes!r}: choose from {','.join(MODES)}")
    args.modes = modes
    return args


def main() -> int:
    args = parse_args()
    if args.workload == "mixed":
        reqs = mixed_requests(text_ids(args.model), args.requests,
                              (args.min_prompt, args.max_prompt),
                              (args.min_tokens, args.max_tokens), args.seed)

        def make_bodies(model: str) -> list[dict]:
            return [completion_body(model, ids, n) for ids, n in reqs]
        sizes = [(len(ids), n) for ids, n in reqs]
    else:
        def make_bodies(model: str) -> list[dict]:
            return default_bodies(model, args.requests, args.max_tokens,
                                  seed=args.seed)
        sizes = [(None, args.max_tokens)]

    if args.url is not None:
        result = asyncio.run(send(args.url, make_bodies(served(args.url)),
                                  args.concurrency))
        return report_one(result, args.json)
    for mode in args.modes:
        bad = misfits(mode, args, sizes)
        if bad:
            print(f"the {mode} server could not hold {len(bad)} request(s), "
                  f"e.g. (prompt length, max_tokens) {bad[0]}: raise "
                  "--max-model-len or --static-shapes")
            return 2
    if args.workload == "default" and args.modes == ["static"]:
        return report_one(run_mode("static", args, make_bodies)["result"],
                          args.json)
    return compare(args, reqs if args.workload == "mixed" else None,
                   make_bodies)


def report_one(result, json_path: Optional[str]) -> int:
    """One run against one server: the original one-line table."""
    if not isinstance(result, LoadResult):
        result = LoadResult(**result)
    if json_path:
        Path(json_path).write_text(json.dumps(asdict(result), indent=2))
    print_table(result)
    if result.errors:
        print("errors:", *result.error_samples, sep="\n  ")
        return 1
    return 0


def describe(args, reqs: Optional[list]) -> dict:
    """The workload, for the report and the JSON."""
    if reqs is None:
        return dict(model=args.model, kind="default", requests=args.requests,
                    concurrency=args.concurrency, seed=args.seed,
                    output_tokens=args.requests * args.max_tokens,
                    text=f"prompts of 3-40 words, max_tokens "
                    f"{args.max_tokens}")
    lens = [len(ids) for ids, _ in reqs]
    outs = [n for _, n in reqs]
    return dict(
        model=args.model, kind="mixed", requests=args.requests,
        concurrency=args.concurrency, seed=args.seed,
        prompt_range=[args.min_prompt, args.max_prompt],
        max_tokens_range=[args.min_tokens, args.max_tokens],
        prompt_tokens=sum(lens), output_tokens=sum(outs),
        sizes=[[p, n] for p, n in zip(lens, outs)],
        text=f"prompts {min(lens)}-{max(lens)} tokens (drawn from "
        f"{args.min_prompt}-{args.max_prompt}), max_tokens "
        f"{min(outs)}-{max(outs)} (drawn from {args.min_tokens}-"
        f"{args.max_tokens}), seed {args.seed}")


def compare(args, reqs: Optional[list], make_bodies) -> int:
    """Every mode of ``args.modes`` on the same requests; a server that
    fails to start is reported and the other modes still run."""
    workload = describe(args, reqs)
    modes, failed = {}, {}
    for name, mode, seqs in runs(args):
        try:
            modes[name] = run_mode(mode, args, make_bodies, seqs, name)
        except (RuntimeError, OSError, httpx.HTTPError) as exc:
            failed[name] = f"{type(exc).__name__}: {exc}"
            print(f"[{name}] FAILED: {failed[name][-3000:]}", flush=True)
    if args.json:
        write_json(args.json, dict(
            args=vars(args), machine=machine_info(), workload=workload,
            modes=modes, failed=failed, ratios=ratios(modes)))
    if args.plot and modes:
        plot(args.plot, modes, workload)
    if modes:
        print_comparison(modes, workload)
    errors = sum(m["result"]["errors"] for m in modes.values())
    for mode, m in modes.items():
        if m["result"]["errors"]:
            print(f"{mode} errors:", *m["result"]["error_samples"],
                  sep="\n  ")
    if failed or errors:
        print(f"FAILED: {errors} request error(s)" + (
            f"; server(s) that did not start: {', '.join(failed)}"
            if failed else ""))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
