"""The soak with every feature on at once (``benchmarks/serving_soak.py
features`` at full size, ``tests/e2e/test_feature_soak_server.py`` in
short form): a server on continuous batching with prefix caching and
chunked prefill and structured output, and a pool of requests that asks
for each feature in turn.

The pool's kinds, in turn: plain greedy streams; structured output (a
choice, a regex or a JSON schema of enums, compact); prompt
log-probabilities (answered whole: vLLM streams none); ``n`` = 2 seeded
samples; long prompts, prefilled in several chunks.  Half the prompts
start with one shared prefix, so the prefix cache serves requests that
differ.  The soak's plan (``soak.soak_plan``) drops about a third of the
streams at a random token, structured ones included.
"""
from __future__ import annotations

import json
import random

from spyre_support.soak import HIGH_ID, LOW_ID, Request

KINDS = ("plain", "structured", "prompt_logprobs", "n", "long")

#: Structured-output fields the structured requests take in turn.
GUIDED = (
    {"guided_choice": ["red", "green", "blue"]},
    {"guided_regex": "[a-c]{3}-[0-9]{2}"},
    {"guided_json": {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]},
                       "ok": {"type": "boolean"}},
        "required": ["color", "ok"], "additionalProperties": False}},
)


def server_args(max_model_len: int, chunk: int,
                max_num_seqs: int) -> tuple[str, ...]:
    """``vllm serve`` arguments of the soak's server (with
    ``VLLM_SPYRE_USE_CB=1``): prompts prefilled ``chunk`` tokens at a
    time, compact JSON."""
    return ("--max-model-len", str(max_model_len),
            "--max-num-seqs", str(max_num_seqs),
            "--enable-prefix-caching", "--enable-chunked-prefill",
            "--max-num-batched-tokens", str(chunk),
            "--guided-decoding-backend", "xgrammar",
            "--guided-decoding-disable-any-whitespace")


def feature_requests(n: int, seed: int, max_prompt: int,
                     tokens: tuple[int, int], long_prompt: tuple[int, int],
                     prefix_len: int = 64) -> list[Request]:
    """``n`` requests, their kinds in turn (``KINDS``)."""
    rng = random.Random(seed)

    def ids(length: int) -> tuple[int, ...]:
        return tuple(rng.randint(LOW_ID, HIGH_ID) for _ in range(length))

    shared = ids(prefix_len)
    pool = []
    for i in range(n):
        kind = KINDS[i % len(KINDS)]
        prompt = ids(rng.randint(*long_prompt) if kind == "long" else
                     rng.randint(1, max_prompt))
        if rng.random() < 0.5:
            prompt = shared + prompt
        fields: dict = {}
        max_tokens = rng.randint(*tokens)
        if kind == "structured":
            # Stops when the grammar ends; room enough to get there.
            fields = dict(GUIDED[(i // len(KINDS)) % len(GUIDED)],
                          ignore_eos=False)
            max_tokens = 48
        elif kind == "prompt_logprobs":
            fields = {"prompt_logprobs": 1}
        elif kind == "n":
            # vLLM refuses n > 1 at temperature 0; seeded samples are
            # the same alone and in any batch.
            fields = {"n": 2, "temperature": 1.0, "seed": i}
        pool.append(Request(prompt, max_tokens,
                            json.dumps(fields) if fields else ""))
    return pool
