"""Starts a Spyre ``vllm.LLM`` in this process (a fresh one, so nothing
compiled by an earlier engine is in memory), generates greedily and prints
one line ``RESULT {json}``: the ids, the dynamo compilations counted in
this process during start-up and while serving, and every rank's graph
cache statistics.

    python tests/engine_start.py MODEL ENGINE_ARGS_JSON PROMPTS_JSON MAX_TOKENS

The Spyre settings come from the environment.
"""
from __future__ import annotations

import json
import os
import sys


def compile_count() -> int:
    from torch._dynamo.utils import counters
    return sum(counters["frames"].values()) + sum(
        counters["stats"].values())


def main() -> None:
    os.environ.setdefault("VLLM_USE_V1", "0")
    model, engine_args, prompts, max_tokens = sys.argv[1:5]
    from vllm import LLM, SamplingParams, TokensPrompt
    llm = LLM(model=model, **json.loads(engine_args))
    at_start = compile_count()
    outputs = llm.generate(
        [TokensPrompt(prompt_token_ids=p) for p in json.loads(prompts)],
        SamplingParams(temperature=0.0, max_tokens=int(max_tokens),
                       ignore_eos=True),
        use_tqdm=False)
    print("RESULT " + json.dumps(dict(
        ids=[list(o.outputs[0].token_ids) for o in outputs],
        startup_compiles=at_start,
        serving_compiles=compile_count() - at_start,
        graphs=llm.collective_rpc("get_graph_cache_stats"))), flush=True)


if __name__ == "__main__":
    main()
