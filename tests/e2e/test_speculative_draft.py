"""Speculative decoding with a draft model (``--speculative-config
'{"model": <folder>, ...}'``) under continuous batching, offline.

The tiny Llama drafting for itself proposes what it then samples: every
proposal is kept, which holds only while the draft's own block pool
(addressed by the served model's block tables, caught up after each
verify step, refilled after a preemption) holds the same keys and values
as the served model's.  A random draft model keeps the emitted tokens
those of plain decoding however few proposals hold, on the tiny Llama
with prefix caching and chunked prefill on, and on the default model.
Over two ranks the driver's process holds the draft whole.  Draft models
Spyre cannot run are refused at start-up, naming the value."""
from __future__ import annotations

import pytest

from spyre_support.reference import HFReference
from spyre_support.speculative import (assert_plain_greedy, assert_refused,
                                       assert_speculated, run_workload)
from spyre_support.tiny_models import build_tiny_draft

K = 4
PREEMPT_PLAN = [(10, 10, 0, 60), (11, 10, 0, 50), (12, 10, 0, 40),
                (5, 1, 0, 30)]


def spec(draft) -> dict:
    """Every step with proposals verifies (not the step times measured
    at warm-up, which a busy machine skews)."""
    return {"model": str(draft), "num_speculative_tokens": K,
            "disable_by_batch_size": 64}


@pytest.fixture(scope="module")
def random_draft(tiny_llama, tmp_path_factory):
    return build_tiny_draft(tmp_path_factory.mktemp("draft"), tiny_llama)


@pytest.fixture(scope="module", params=["eager", "inductor"])
def self_drafted(request, tiny_llama):
    return run_workload(tiny_llama, request.param, spec(tiny_llama))


def test_greedy_ids_equal_plain_decoding(self_drafted, hf_tiny):
    assert_plain_greedy(self_drafted, hf_tiny)


def test_a_model_drafting_for_itself_has_every_proposal_kept(self_drafted):
    assert_speculated(self_drafted, K)
    assert self_drafted["accepted"] == self_drafted["proposed"]
    assert "warmup verify" in self_drafted["timings"]


def test_after_preemption_the_draft_pool_is_refilled(tiny_llama, hf_tiny):
    run = run_workload(tiny_llama, "eager", spec(tiny_llama), PREEMPT_PLAN,
                       num_gpu_blocks_override=8)
    assert run["preemptions"] > 0
    assert_speculated(run, K)
    assert run["accepted"] == run["proposed"]
    assert_plain_greedy(run, hf_tiny)


def test_a_random_draft_changes_no_token(tiny_llama, hf_tiny, random_draft):
    """With prefix caching and chunked prefill on; its proposals mostly
    fail, and the sequences pause their proposing."""
    from spyre_support.speculative import PLAN
    run = run_workload(tiny_llama, "eager", spec(random_draft),
                       PLAN + PLAN[:3], enable_prefix_caching=True,
                       enable_chunked_prefill=True,
                       max_num_batched_tokens=64)
    assert run["drafts"] > 0 and run["compiled"] == 0
    assert run["accepted"] < run["proposed"]
    assert run["free_blocks"] == run["total_blocks"]
    assert_plain_greedy(run, hf_tiny)


def test_the_default_model_with_a_tiny_draft(smollm2, tmp_path):
    draft = build_tiny_draft(tmp_path / "draft", smollm2)
    plan = [(5, 6, 3, 24), (8, 4, 0, 16), (3, 1, 0, 20)]
    run = run_workload(smollm2, "eager", spec(draft), plan)
    assert run["drafts"] > 0 and run["compiled"] == 0
    assert_plain_greedy(run, HFReference(smollm2))


@pytest.mark.parametrize("backend, impl", [("eager", "auto"),
                                           ("inductor", "vllm")])
def test_tensor_parallel_2_keeps_every_proposal(backend, impl, tiny_llama,
                                                hf_tiny):
    """The driver worker's process holds the draft whole (FMS's model code
    and vLLM's, which ``--model-impl`` chooses for both models) and
    proposes for the sequences both ranks serve: drafting for itself,
    every proposal holds."""
    plan = [(5, 6, 3, 40), (8, 8, 0, 33), (3, 1, 0, 30)]
    run = run_workload(tiny_llama, backend, spec(tiny_llama), plan,
                       tensor_parallel_size=2, model_impl=impl)
    assert_speculated(run, K)
    assert run["accepted"] == run["proposed"]
    assert_plain_greedy(run, hf_tiny)


@pytest.mark.parametrize("case, message", [
    ("vocabulary", "has a vocabulary of 49152 tokens, the served model 384"),
    ("positions", "holds 1024 positions, fewer than max_model_len=2048"),
])
def test_draft_models_spyre_cannot_run_are_refused(
        case, message, tiny_llama, tiny_llama_2k, smollm2):
    target, draft, extra = {
        "vocabulary": (tiny_llama, smollm2, {}),
        "positions": (tiny_llama_2k, tiny_llama, {"max_model_len": 2048}),
    }[case]
    assert_refused(target, spec(draft), message, **extra)
