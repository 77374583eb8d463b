"""Sampling on Spyre goes through vLLM's own logits processor and sampler:
seeds, temperature / top-p / top-k, n > 1, stop strings, stop token ids,
max_tokens.  Tiny random Llama, eager backend, one batch shape of 4."""
from __future__ import annotations

import pytest

from conftest import spyre_env, spyre_llm

pytestmark = pytest.mark.e2e

MAX_NEW = 10
PROMPT = [11, 42, 99, 7, 250, 31, 8]


@pytest.fixture(scope="module")
def llm(tiny_llama):
    with spyre_llm(tiny_llama, spyre_env("eager", [64], [MAX_NEW],
                                         [4])) as llm:
        yield llm


def run(llm, params, prompts=None):
    from vllm import TokensPrompt
    prompts = prompts or [PROMPT]
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                        params, use_tqdm=False)
    return outs


def sp(**kwargs):
    from vllm import SamplingParams
    kwargs.setdefault("max_tokens", MAX_NEW)
    kwargs.setdefault("ignore_eos", True)
    return SamplingParams(**kwargs)


@pytest.fixture(scope="module")
def greedy(llm):
    return run(llm, sp(temperature=0.0))[0].outputs[0]


def test_seeded_sampling_repeats(llm):
    params = sp(temperature=1.0, top_p=0.95, top_k=50, seed=7)
    first = run(llm, params)[0].outputs[0].token_ids
    second = run(llm, params)[0].outputs[0].token_ids
    assert first == second
    assert len(first) == MAX_NEW


def test_different_seeds_differ(llm):
    seen = {
        tuple(run(llm, sp(temperature=1.5, seed=s))[0].outputs[0].token_ids)
        for s in range(4)
    }
    assert len(seen) > 1


def test_top_k_one_is_greedy(llm, greedy):
    out = run(llm, sp(temperature=1.0, top_k=1, seed=3))[0].outputs[0]
    assert out.token_ids == greedy.token_ids


def test_seeded_rows_independent_of_batch_mates(llm):
    """A seeded request samples the same tokens alone and in a full batch."""
    params = sp(temperature=1.0, seed=11)
    alone = run(llm, params)[0].outputs[0].token_ids
    prompts = [PROMPT, [5] * 20, [9] * 3, [17] * 40]
    batched = run(llm, [params, sp(temperature=0.0),
                        sp(temperature=0.8, seed=1), sp(temperature=0.0)],
                  prompts)
    assert batched[0].outputs[0].token_ids == alone


def test_n_returns_n_completions(llm, greedy):
    # top_k=1 samples the argmax: every completion is the greedy one.
    outs = run(llm, sp(n=3, temperature=1.0, top_k=1))
    assert len(outs) == 1 and len(outs[0].outputs) == 3
    for completion in outs[0].outputs:
        assert completion.token_ids == greedy.token_ids
    # n up to the largest batch size (4) samples side by side; above it
    # the request is refused up front.
    sampled = run(llm, sp(n=4, temperature=1.5, seed=5))[0].outputs
    assert len(sampled) == 4
    assert all(len(c.token_ids) == MAX_NEW for c in sampled)
    assert len({tuple(c.token_ids) for c in sampled}) > 1
    with pytest.raises(ValueError, match="n=6 parallel samples"):
        run(llm, sp(n=6, temperature=1.5, seed=5))


def test_stop_token_ids(llm, greedy):
    stop_at = greedy.token_ids[3]
    first = greedy.token_ids.index(stop_at)
    out = run(llm, sp(temperature=0.0, stop_token_ids=[stop_at]))[0]
    got = out.outputs[0]
    assert got.token_ids == greedy.token_ids[:first + 1]
    assert got.finish_reason == "stop"
    assert got.stop_reason == stop_at


def test_stop_string(llm, greedy):
    text = greedy.text
    stop = text[len(text) // 2:len(text) // 2 + 2]
    assert stop.strip(), f"greedy text too short: {text!r}"
    out = run(llm, sp(temperature=0.0, stop=[stop]))[0].outputs[0]
    assert out.text == text[:text.index(stop)]
    assert out.finish_reason == "stop"
    assert out.stop_reason == stop


def test_max_tokens_shorter_than_shape(llm, greedy):
    out = run(llm, sp(temperature=0.0, max_tokens=3))[0].outputs[0]
    assert out.token_ids == greedy.token_ids[:3]
    assert out.finish_reason == "length"


def test_logprobs_top_k(llm, greedy):
    out = run(llm, sp(temperature=0.0, logprobs=5))[0].outputs[0]
    assert out.token_ids == greedy.token_ids
    for tok, step in zip(out.token_ids, out.logprobs):
        assert tok in step and len(step) >= 5
        best = max(step.values(), key=lambda lp: lp.logprob)
        assert step[tok].logprob == best.logprob
        assert step[tok].rank == 1


def test_prompt_logprobs_rejected(llm):
    with pytest.raises(ValueError, match="prompt_logprobs"):
        run(llm, sp(temperature=0.0, prompt_logprobs=1))
    # Still serving.
    assert run(llm, sp(temperature=0.0, max_tokens=2))[0].outputs[0].token_ids
