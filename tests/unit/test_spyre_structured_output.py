"""``vllm.engine.spyre_structured_output`` on its own: which library
serves a request, and the logits processor's matchers (one per distinct
generated sequence, replayed when a sequence is seen afresh, the mask
applied to exactly the allowed tokens)."""
from __future__ import annotations

import pytest
import torch

from vllm.engine import spyre_structured_output as so
from vllm.sampling_params import GuidedDecodingParams, SamplingParams


def params(**guided) -> SamplingParams:
    return SamplingParams(guided_decoding=GuidedDecodingParams(**guided))


@pytest.mark.parametrize("guided, engine, library", [
    (dict(json={"type": "object"}), "auto", "xgrammar"),
    # xgrammar lacks string formats: auto falls back to llguidance.
    (dict(json={"type": "object", "properties": {
        "day": {"type": "string", "format": "date"}}}), "auto", "guidance"),
    (dict(regex="[ab]+"), "guidance", "guidance"),
    (dict(regex="[ab]+", backend="xgrammar"), "guidance", "xgrammar"),
])
def test_library_choice(guided, engine, library):
    assert so.choose_library(params(**guided), engine) == library


def test_choice_becomes_a_grammar():
    p = params(choice=["yes", "no"])
    assert so.choose_library(p, "xgrammar") == "xgrammar"
    assert p.guided_decoding.choice is None
    assert "yes" in p.guided_decoding.grammar


@pytest.mark.parametrize("guided, names", [
    (dict(regex="a", whitespace_pattern=" "), "guided_whitespace_pattern"),
    (dict(regex="a", backend="outlines"), "'outlines'"),
])
def test_refusals_name_the_field(guided, names):
    with pytest.raises(ValueError, match=names):
        so.choose_library(params(**guided), "auto")


class Matcher:
    """A stand-in grammar: after tokens t1..tn it allows token n + 1
    (mod 8) only; it terminates after 5 tokens."""

    def __init__(self) -> None:
        self.tokens: list[int] = []

    def accept_tokens(self, request, tokens) -> bool:
        for t in tokens:
            if t != (len(self.tokens) + 1) % 8 and t != 7:
                return False
            self.tokens.append(t)
        return True

    def is_terminated(self) -> bool:
        return len(self.tokens) >= 5

    def fill_bitmask(self, bitmask, idx) -> None:
        allowed = (len(self.tokens) + 1) % 8
        bitmask[idx] = 1 << allowed


class Backend:

    def __init__(self) -> None:
        self.compiled = 0

    def allocate_token_bitmask(self, n):
        return torch.zeros((n, 1), dtype=torch.int32)

    def compile_grammar(self, kind, spec):
        self.compiled += 1
        return Matcher()


def test_processor_masks_to_the_allowed_token():
    processor = so.GrammarLogitsProcessor(Backend(), ("regex", "x"), "r")
    logits = torch.zeros(8)
    out = processor([], logits)
    assert out[1] == 0 and torch.isinf(out[[0, 2, 3, 4, 5, 6, 7]]).all()
    out = processor([1, 2], torch.zeros(8))
    assert out[3] == 0 and torch.isinf(out).sum() == 7


def test_one_matcher_per_distinct_sequence():
    """n samples share a request's processor: a sequence that leaves
    another's path gets a matcher of its own, replayed over its tokens;
    sequences on one path share one."""
    backend = Backend()
    processor = so.GrammarLogitsProcessor(backend, ("regex", "x"), "r")
    processor([], torch.zeros(8))
    processor([], torch.zeros(8))
    assert backend.compiled == 1
    processor([1], torch.zeros(8))  # advances the first matcher
    processor([7], torch.zeros(8))  # leaves its path: a second one
    assert backend.compiled == 2
    assert [m.tokens for _, m in processor.matchers] == [[1], [7]]
    processor([1, 2], torch.zeros(8))
    processor([7, 2], torch.zeros(8))
    assert backend.compiled == 2
    # A sequence seen again from its start (recomputed after preemption)
    # meets its own state: nothing replayed, nothing compiled.
    processor([1, 2], torch.zeros(8))
    assert backend.compiled == 2


def test_terminated_or_refused_sequences_are_left_alone():
    processor = so.GrammarLogitsProcessor(Backend(), ("regex", "x"), "r")
    done = processor([1, 2, 3, 4, 5], torch.zeros(8))
    assert not torch.isinf(done).any()
    refused = processor([3], torch.zeros(8))  # not allowed first
    assert not torch.isinf(refused).any() and processor.failed


def test_bitmask_unpacking_matches_xgrammar():
    """``allowed`` reads the libraries' bitmask as xgrammar's own
    ``apply_token_bitmask_inplace`` does, up to a vocabulary that ends
    inside a word."""
    import xgrammar
    vocab = 1000
    g = torch.Generator().manual_seed(0)
    bitmask = torch.randint(-2**31, 2**31 - 1, (1, (vocab + 31) // 32),
                            dtype=torch.int32, generator=g)
    want = torch.randn(vocab, generator=g)
    got = want.clone()
    xgrammar.apply_token_bitmask_inplace(want.view(1, -1), bitmask,
                                         vocab_size=vocab)
    got.masked_fill_(~so.allowed(bitmask, vocab), float("-inf"))
    assert torch.equal(got, want)
    assert torch.isinf(got).any() and not torch.isinf(got).all()
