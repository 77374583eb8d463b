"""The first batches after start-up: is the first as fast as the next?

Starts our engine (one warm-up shape, ``P``/``G``/``B``) in a fresh
process and, as soon as it is ready, times ``--batches`` ``generate``
calls back to back, each on new prompts (greedy, EOS ignored).  It does
this twice, each time in a new process:

* ``default``: none of vLLM's usage-statistics switches set, as a new user
  would start it (the Spyre platform then turns the statistics off);
* ``usage stats on``: ``VLLM_NO_USAGE_STATS=0``, vLLM's own default
  elsewhere, whose collection thread starts when the engine is ready.

Reports each call's seconds and tokens/s, and the first call over the
median of the others; any compilation during a timed call fails the run.

    python benchmarks/first_batch.py [--model DIR] [--backend inductor]
        [--prompt-len 64] [--new-tokens 64] [--batch-size 8] [--batches 3]
        [--json PATH]
"""
from __future__ import annotations

import os
import statistics
import sys
import time

from spyre_support.bench import (Child, add_json_option, add_shape_options,
                                 benchmark_parser, build_prompts, machine_info,
                                 table, text_ids, write_json)
from spyre_support.engines import compile_count
from spyre_support.envs import warmup_env

USAGE_SWITCHES = ("VLLM_NO_USAGE_STATS", "VLLM_DO_NOT_TRACK", "DO_NOT_TRACK")
SETTINGS = {"default": {}, "usage stats on": {"VLLM_NO_USAGE_STATS": "0"}}


class Engine:
    """Our engine in a child process; ``generate(i)`` runs batch i."""

    def __init__(self, model: str, args: dict, usage: dict) -> None:
        for name in USAGE_SWITCHES:
            os.environ.pop(name, None)
        os.environ.update(usage)
        from vllm import LLM, SamplingParams
        self.args = args
        start = time.perf_counter()
        self.llm = LLM(model=model)
        self.ready_s = time.perf_counter() - start
        self.params = SamplingParams(temperature=0,
                                     max_tokens=args["new_tokens"],
                                     ignore_eos=True)
        ids = text_ids(model)
        b = args["batch_size"]
        self.prompts = build_prompts(ids, b * args["batches"],
                                     args["prompt_len"])

    def info(self) -> dict:
        return dict(ready_s=self.ready_s)

    def generate(self, i: int) -> dict:
        from vllm import TokensPrompt
        b = self.args["batch_size"]
        batch = [TokensPrompt(prompt_token_ids=p)
                 for p in self.prompts[i * b:(i + 1) * b]]
        before = compile_count()
        start = time.perf_counter()
        self.llm.generate(batch, self.params, use_tqdm=False)
        return dict(seconds=time.perf_counter() - start,
                    compilations=compile_count() - before)


def main() -> int:
    ap = benchmark_parser(__doc__, backend=True)
    add_shape_options(ap)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--batches", type=int, default=3)
    add_json_option(ap, "first-batch.json")
    args = ap.parse_args()
    if args.batches < 2:
        ap.error("--batches must be at least 2: the first against the rest")
    work = dict(prompt_len=args.prompt_len, new_tokens=args.new_tokens,
                batch_size=args.batch_size, batches=args.batches)
    env = warmup_env(args.backend, [(args.prompt_len, args.new_tokens,
                                    args.batch_size)])
    tokens = args.batch_size * args.new_tokens
    results, rows, compiled = {}, [], 0
    for name, usage in SETTINGS.items():
        print(f"[{name}] starting our engine ({args.backend}) ...",
              flush=True)
        child = Child(name, Engine, args.model, work, usage, env=env)
        try:
            child.result()
            calls = [child.call("generate", i) for i in range(args.batches)]
        finally:
            child.close()
        seconds = [c["seconds"] for c in calls]
        compiled += sum(c["compilations"] for c in calls)
        ratio = seconds[0] / statistics.median(seconds[1:])
        results[name] = dict(seconds=seconds, first_over_rest=ratio,
                             compilations=[c["compilations"] for c in calls])
        print(f"[{name}] " + ", ".join(f"{s:.2f} s" for s in seconds),
              flush=True)
        rows.append([name] + [f"{s:.2f} ({tokens / s:.0f})"
                              for s in seconds] + [f"{ratio:.2f}x"])
    write_json(args.json, dict(args=vars(args), machine=machine_info(),
                               results=results))
    print(f"\nmodel {os.path.basename(args.model)}, {args.backend}, batch "
          f"{args.batch_size}, P={args.prompt_len}, G={args.new_tokens}: "
          "seconds per generate (output tokens/s), calls back to back from "
          "the moment the engine is ready")
    print(table(["setting"] + [f"call {i + 1}" for i in range(args.batches)]
                + ["first / rest"], rows))
    if compiled:
        print(f"FAILED: {compiled} compilation(s) during the timed calls")
    return 1 if compiled else 0


if __name__ == "__main__":
    sys.exit(main())
