"""Speculative decoding with an MLP speculator (``--speculative-config
'{"model": <speculator folder>, ...}'``) under continuous batching,
offline.

A random speculator built for the tiny Llama proposes from the served
model's hidden states; the emitted tokens stay plain greedy decoding's
(transformers') on FMS's and vLLM's model code, both CPU backends,
the default model and over 2 ranks, with nothing compiled after
warm-up.  The hidden state the runner keeps for a sequence is
transformers' last hidden state at the position whose logits gave the
sequence's last token.  Speculators Spyre
cannot run are refused at start-up, naming the value."""
from __future__ import annotations

import pytest
import torch

from spyre_support.engines import spyre_llm
from spyre_support.envs import cb_env
from spyre_support.reference import HFReference
from spyre_support.speculative import (MAX_MODEL_LEN, MAX_NUM_SEQS,
                                       assert_plain_greedy, assert_refused,
                                       run_workload)
from spyre_support.tiny_models import build_tiny_mlp_speculator

K = 4


def spec(speculator, k: int = K) -> dict:
    """Every step with proposals verifies (not the step times measured
    at warm-up, which a busy machine skews)."""
    return {"model": str(speculator), "num_speculative_tokens": k,
            "disable_by_batch_size": 64}


@pytest.fixture(scope="module")
def speculator(tiny_llama, tmp_path_factory):
    return build_tiny_mlp_speculator(tmp_path_factory.mktemp("mlp"),
                                     tiny_llama)


@pytest.mark.parametrize("backend, impl", [("eager", "auto"),
                                           ("inductor", "auto"),
                                           ("eager", "vllm")])
def test_greedy_ids_equal_plain_decoding(backend, impl, tiny_llama,
                                         speculator, hf_tiny):
    run = run_workload(tiny_llama, backend, spec(speculator),
                       model_impl=impl)
    assert run["worker"] == "SpyreSpecWorker"
    assert run["drafts"] > 0 and run["compiled"] == 0
    assert run["proposed"] <= K * run["drafts"]
    assert run["free_blocks"] == run["total_blocks"]
    assert_plain_greedy(run, hf_tiny)


@pytest.mark.parametrize("impl", ["auto", "vllm"])
def test_the_kept_state_is_transformers_hidden_state(impl, tiny_llama,
                                                     speculator, hf_tiny):
    """After each step, the state kept for a running request is the last
    hidden state (after the final norm) at its second-to-last position."""
    from vllm import SamplingParams, TokensPrompt
    prompt = list(range(5, 40))
    with spyre_llm(tiny_llama, cb_env("eager"), max_num_seqs=MAX_NUM_SEQS,
                   max_model_len=MAX_MODEL_LEN,
                   speculative_config=spec(speculator),
                   model_impl=impl) as llm:
        engine = llm.llm_engine
        proposer = engine.model_executor.driver_worker.worker \
            .model_runner.proposer
        engine.add_request("r", TokensPrompt(prompt_token_ids=prompt),
                           SamplingParams(temperature=0, max_tokens=30,
                                          ignore_eos=True))
        kept = []
        for _ in range(6):
            out = engine.step()
            ids = prompt + list(out[0].outputs[0].token_ids)
            kept.append((ids, proposer.hidden["r"].clone()))
    with torch.no_grad():
        for ids, hidden in kept:
            want = hf_tiny.model.model(
                torch.tensor([ids[:-1]])).last_hidden_state[0, -1]
            torch.testing.assert_close(hidden, want, atol=1e-3, rtol=1e-3)


def test_with_preemption_prefix_caching_and_chunked_prefill(
        tiny_llama, speculator, hf_tiny):
    """A preempted sequence is recomputed and its kept state with it."""
    plan = [(10, 10, 0, 60), (11, 10, 0, 50), (12, 10, 0, 40),
            (10, 10, 0, 30)]
    run = run_workload(tiny_llama, "eager", spec(speculator), plan,
                       num_gpu_blocks_override=8,
                       enable_prefix_caching=True,
                       enable_chunked_prefill=True,
                       max_num_batched_tokens=64)
    assert run["preemptions"] > 0
    assert run["drafts"] > 0 and run["compiled"] == 0
    assert run["free_blocks"] == run["total_blocks"]
    assert_plain_greedy(run, hf_tiny)


def test_the_default_model_with_a_tiny_speculator(smollm2, tmp_path):
    speculator = build_tiny_mlp_speculator(tmp_path / "mlp", smollm2)
    plan = [(5, 6, 3, 24), (8, 4, 0, 16), (3, 1, 0, 20)]
    run = run_workload(smollm2, "eager", spec(speculator), plan)
    assert run["drafts"] > 0 and run["compiled"] == 0
    assert_plain_greedy(run, HFReference(smollm2))


def test_tensor_parallel_2_equals_transformers(tiny_llama, speculator,
                                               hf_tiny):
    """The driver's unsharded speculator proposes from the whole hidden
    states both ranks compute; both ranks run the verify step."""
    plan = [(5, 6, 3, 40), (8, 8, 0, 33), (3, 1, 0, 30)]
    run = run_workload(tiny_llama, "eager", spec(speculator), plan,
                       tensor_parallel_size=2)
    assert run["drafts"] > 0 and run["compiled"] == 0
    assert_plain_greedy(run, hf_tiny)


@pytest.mark.parametrize("case, message", [
    ("hidden size", "reads hidden states of 576 values"),
    ("stages", "proposes at most 4 tokens"),
])
def test_speculators_spyre_cannot_run_are_refused(case, message, tiny_llama,
                                                  speculator, smollm2,
                                                  tmp_path):
    config, extra = {
        "hidden size": (spec(build_tiny_mlp_speculator(tmp_path / "other",
                                                       smollm2)), {}),
        "stages": (spec(speculator, 8), {}),
    }[case]
    assert_refused(tiny_llama, config, message, **extra)
