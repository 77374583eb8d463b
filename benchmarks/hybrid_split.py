"""Where a hybrid model's decode step goes: its Mamba-2 layers, its attention layers, the rest.

Our engine (static batching, ``eager``: the layers must run one by one
to be timed; ``inductor`` fuses them into one graph) serves a batch of
prompts; every decoder layer is timed on each decode step (one position
per row), and the step's time is split by the kind of layer, the rest
being the embedding, the final norm and the step's own overhead (the decoder body is timed, from the embedding to the final
norm; the LM head is not).  The split says which of the two kinds of
layer a faster kernel would pay off in.

    python benchmarks/hybrid_split.py --model DIR [--batch-sizes 1,8]
        [--prompt-len 64] [--new-tokens 32]

A tiny random Bamba to run it on is built with
``.venv/bin/python -c "from pathlib import Path; from
spyre_support.tiny_models import build_tiny_family;
build_tiny_family('bamba', Path('/tmp/bamba'))"``.
"""
from __future__ import annotations

import os
import time
from collections import defaultdict
from unittest import mock

from spyre_support.bench import (add_json_option, benchmark_parser,
                                 build_prompts, machine_info, parse_ints,
                                 table, text_ids, write_json)
from spyre_support.envs import warmup_env


def _timed_layers(model, is_ssm: list[bool], times: dict) -> list:
    """Hooks timing each decoder layer of ``model`` on decode steps (one
    position per row), summed per kind into ``times``."""
    handles, started = [], {}

    def before(index):
        def hook(module, args, kwargs):
            x = kwargs.get("x", args[0] if args else None)
            if x is not None and x.shape[1] == 1:
                started[index] = time.perf_counter()
        return hook

    def after(index):
        def hook(module, args, kwargs, output):
            if index in started:
                kind = "mamba" if is_ssm[index] else "attention"
                times[kind] += time.perf_counter() - started.pop(index)
        return hook

    for i, layer in enumerate(model.base_model.layers):
        handles.append(layer.register_forward_pre_hook(before(i),
                                                       with_kwargs=True))
        handles.append(layer.register_forward_hook(after(i),
                                                   with_kwargs=True))
    return handles


def measure(model_dir: str, batch: int, prompt_len: int,
            new_tokens: int) -> dict:
    from vllm import LLM, SamplingParams, TokensPrompt
    env = warmup_env("eager", [(prompt_len, new_tokens, batch)])
    with mock.patch.dict(os.environ, env):
        llm = LLM(model=model_dir)
    runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
    spyre_model = runner.model
    if not spyre_model.is_ssm:
        raise SystemExit(f"{model_dir} has no Mamba-2 layers: not a hybrid "
                         "model")
    prompts = build_prompts(text_ids(model_dir), batch, prompt_len)
    params = SamplingParams(temperature=0, max_tokens=new_tokens,
                            ignore_eos=True)
    requests = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    llm.generate(requests, params, use_tqdm=False)  # warm
    times: dict = defaultdict(float)
    steps = [0.0, 0]

    def step_before(module, args, kwargs):
        ids = args[0] if args else kwargs.get("x")
        if ids is not None and ids.shape[1] == 1:
            steps.append(time.perf_counter())

    def step_after(module, args, kwargs, output):
        if len(steps) > 2:
            steps[0] += time.perf_counter() - steps.pop()
            steps[1] += 1

    fms = spyre_model.code.fms_model
    handles = _timed_layers(fms, spyre_model.is_ssm, times)
    body = fms.base_model
    handles.append(body.register_forward_pre_hook(step_before,
                                                  with_kwargs=True))
    handles.append(body.register_forward_hook(step_after, with_kwargs=True))
    # The timed run goes through the model's Python code, layer by layer
    # (dynamo would trace the timing hooks into its graph).
    import torch
    with torch.compiler.set_stance("force_eager"):
        llm.generate(requests, params, use_tqdm=False)
    for h in handles:
        h.remove()
    n = max(steps[1], 1)
    total, mamba, attn = steps[0] / n, times["mamba"] / n, \
        times["attention"] / n
    return dict(batch=batch, decode_steps=steps[1],
                step_ms=total * 1e3, mamba_ms=mamba * 1e3,
                attention_ms=attn * 1e3,
                other_ms=(total - mamba - attn) * 1e3,
                mamba_layers=sum(spyre_model.is_ssm),
                attention_layers=len(spyre_model.is_ssm) -
                sum(spyre_model.is_ssm))


def main() -> int:
    ap = benchmark_parser(__doc__)
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=32)
    add_json_option(ap, "hybrid_split.json")
    args = ap.parse_args()
    rows = [measure(args.model, b, args.prompt_len, args.new_tokens)
            for b in parse_ints(args.batch_sizes)]
    first = rows[0]
    print(f"\nmodel {os.path.basename(args.model.rstrip('/'))}: "
          f"{first['mamba_layers']} Mamba-2 and {first['attention_layers']}"
          f" attention layers, P={args.prompt_len}, eager, decode steps "
          "timed layer by layer (ms per step, share of the step)")
    print(table(
        ["B", "step ms", "Mamba-2 ms", "attention ms", "other ms"],
        [[r["batch"], f"{r['step_ms']:.2f}",
          f"{r['mamba_ms']:.2f} ({r['mamba_ms'] / r['step_ms']:.0%})",
          f"{r['attention_ms']:.2f} "
          f"({r['attention_ms'] / r['step_ms']:.0%})",
          f"{r['other_ms']:.2f} ({r['other_ms'] / r['step_ms']:.0%})"]
         for r in rows]))
    write_json(args.json, dict(machine=machine_info(), model=args.model,
                               prompt_len=args.prompt_len,
                               new_tokens=args.new_tokens, rows=rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
