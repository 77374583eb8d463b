"""``BoundedXgrammarBackend``: vLLM's xgrammar backend compiling in a
child process.  The grammar it returns masks exactly as vLLM's own
backend's does; a compilation past the budget is refused in about the
budget's time and its process is gone; a grammar seen before compiles
nothing; a compiler error reaches the caller as a ``ValueError``.
SmolLM2's tokenizer (49,152 tokens), where a long string bound takes
xgrammar 0.1.21 tens of seconds."""
from __future__ import annotations

import json
import multiprocessing
import time
from types import SimpleNamespace

import pytest

from spyre_support.paths import SMOLLM2_DIR

SCHEMA = json.dumps({"type": "object", "properties": {
    "color": {"enum": ["red", "green"]}, "n": {"type": "integer"}},
    "required": ["color", "n"]})


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(SMOLLM2_DIR)


def config():
    return SimpleNamespace(
        decoding_config=SimpleNamespace(disable_any_whitespace=True),
        speculative_config=None)


def bounded(tokenizer, timeout_s: float = 30.0):
    from vllm.engine.spyre_grammar_compile import BoundedXgrammarBackend
    return BoundedXgrammarBackend(config(), tokenizer=tokenizer,
                                  vocab_size=len(tokenizer),
                                  timeout_s=timeout_s)


def json_key(schema: str):
    from vllm.v1.structured_output.backend_types import (
        StructuredOutputOptions)
    return StructuredOutputOptions.JSON, schema


def test_masks_equal_vllms_own_backend(tokenizer):
    from vllm.v1.structured_output.backend_xgrammar import XgrammarBackend
    ours = bounded(tokenizer)
    theirs = XgrammarBackend(config(), tokenizer=tokenizer,
                             vocab_size=len(tokenizer))
    a, b = (backend.compile_grammar(*json_key(SCHEMA))
            for backend in (ours, theirs))
    prefix = tokenizer.encode('{"color', add_special_tokens=False)
    assert a.accept_tokens("r", prefix) and b.accept_tokens("r", prefix)
    masks = []
    for grammar, backend in ((a, ours), (b, theirs)):
        mask = backend.allocate_token_bitmask(1)
        grammar.fill_bitmask(mask, 0)
        masks.append(mask)
    assert masks[0].equal(masks[1])
    assert masks[0].ne(0).any() and masks[0].ne(-1).any()


def test_a_grammar_seen_before_compiles_nothing(tokenizer):
    backend = bounded(tokenizer)
    backend.compile_grammar(*json_key(SCHEMA))
    before = multiprocessing.active_children()
    start = time.monotonic()
    again = backend.compile_grammar(*json_key(SCHEMA))
    assert time.monotonic() - start < 0.5
    assert multiprocessing.active_children() == before
    # A fresh matcher, at the grammar's start.
    assert again.matcher.is_terminated() is False
    assert again.num_processed_tokens == 0


def test_compilation_past_the_budget_is_refused_and_stopped(tokenizer):
    backend = bounded(tokenizer, timeout_s=1.0)
    slow = json.dumps({"type": "string", "minLength": 2000})
    start = time.monotonic()
    with pytest.raises(ValueError) as e:
        backend.compile_grammar(*json_key(slow))
    took = time.monotonic() - start
    assert 1.0 <= took < 3.0, took
    assert "within 1 s" in str(e.value)
    assert "VLLM_SPYRE_GUIDED_COMPILE_TIMEOUT_S" in str(e.value)
    assert not [c for c in multiprocessing.active_children()
                if c.name == "spyre-grammar-compile"]
    # The backend still compiles what fits the budget.
    assert backend.compile_grammar(*json_key(SCHEMA)).ctx is not None


def test_compiler_errors_reach_the_caller(tokenizer):
    from vllm.v1.structured_output.backend_types import (
        StructuredOutputOptions)
    backend = bounded(tokenizer)
    with pytest.raises(ValueError):
        backend.compile_grammar(StructuredOutputOptions.GRAMMAR,
                                "root ::= undefined_rule")


def test_byte_level_vocabulary_read_as_byte_level(tokenizer):
    """SmolLM2's decoders include ``ByteFallback``, so xgrammar takes its
    byte-level vocabulary for a byte-fallback one, and ``Ġ`` for a letter;
    the backend reads it as byte-level: ``Ġ`` is a space."""
    import xgrammar as xgr

    from vllm.engine.spyre_grammar_compile import byte_level_info
    assert xgr.TokenizerInfo.from_huggingface(
        tokenizer).vocab_type == xgr.VocabType.BYTE_FALLBACK
    info = byte_level_info(tokenizer, len(tokenizer))
    assert info.vocab_type == xgr.VocabType.BYTE_LEVEL
    quote = tokenizer.convert_tokens_to_ids('\u0120"')
    assert info.decoded_vocab[quote] == b' "'
    assert bounded(tokenizer).compiler.compile_regex(
        "a").tokenizer_info.vocab_type == xgr.VocabType.BYTE_LEVEL


@pytest.mark.parametrize("spec, text", [
    # Compact JSON keeps xgrammar's separators ", " and ": ": the grammar
    # was a dead end after the first key, every token masked.
    (SCHEMA, '{"color": "red", "n": 12}'),
    # A choice, or a string, with a space in it.
    ('root ::= "New York" | "Paris"', "New York"),
])
def test_text_with_spaces_follows_the_grammar(tokenizer, spec, text):
    from vllm.v1.structured_output.backend_types import (
        StructuredOutputOptions)
    kind = (StructuredOutputOptions.JSON if spec is SCHEMA else
            StructuredOutputOptions.GRAMMAR)
    backend = bounded(tokenizer)
    grammar = backend.compile_grammar(kind, spec)
    mask = backend.allocate_token_bitmask(1)
    for token in tokenizer.encode(text, add_special_tokens=False):
        grammar.fill_bitmask(mask, 0)
        assert mask[0, token // 32] >> (token % 32) & 1, (text, token)
        assert grammar.accept_tokens("r", [token])
    assert grammar.accept_tokens("r", [tokenizer.eos_token_id])
    assert grammar.is_terminated()
