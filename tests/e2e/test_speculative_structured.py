"""Structured output with speculative decoding, offline: a request's
grammar masks every position the verify step samples, after the proposals
kept before it, so a proposal outside the grammar is rejected, never
emitted.

Each guided request's token ids equal those of the same request without
speculation, and its text holds the constraint, with a draft model (the
tiny Llama drafting for itself, unconstrained: the grammar rejects some of
its proposals) and with n-gram lookup (a pattern repeated in the answer,
which the lookup proposes and the grammar keeps).
"""
from __future__ import annotations

import re

import pytest

from spyre_support.engines import GUIDED_COMPACT, spyre_llm
from spyre_support.envs import cb_env
from structured_cases import CHOICES, REGEX, SCHEMA, check_schema

K = 4
REPEATED = "(ab-){12}"
CASES = [dict(regex=REGEX), dict(choice=CHOICES), dict(json=SCHEMA),
         dict(regex=REPEATED)]
PROMPTS = ["the spyre card", "a batch of", "one two three", "abc abc"]


def answers(model, **kwargs) -> dict:
    """The guided requests, greedy, in one batch: their ids and texts, and
    the engine's speculative counters."""
    from vllm import SamplingParams
    from vllm.sampling_params import GuidedDecodingParams
    params = [SamplingParams(temperature=0.0, max_tokens=64,
                             guided_decoding=GuidedDecodingParams(**case))
              for case in CASES]
    with spyre_llm(model, cb_env("eager"), max_num_seqs=4,
                   max_model_len=128, **GUIDED_COMPACT, **kwargs) as llm:
        outs = [o.outputs[0] for o in llm.generate(PROMPTS, params,
                                                   use_tqdm=False)]
        counters = getattr(llm.llm_engine.output_processor, "counters",
                           None)
        return dict(ids=[list(o.token_ids) for o in outs],
                    texts=[o.text for o in outs],
                    reasons=[o.finish_reason for o in outs],
                    proposed=counters.draft_tokens if counters else 0,
                    accepted=counters.accepted if counters else 0)


@pytest.fixture(scope="module")
def plain(tiny_llama):
    return answers(tiny_llama)


def spec(**method) -> dict:
    """Every step with proposals verifies."""
    return {"num_speculative_tokens": K, "disable_by_batch_size": 64,
            **method}


def assert_constrained(run: dict) -> None:
    assert run["reasons"] == ["stop"] * len(CASES)
    texts = run["texts"]
    assert re.fullmatch(REGEX, texts[0])
    assert texts[1] in CHOICES
    check_schema(texts[2])
    assert texts[3] == "ab-" * 12


def test_a_draft_models_proposals_outside_the_grammar_are_rejected(
        tiny_llama, plain):
    run = answers(tiny_llama, speculative_config=spec(model=str(tiny_llama)))
    assert_constrained(run)
    assert run["ids"] == plain["ids"]
    assert 0 < run["proposed"] and run["accepted"] < run["proposed"], run


def test_ngram_proposals_the_grammar_allows_are_kept(tiny_llama, plain):
    run = answers(tiny_llama, speculative_config=spec(
        method="ngram", prompt_lookup_min=1, prompt_lookup_max=3))
    assert_constrained(run)
    assert run["ids"] == plain["ids"]
    assert run["accepted"] > 0
