"""Structured output (guided decoding) for vLLM's V0 engine on Spyre.

vLLM 0.10's V0 engine accepts ``SamplingParams.guided_decoding`` (the
OpenAI server fills it from ``response_format``, ``guided_json``,
``guided_regex``, ``guided_choice``, ``guided_grammar`` and from chat
``tools`` with ``tool_choice`` ``"required"`` or a named function) but no
longer applies it.  On Spyre, ``attach`` turns it into a logits processor
of the request when the engine admits it (``spyre_admission``), so the
mask reaches the logits on the host, before vLLM's sampler, through
vLLM's own ``LogitsProcessor``: every step, for exactly the sequences of
the requests that asked, in static and continuous batching; under tensor
parallelism only the driver samples, so only it applies the mask.

The grammars are those of vLLM's V1 engine: its xgrammar and llguidance
backends (``vllm.v1.structured_output``) validate, convert (a choice to
a grammar, Lark to EBNF) and compile them, xgrammar's compiler caching
compiled grammars by their text.  ``--guided-decoding-backend`` (or the
request's own ``backend``) picks the library; ``auto``, the default, takes
xgrammar and falls back to llguidance for what xgrammar lacks (string
``format``, ``minProperties``, ...), as the V1 engine does.

``GrammarLogitsProcessor`` keeps, per request, a matcher for each distinct
sequence of generated tokens it has been shown: a call with the tokens
generated so far advances the matcher whose tokens are a prefix of them
(or starts one from the compiled grammar and replays them), then masks
the logits to the tokens the grammar allows.  So a speculative verify
step may mask each position after the proposals it kept (the sampled
tokens), and ``n > 1`` samples, which
share the request's processor, each follow their own tokens, and a
sequence recomputed after preemption meets the same state again.  The
matchers go with the request when it finishes or is aborted.
"""
from __future__ import annotations

import threading
from typing import Any, Optional

import numpy as np
import torch

from vllm.config.spyre import SpyreConfig
from vllm.engine import spyre_guided_limits, spyre_pending_grammars
from vllm.logger import init_logger
from vllm.sampling_params import SamplingParams

logger = init_logger(__name__)

#: The libraries, by the names vLLM gives their backends.
_LIBRARIES = ("xgrammar", "guidance")


def _make_backend(name: str, engine, config: SpyreConfig):
    """vLLM's backend of library ``name`` for ``engine``; xgrammar's with
    its compilations bounded in time (``spyre_grammar_compile``)."""
    kwargs = dict(tokenizer=engine.get_tokenizer(),
                  vocab_size=engine.model_config.get_vocab_size())
    if name == "xgrammar":
        from vllm.engine.spyre_grammar_compile import BoundedXgrammarBackend
        return BoundedXgrammarBackend(
            engine.vllm_config, timeout_s=config.guided_compile_timeout_s,
            **kwargs)
    from vllm.v1.structured_output.backend_guidance import GuidanceBackend
    return GuidanceBackend(engine.vllm_config, **kwargs)


def _validate(name: str, params: SamplingParams) -> None:
    if name == "xgrammar":
        from vllm.v1.structured_output.backend_xgrammar import (
            validate_xgrammar_grammar)
        validate_xgrammar_grammar(params)
    else:
        from vllm.v1.structured_output.backend_guidance import (
            validate_guidance_grammar)
        validate_guidance_grammar(params)


def choose_library(params: SamplingParams, engine_backend: str) -> str:
    """The library that serves this request (``params`` may be rewritten
    in place by the validation: a choice becomes a grammar, Lark EBNF);
    a ``ValueError`` names what no library takes."""
    guided = params.guided_decoding
    asked = (guided.backend or engine_backend or "auto").split(":")[0]
    if guided.whitespace_pattern is not None:
        raise ValueError(
            "guided_whitespace_pattern is not supported on Spyre: neither "
            "xgrammar nor llguidance takes a whitespace pattern; use "
            "--guided-decoding-disable-any-whitespace for compact JSON")
    if asked not in ("auto", *_LIBRARIES):
        raise ValueError(
            f"guided decoding backend {asked!r} is not supported on Spyre; "
            f"use one of: auto, {', '.join(_LIBRARIES)}")
    if asked != "auto":
        _validate(asked, params)
        return asked
    try:
        _validate("xgrammar", params)
        return "xgrammar"
    except ValueError:
        _validate("guidance", params)
        return "guidance"


