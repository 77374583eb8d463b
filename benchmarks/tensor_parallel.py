"""Offline decode throughput at several tensor-parallel sizes.

Runs the same fixed workload (B prompts of P tokens, G new tokens, greedy,
EOS ignored) through ``vllm.LLM`` on the Spyre backend once per TP size,
each in its own process, and prints tokens/s per size and the ratio to
TP=1.  The generated ids of every size are compared, so the table never
compares different work.

SmolLM2-135M (the default model) has 9 query and 3 key/value heads, so it
splits over 1 or 3 ranks, not 2: TP=2 is reported as not possible for it.

    python benchmarks/tensor_parallel.py [--model DIR] [--tp 1,2,3]
        [--batch 4] [--prompt-len 64] [--new-tokens 32] [--backend eager]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def child(args) -> None:
    """One TP size: start-up, then the timed generation."""
    from vllm import LLM, SamplingParams, TokensPrompt
    words = (REPO / "README.md").read_text().split()
    llm = LLM(model=args.model, tensor_parallel_size=args.one_tp)
    tok = llm.get_tokenizer()
    ids = tok(" ".join(words))["input_ids"]
    prompts = [TokensPrompt(prompt_token_ids=ids[i * 7:i * 7 +
                                                 args.prompt_len])
               for i in range(args.batch)]
    params = SamplingParams(temperature=0, max_tokens=args.new_tokens,
                            ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)  # one untimed batch
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    print("RESULT " + json.dumps(dict(
        tp=args.one_tp, seconds=seconds, tokens=tokens,
        ids=[list(o.outputs[0].token_ids) for o in outs])), flush=True)


def heads(model: str) -> tuple[int, int]:
    cfg = json.loads((Path(model) / "config.json").read_text())
    return cfg["num_attention_heads"], cfg.get("num_key_value_heads",
                                               cfg["num_attention_heads"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(REPO / "models" /
                                           "SmolLM2-135M-Instruct"))
    ap.add_argument("--tp", default="1,2,3")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--backend", default="eager")
    ap.add_argument("--one-tp", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    if args.one_tp:
        return child(args)

    env = dict(os.environ,
               VLLM_SPYRE_DYNAMO_BACKEND=args.backend,
               VLLM_SPYRE_WARMUP_PROMPT_LENS=str(
                   -(-args.prompt_len // 64) * 64),
               VLLM_SPYRE_WARMUP_NEW_TOKENS=str(args.new_tokens),
               VLLM_SPYRE_WARMUP_BATCH_SIZES=str(args.batch))
    q, kv = heads(args.model)
    results = {}
    for tp in [int(x) for x in args.tp.split(",")]:
        if q % tp or kv % tp:
            print(f"TP={tp}: not possible, the model's {q} query / {kv} "
                  f"key-value heads do not split over {tp} ranks",
                  flush=True)
            continue
        print(f"TP={tp}: running ...", flush=True)
        proc = subprocess.run(
            [sys.executable, __file__, "--one-tp", str(tp), "--model",
             args.model, "--batch", str(args.batch), "--prompt-len",
             str(args.prompt_len), "--new-tokens", str(args.new_tokens)],
            env=env, capture_output=True, text=True, timeout=1800)
        line = [ln for ln in proc.stdout.splitlines()
                if ln.startswith("RESULT ")]
        if proc.returncode or not line:
            print(proc.stderr[-3000:])
            raise SystemExit(f"TP={tp} failed")
        results[tp] = json.loads(line[0][7:])
    base = results.get(1)
    print(f"\nmodel {Path(args.model).name}, backend {args.backend}, "
          f"batch {args.batch}, prompt {args.prompt_len}, "
          f"new tokens {args.new_tokens}, cores "
          f"{len(os.sched_getaffinity(0))}")
    print("| TP | tokens/s | vs TP=1 | same ids as TP=1 |")
    print("|---|---|---|---|")
    for tp, r in results.items():
        rate = r["tokens"] / r["seconds"]
        ratio = rate / (base["tokens"] / base["seconds"]) if base else 0
        same = base is not None and r["ids"] == base["ids"]
        print(f"| {tp} | {rate:.1f} | {ratio:.2f}x | {same} |")
    if args.json:
        Path(args.json).write_text(json.dumps(
            {tp: {k: v for k, v in r.items() if k != "ids"}
             for tp, r in results.items()}, indent=2))


if __name__ == "__main__":
    main()
