"""Cost of prompt log-probabilities: a request with ``prompt_logprobs``
against the same request without, on one long prompt.

Starts our engine in a fresh process (static batching, one warm-up shape
of the prompt length rounded up to 64, ``--new-tokens`` (default 1, as
lm-evaluation-harness asks), batch 1; or continuous batching with
``--cb``), then times ``--repetitions`` requests of each kind, alternating,
on a prompt of ``--prompt-len`` tokens cut from benchmarks/data/text.txt:
``plain`` (no prompt log-probabilities) and ``prompt_logprobs=1``.  Peak
memory is the largest resident set a sampling thread sees (every 2 ms)
during a request, minus the resident set just before it, taken from the
first request of each kind (plain first): later requests reuse what the
allocator kept, so only a first request shows what a kind adds.  Any
compilation during a request fails the run.

    python benchmarks/prompt_logprobs.py [--model DIR] [--backend eager]
        [--prompt-len 1024] [--new-tokens 1] [--repetitions 3] [--cb]
        [--json PATH]
"""
from __future__ import annotations

import os
import statistics
import sys
import threading
import time

from spyre_support.bench import (Child, add_json_option, benchmark_parser,
                                 build_prompts, machine_info, table, text_ids,
                                 write_json)
from spyre_support.engines import compile_count
from spyre_support.envs import cb_env, cb_max_model_len, warmup_env

KINDS = ("plain", "prompt_logprobs=1")


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class Engine:
    """Our engine in a child process; ``run(kind)`` times one request."""

    def __init__(self, model: str, args: dict) -> None:
        from vllm import LLM
        extra = {}
        if args["cb"]:
            extra = dict(max_num_seqs=1, max_model_len=cb_max_model_len(
                args["prompt_len"], args["new_tokens"]))
        self.llm = LLM(model=model, **extra)
        self.args = args
        self.prompt = build_prompts(text_ids(model), 1,
                                    args["prompt_len"])[0]

    def info(self) -> dict:
        return {}

    def run(self, kind: str) -> dict:
        from vllm import SamplingParams, TokensPrompt
        params = SamplingParams(
            temperature=0, max_tokens=self.args["new_tokens"],
            ignore_eos=True,
            prompt_logprobs=None if kind == "plain" else 1)
        base = rss_bytes()
        peak = [base]
        done = threading.Event()

        def sample() -> None:
            while not done.wait(0.002):
                peak[0] = max(peak[0], rss_bytes())

        watcher = threading.Thread(target=sample, daemon=True)
        before = compile_count()
        watcher.start()
        start = time.perf_counter()
        out = self.llm.generate([TokensPrompt(prompt_token_ids=self.prompt)],
                                params, use_tqdm=False)[0]
        seconds = time.perf_counter() - start
        done.set()
        watcher.join()
        got = out.prompt_logprobs
        return dict(seconds=seconds, peak_mib=(peak[0] - base) / 2**20,
                    compilations=compile_count() - before,
                    values=0 if got is None else len(got) - 1)


def main() -> int:
    ap = benchmark_parser(__doc__)
    ap.add_argument("--backend", default="eager",
                    choices=["eager", "inductor"])
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--new-tokens", type=int, default=1)
    ap.add_argument("--repetitions", type=int, default=3)
    ap.add_argument("--cb", action="store_true",
                    help="continuous batching instead of static batching")
    add_json_option(ap, "prompt-logprobs.json")
    args = ap.parse_args()
    work = dict(prompt_len=args.prompt_len, new_tokens=args.new_tokens,
                cb=args.cb)
    env = (cb_env(args.backend) if args.cb else warmup_env(
        args.backend, [(args.prompt_len, args.new_tokens, 1)]))
    mode = "continuous batching" if args.cb else "static batching"
    print(f"starting our engine ({args.backend}, {mode}) ...", flush=True)
    child = Child("engine", Engine, args.model, work, env=env)
    try:
        child.result()
        firsts = {k: child.call("run", k) for k in KINDS}
        runs: dict[str, list[dict]] = {k: [] for k in KINDS}
        for _ in range(args.repetitions):
            for kind in KINDS:
                runs[kind].append(child.call("run", kind))
    finally:
        child.close()
    results, rows = {}, []
    for kind in KINDS:
        seconds = statistics.median(r["seconds"] for r in runs[kind])
        peak = firsts[kind]["peak_mib"]
        results[kind] = dict(seconds=seconds, peak_mib=peak, runs=runs[kind],
                             first=firsts[kind])
        rows.append([kind, f"{seconds * 1000:.0f}", f"{peak:.0f}",
                     str(runs[kind][-1]["values"])])
    plain, asked = (results[k] for k in KINDS)
    compiled = sum(r["compilations"] for k in KINDS
                   for r in runs[k] + [firsts[k]])
    write_json(args.json, dict(args=vars(args), machine=machine_info(),
                               results=results))
    print(f"\nmodel {os.path.basename(args.model)}, {args.backend}, {mode}, "
          f"prompt {args.prompt_len} tokens, {args.new_tokens} new, median "
          f"of {args.repetitions}")
    print(table(["request", "ms", "first request's peak MiB over its start",
                 "prompt values"],
                rows))
    print(f"prompt_logprobs / plain: time "
          f"{asked['seconds'] / plain['seconds']:.2f}x, peak memory "
          f"+{asked['peak_mib'] - plain['peak_mib']:.0f} MiB")
    if compiled:
        print(f"FAILED: {compiled} compilation(s) during the timed requests")
    return 1 if compiled else 0


if __name__ == "__main__":
    sys.exit(main())
