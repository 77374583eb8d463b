"""Starts a Spyre ``vllm.LLM`` in this process (a fresh one, so nothing
compiled by an earlier engine is in memory), generates greedily and prints
one line ``RESULT {json}``: the ids, the dynamo compilations counted in
this process during start-up and while serving, and every rank's graph
cache statistics.

    python -m spyre_support.engine_start MODEL ENGINE_ARGS_JSON PROMPTS_JSON \\
        MAX_TOKENS

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


def greedy_ids(llm, prompts: str, max_tokens: str) -> list[list[int]]:
    """Greedy ids of every prompt (a JSON list of token-id lists), EOS
    ignored."""
    from vllm import SamplingParams, TokensPrompt
    outputs = llm.generate(
        [TokensPrompt(prompt_token_ids=p) for p in json.loads(prompts)],
        SamplingParams(temperature=0.0, max_tokens=int(max_tokens),
                       ignore_eos=True),
        use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def main() -> None:
    os.environ.setdefault("VLLM_USE_V1", "0")
    model, engine_args, prompts, max_tokens = sys.argv[1:5]
    from vllm import LLM
    llm = LLM(model=model, **json.loads(engine_args))
    at_start = compile_count()
    ids = greedy_ids(llm, prompts, max_tokens)
    print("RESULT " + json.dumps(dict(
        ids=ids,
        startup_compiles=at_start,
        serving_compiles=compile_count() - at_start,
        graphs=llm.collective_rpc("get_graph_cache_stats"))), flush=True)


if __name__ == "__main__":
    main()
