"""lm-evaluation-harness against a real server on loopback: its
``local-completions`` model (log-likelihoods through ``echo: true`` with
``logprobs: 1``; greedy answers through completions with ``stop``) on the
local tasks of ``benchmarks/lm_eval_tasks`` gives, request by request, the
results of lm-eval's own ``hf`` model on the same checkpoint, under static
and continuous batching."""
from __future__ import annotations

import pytest

# benchmarks/ (pytest's pythonpath)
from lm_eval_parity import (TASKS, compare, evaluate, hf_args, mode_server,
                            server_args)
from spyre_support.server import Server

pytestmark = pytest.mark.smollm2

#: Requests of the tasks: 20 questions of 4 answers, 4 paragraphs scored
#: whole, 12 greedy answers.
LOGLIKELIHOODS = 20 * 4 + 4
GENERATIONS = 12


@pytest.fixture(scope="module")
def hf_run(smollm2):
    return evaluate("hf", hf_args(str(smollm2)), TASKS)


@pytest.mark.parametrize("mode", ["static", "cb"])
def test_server_results_equal_hf_request_by_request(smollm2, hf_run, mode):
    env, cli = mode_server(mode, "eager")
    with Server(smollm2, env, cli) as srv:
        run = evaluate("local-completions", server_args(srv.url,
                                                        str(smollm2)),
                       TASKS, concurrency=4)
    c = compare(run, hf_run)
    assert (c["loglikelihoods"], c["generations"]) == (LOGLIKELIHOODS,
                                                       GENERATIONS)
    assert c["max_abs_diff"] <= 1e-3
    assert c["greedy_flags_differing"] == []
    assert c["differing"] == []
    assert run["metrics"].keys() == hf_run["metrics"].keys() == set(TASKS)
    for task, metrics in hf_run["metrics"].items():
        assert run["metrics"][task] == pytest.approx(metrics, rel=1e-4)
