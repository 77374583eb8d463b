"""Speculative-decoding workloads the tests share: a batch of prompts
whose spans repeat (``bench.repeated_spans``), run greedily under
continuous batching with a ``--speculative-config``, and what the engine
counted while running them; checks against transformers' greedy ids."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from spyre_support.bench import repeated_spans
from spyre_support.engines import compile_count, spyre_llm
from spyre_support.envs import cb_env

MAX_NUM_SEQS = 3
MAX_MODEL_LEN = 256
# (span length, repeats, tail length, max_tokens): prompts whose spans
# repeat (the lookup finds them) and some that do not, block boundaries
# (64) crossed while speculating.
PLAN = [(5, 6, 3, 40), (8, 8, 0, 33), (3, 1, 0, 30), (12, 4, 17, 60),
        (1, 1, 0, 12), (20, 3, 4, 1), (7, 9, 1, 70)]


def greedy(llm, reqs):
    """Each request's greedy ids and their log-probabilities."""
    from vllm import SamplingParams, TokensPrompt
    outs = llm.generate(
        [TokensPrompt(prompt_token_ids=p) for p, _ in reqs],
        [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True,
                        logprobs=0) for _, m in reqs],
        use_tqdm=False)
    return [(list(c.token_ids),
             [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)])
            for c in (o.outputs[0] for o in outs)]


def run_workload(model: Path, backend: str, spec: dict, plan=PLAN,
                 **kwargs) -> dict:
    """The plan's requests, greedy, on a fresh engine; their ids and
    log-probabilities, the graphs compiled while serving, the counters,
    preemptions and the block pool after."""
    with spyre_llm(model, cb_env(backend), max_num_seqs=MAX_NUM_SEQS,
                   max_model_len=MAX_MODEL_LEN, speculative_config=spec,
                   **kwargs) as llm:
        engine = llm.llm_engine
        reqs = repeated_spans(engine.model_config.get_vocab_size(), plan)
        before = compile_count()
        answers = greedy(llm, reqs)
        counters = engine.output_processor.counters
        manager = engine.scheduler[0].block_manager
        return dict(
            reqs=reqs, ids=[ids for ids, _ in answers],
            logprobs=[lps for _, lps in answers],
            compiled=compile_count() - before,
            drafts=counters.drafts, proposed=counters.draft_tokens,
            accepted=counters.accepted,
            preemptions=engine.scheduler[0].num_cumulative_preemption,
            free_blocks=manager.get_num_free_gpu_blocks(),
            total_blocks=manager.num_total_gpu_blocks,
            worker=type(engine.model_executor.driver_worker.worker).__name__,
            timings=llm.collective_rpc("get_startup_timings")[0])


def assert_plain_greedy(run: dict, hf) -> None:
    """Every request's ids, and each emitted token's log-probability,
    equal transformers' greedy decoding."""
    import pytest
    for (prompt, max_tokens), got, lps in zip(run["reqs"], run["ids"],
                                              run["logprobs"]):
        ids, ref = hf.greedy(prompt, max_tokens)
        assert got == ids, (f"prompt of {len(prompt)} tokens, "
                            f"max_tokens={max_tokens}")
        assert lps == pytest.approx(ref, abs=1e-3)


def assert_speculated(run: dict, k: int = 4) -> None:
    """Verify steps ran, kept some proposals, compiled nothing, and every
    block went back to the pool."""
    assert run["worker"] == "SpyreSpecWorker"
    assert run["compiled"] == 0
    assert run["drafts"] > 0 and run["accepted"] > 0
    assert run["accepted"] <= run["proposed"] <= k * run["drafts"]
    assert run["free_blocks"] == run["total_blocks"]


def assert_refused(model: Path, spec: dict, message: str,
                   env: Optional[dict] = None, **engine_args) -> None:
    """Building the engine config of ``model`` with ``spec`` (under
    ``env``, continuous batching on ``eager`` by default) fails with
    ``message``."""
    import os
    from unittest import mock

    import pytest
    from vllm import EngineArgs
    engine_args = {"max_model_len": MAX_MODEL_LEN, **engine_args}
    with mock.patch.dict(os.environ, cb_env("eager") if env is None
                         else env):
        with pytest.raises((ValueError, NotImplementedError), match=message):
            EngineArgs(model=str(model), speculative_config=spec,
                       **engine_args).create_engine_config()
