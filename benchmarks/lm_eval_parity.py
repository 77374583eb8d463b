"""lm-evaluation-harness against the Spyre server, side by side with lm-eval's own ``hf`` model.

Runs the local tasks of ``benchmarks/lm_eval_tasks`` (multiple choice,
greedy generation, rolling perplexity; nothing is fetched from a hub)
twice on the same checkpoint:

* ``local-completions``: lm-eval's OpenAI-completions client against a
  ``vllm serve`` of the model: log-likelihoods come from ``echo: true``
  with ``logprobs: 1`` and ``max_tokens: 1``, answers from greedy
  completions with ``stop``;
* ``hf``: lm-eval's transformers model in float32 on the CPU.

It prints each task's metrics for both, the largest difference between
the two log-likelihoods of any request, how many greedy answers are
identical, and each run's wall time.  Without ``--url`` it starts one
server per ``--modes`` entry (static batching with one warm-up shape,
continuous batching), on ``--backend`` (default eager).

    .venv/bin/python benchmarks/lm_eval_parity.py                 # SmolLM2, static and CB
    .venv/bin/python benchmarks/lm_eval_parity.py --modes cb --backend inductor
    .venv/bin/python benchmarks/lm_eval_parity.py --url http://127.0.0.1:8000

Needs the development requirements (``requirements-dev.txt``: lm-eval).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any, Optional

from spyre_support.bench import DEFAULT_MODEL, table, write_json
from spyre_support.envs import cb_env, warmup_env

TASKS_DIR = Path(__file__).resolve().parent / "lm_eval_tasks"
TASKS = ("spyre_facts", "spyre_arith", "spyre_text")
#: The static server's one warm-up shape: the longest request of the tasks
#: is 49 tokens (SmolLM2's tokenizer, with lm-eval's leading token on a
#: rolling one), answers are at most 8 tokens, and lm-eval keeps 4 requests
#: in flight, which one batch of 4 takes together.
STATIC_SHAPE = (64, 8, 4)
#: The continuous-batching server's limits.
CB_ARGS = ("--max-num-seqs", "4", "--max-model-len", "512")
MODES = ("static", "cb")


def evaluate(model_type: str, model_args: dict[str, Any],
             tasks=TASKS, concurrency: int = 1) -> dict:
    """Runs lm-eval's ``simple_evaluate`` on ``tasks`` with lm-eval model
    ``model_type``; returns each task's metrics, its per-request samples
    and the wall time."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import lm_eval
    from lm_eval.tasks import TaskManager
    if model_type == "local-completions":
        model_args = dict(model_args, num_concurrent=concurrency)
    start = time.perf_counter()
    out = lm_eval.simple_evaluate(
        model=model_type,
        model_args=",".join(f"{k}={v}" for k, v in model_args.items()),
        tasks=list(tasks), task_manager=TaskManager(
            include_path=str(TASKS_DIR)),
        log_samples=True)
    wall = time.perf_counter() - start
    metrics = {
        task: {k.split(",")[0]: v for k, v in res.items()
               if "," in k and "stderr" not in k}
        for task, res in out["results"].items()}
    return dict(metrics=metrics, samples=out["samples"], wall_s=wall)


def server_args(url: str, model: str) -> dict[str, Any]:
    """``local-completions`` arguments for the server at ``url`` serving
    ``model`` (the checkpoint directory, also the tokenizer)."""
    return dict(model=model, base_url=f"{url}/v1/completions",
                tokenizer_backend="huggingface", tokenizer=model)


def hf_args(model: str) -> dict[str, Any]:
    """``hf`` arguments: ``model`` in float32 on the CPU."""
    return dict(pretrained=model, dtype="float32", device="cpu")


def responses(samples: dict) -> dict[tuple, Any]:
    """Every request's raw response, keyed by (task, document, request):
    (log-likelihood, whether the continuation is greedy) for a
    multiple-choice answer, a log-likelihood for a rolling one, the text
    for a generation."""
    out = {}
    for task, docs in samples.items():
        for doc in docs:
            for i, resp in enumerate(doc["resps"]):
                value = resp[0]
                if isinstance(value, (list, tuple)):
                    value = (float(value[0]), bool(value[1]))
                elif not isinstance(value, str):
                    value = float(value)
                out[(task, doc["doc_id"], i)] = value
    return out


