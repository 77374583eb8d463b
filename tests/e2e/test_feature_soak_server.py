"""The soak with every feature on at once, in short form (the full run of
2,000 requests is ``benchmarks/serving_soak.py features``): the OpenAI
server on continuous batching with prefix caching, chunked prefill and
structured output; plain, structured, prompt-log-probability, ``n`` = 2
and long-prompt requests, half sharing a prefix, at concurrency 16, a
third of the streams dropped by their client.  Every answer equals the
same request run alone (greedy; each dropped stream a prefix of it), no
request fails, every block is free at the end, the server has as many
processes as before (no grammar compiler left behind) and its memory
stays within 5 %."""
from __future__ import annotations

import asyncio
from collections import Counter

from spyre_support.envs import cb_env
from spyre_support.feature_soak import KINDS, feature_requests, server_args
from spyre_support.server import Server
from spyre_support.soak import soak, soak_plan, tree_rss, tree_size

POOL, REQUESTS = 20, 80


def test_every_feature_at_once(tiny_llama_2k):
    pool = feature_requests(POOL, seed=7, max_prompt=60, tokens=(2, 16),
                            long_prompt=(300, 700))
    plan = soak_plan(REQUESTS, pool, seed=7)
    with Server(tiny_llama_2k, cb_env("eager"),
                args=server_args(1024, 128, 8)) as srv:
        result = asyncio.run(soak(
            srv.url, srv.model, pool, plan, concurrency=16,
            baseline_after=REQUESTS // 4,
            rss=lambda: tree_rss(srv.proc.pid),
            processes=lambda: tree_size(srv.proc.pid)))
    assert not result.problems, result.problems
    assert result.completed + result.dropped == REQUESTS
    assert result.dropped >= REQUESTS // 5
    # Each kind was asked for.
    kinds = Counter(KINDS[i % len(KINDS)] for i, _ in plan)
    assert set(kinds) == set(KINDS), kinds