class GrammarLogitsProcessor:
    """A request's grammar, as a V0 logits processor:
    ``(generated token ids, logits row) -> logits row``."""

    #: Its state follows whatever generated tokens it is shown, any number
    #: at a time: a speculative verify step may show it the proposals it
    #: keeps, one position after another.
    follows_tokens = True

    def __init__(self, backend, key: tuple, request: str, first=None,
                 pending=None) -> None:
        self.backend = backend
        self.key = key
        self.request = request
        self.bitmask = backend.allocate_token_bitmask(1)
        #: (tokens accepted, matcher) per distinct sequence seen.
        self.matchers: list[tuple[list[int], Any]] = []
        self.failed = False
        #: The grammar compiled at admission, the first sequence's matcher.
        self.first = first
        #: The compilation the request waits for, while it compiles
        #: beside the engine's steps (``spyre_pending_grammars``).
        self.pending = pending

    def grammar_ready(self) -> bool:
        """Whether the grammar has compiled, asking its compilation once
        without waiting; a ``ValueError`` if it failed."""
        if self.pending is None:
            return True
        if not self.pending.poll():
            return False
        compilation, self.pending = self.pending, None
        if compilation.error is not None:
            raise ValueError(f"Guided decoding: {compilation.error}")
        self.first = self.backend.grammar(compilation.ctx)
        return True

    def give_up(self) -> None:
        """The request went (aborted) while its grammar compiled."""
        if self.pending is not None:
            self.pending.give_up()
            self.pending = None

    def new_matcher(self):
        """A matcher at the grammar's start: the one compiled at
        admission, then copies of its compiled grammar (never a new
        compilation inside a model step, where a budget could end it)."""
        if self.pending is not None:
            # Only a request scheduled before its grammar compiled (which
            # the engine's hold-back prevents) gets here.
            compilation, self.pending = self.pending, None
            self.first = self.backend.grammar(compilation.wait())
        if self.first is not None:
            first, self.first = self.first, None
            return first
        if hasattr(self.backend, "grammar"):
            return self.backend.grammar(self.matchers[0][1].ctx)
        return self.backend.compile_grammar(*self.key)

    def matcher_for(self, generated: list[int]):
        """The matcher of the sequence that generated ``generated``,
        advanced over them."""
        best: Optional[tuple[list[int], Any]] = None
        for tokens, matcher in self.matchers:
            if (len(tokens) <= len(generated)
                    and generated[:len(tokens)] == tokens
                    and (best is None or len(tokens) > len(best[0]))):
                best = (tokens, matcher)
        if best is None:
            best = ([], self.new_matcher())
            self.matchers.append(best)
        tokens, matcher = best
        new = list(generated[len(tokens):])
        if new:
            if not matcher.accept_tokens(self.request, new):
                return None
            tokens.extend(new)
        return matcher

    def __call__(self, generated: list[int],
                 logits: torch.Tensor) -> torch.Tensor:
        matcher = self.matcher_for(list(generated))
        if matcher is None:
            # A token the grammar refused reached the sequence (only
            # ignore_eos can force one, after the grammar ended).
            if not self.failed:
                logger.warning(
                    "Request %s generated a token its grammar does not "
                    "allow; it is no longer constrained", self.request)
            self.failed = True
            return logits
        if matcher.is_terminated():
            return logits
        matcher.fill_bitmask(self.bitmask, 0)
        return logits.masked_fill_(~allowed(self.bitmask, logits.shape[-1]),
                                   float("-inf"))


def allowed(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """The libraries' token bitmask (``[1, ceil(vocab / 32)]`` int32, bit
    ``t % 32`` of word ``t // 32`` set if token ``t`` is allowed) as a
    ``[vocab]`` bool tensor.  Unpacked by NumPy in about 30 us for a
    49,152-token vocabulary, where xgrammar's CPU fallback
    (``apply_token_bitmask_inplace``) takes about 170 us a row."""
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), bitorder="little")
    return torch.from_numpy(bits[:vocab].view(np.bool_))


_lock = threading.Lock()


def _backend(engine, name: str):
    """The engine's backend of library ``name``, made once (its tokenizer
    information takes a while to build)."""
    with _lock:
        backends = engine.__dict__.setdefault("_spyre_grammar_backends", {})
        if name not in backends:
            backends[name] = _make_backend(
                name, engine, SpyreConfig.from_vllm_config(engine.vllm_config))
        return backends[name]


def _limits(engine) -> spyre_guided_limits.GuidedLimits:
    """The engine's structured-output limits, read once."""
    limits = engine.__dict__.get("_spyre_guided_limits")
    if limits is None:
        limits = spyre_guided_limits.GuidedLimits.from_config(
            SpyreConfig.from_vllm_config(engine.vllm_config))
        engine.__dict__["_spyre_guided_limits"] = limits
    return limits


def attach(engine, request_id: str, params: SamplingParams) -> SamplingParams:
    """``params`` with its guided decoding turned into a logits processor
    (a copy; the caller's object is untouched), or ``params`` itself when
    it asks for none.  The grammar is checked against the engine's limits
    (``spyre_guided_limits``) here, so that a bad or too large schema,
    regex or grammar is a ``ValueError`` before the request is queued,
    and compiled here too, unless the engine compiles beside its steps
    (``spyre_pending_grammars``): then an xgrammar grammar not compiled
    before starts compiling and the request waits for it in the queue."""
    if params.guided_decoding is None:
        return params
    from vllm.v1.structured_output.request import get_structured_output_key
    try:
        spyre_guided_limits.check(params.guided_decoding, _limits(engine))
    except ValueError as e:
        raise ValueError(f"Guided decoding: {e}") from e
    params = params.clone()
    try:
        name = choose_library(params,
                              engine.vllm_config.decoding_config.backend)
        key = get_structured_output_key(params)
        backend = _backend(engine, name)
        first = pending = None
        if spyre_pending_grammars.beside_steps(engine) and hasattr(
                backend, "compilation"):
            pending = backend.compilation(*key)
            if pending.poll():
                first, pending = backend.grammar(pending.wait()), None
        else:
            first = backend.compile_grammar(*key)
    except ValueError as e:
        raise ValueError(f"Guided decoding: {e}") from e
    except Exception as e:  # the libraries raise RuntimeError and others
        raise ValueError(f"Guided decoding: the grammar could not be "
                         f"compiled: {e}") from e
    processor = GrammarLogitsProcessor(backend, key, request_id, first,
                                       pending)
    if pending is not None:
        spyre_pending_grammars.hold(engine, processor)
    params.logits_processors = [*(params.logits_processors or []),
                                processor]
    params.guided_decoding = None
    return params