def compare(a: dict, b: dict) -> dict[str, Any]:
    """Request by request, the samples of two runs: how many
    log-likelihoods and generations, the largest absolute difference of
    a log-likelihood, the requests whose greedy flag or generated text
    differ."""
    ra, rb = responses(a["samples"]), responses(b["samples"])
    if ra.keys() != rb.keys():
        raise ValueError(f"the runs answered different requests: "
                         f"{sorted(ra.keys() ^ rb.keys())[:5]}")

    def loglik(v):
        return v[0] if isinstance(v, tuple) else v
    logliks = [k for k, v in ra.items() if not isinstance(v, str)]
    gens = [k for k, v in ra.items() if isinstance(v, str)]
    return dict(
        loglikelihoods=len(logliks), generations=len(gens),
        max_abs_diff=max((abs(loglik(ra[k]) - loglik(rb[k]))
                          for k in logliks), default=0.0),
        greedy_flags_differing=[k for k in logliks
                                if isinstance(ra[k], tuple)
                                and ra[k][1] != rb[k][1]],
        differing=[(k, ra[k], rb[k]) for k in gens if ra[k] != rb[k]])


def print_report(runs: dict[str, dict], reference: str = "hf") -> None:
    names = list(runs)
    tasks = sorted({t for r in runs.values() for t in r["metrics"]})
    rows = []
    for task in tasks:
        for metric in runs[reference]["metrics"][task]:
            rows.append([f"{task} {metric}"] + [
                f"{runs[n]['metrics'][task][metric]:.4g}" for n in names])
    rows.append(["wall s"] + [f"{runs[n]['wall_s']:.1f}" for n in names])
    print(table(["metric"] + names, rows))
    for name in names:
        if name == reference:
            continue
        c = compare(runs[name], runs[reference])
        print(f"{name} against {reference}: {c['loglikelihoods']} "
              f"log-likelihoods, largest difference {c['max_abs_diff']:.2e}; "
              f"{len(c['greedy_flags_differing'])} greedy flags differ; "
              f"{c['generations'] - len(c['differing'])}/{c['generations']} "
              "greedy answers identical")


def mode_server(mode: str, backend: str) -> tuple[dict, tuple]:
    """Environment and ``vllm serve`` arguments of the server of
    ``mode``."""
    if mode == "static":
        p, n, b = STATIC_SHAPE
        return warmup_env(backend, [(p, n, b)]), ()
    return cb_env(backend), CB_ARGS


def run_mode(mode: str, args) -> dict:
    from spyre_support.server import Server
    env, cli = mode_server(mode, args.backend)
    print(f"[{mode}] starting vllm serve {args.model}, backend "
          f"{args.backend}", flush=True)
    with Server(Path(args.model), env, cli) as server:
        return evaluate("local-completions",
                        server_args(server.url, args.model), args.tasks,
                        args.concurrency)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--url", help="a running server of --model; default: "
                    "start one per mode")
    ap.add_argument("--modes", default="static,cb",
                    help="servers to start, of static,cb")
    ap.add_argument("--backend", default="eager",
                    choices=["eager", "inductor"])
    ap.add_argument("--tasks", default=",".join(TASKS))
    ap.add_argument("--concurrency", type=int, default=4,
                    help="requests in flight (lm-eval's num_concurrent)")
    ap.add_argument("--json", help="write metrics and comparison here")
    args = ap.parse_args(argv)
    args.tasks = args.tasks.split(",")
    args.modes = [m for m in args.modes.split(",") if m]
    if any(m not in MODES for m in args.modes):
        ap.error(f"--modes {args.modes}: choose from {','.join(MODES)}")
    return args


def main() -> int:
    args = parse_args()
    runs: dict[str, dict] = {}
    if args.url:
        runs["server"] = evaluate("local-completions",
                                  server_args(args.url, args.model),
                                  args.tasks, args.concurrency)
    else:
        for mode in args.modes:
            runs[mode] = run_mode(mode, args)
    print(f"[hf] lm-eval's hf model on {args.model}, float32", flush=True)
    runs["hf"] = evaluate("hf", hf_args(args.model), args.tasks)
    print(f"\nmodel {Path(args.model).name}, tasks {','.join(args.tasks)}, "
          f"backend {args.backend}, concurrency {args.concurrency}")
    print_report(runs)
    if args.json:
        write_json(args.json, {
            name: dict(metrics=r["metrics"], wall_s=r["wall_s"],
                       **({} if name == "hf" else {
                           k: v for k, v in compare(r, runs["hf"]).items()
                           if not isinstance(v, list)}))
            for name, r in runs.items()})
    worst = [compare(r, runs["hf"]) for n, r in runs.items() if n != "hf"]
    return 0 if all(c["max_abs_diff"] <= 1e-3 and not c["differing"]
                    and not c["greedy_flags_differing"]
                    for c in worst) else 1


if __name__ == "__main__":
    sys.exit(main())
