"""xgrammar compilations with a time budget.

xgrammar (0.1.21, the version vLLM 0.10.1.1 pins) has no way to stop a
compilation: a grammar that takes minutes keeps a core busy for minutes.
``BoundedXgrammarBackend`` is vLLM's xgrammar backend whose compilations
each run in a child process forked from the engine for the purpose: the
child compiles with the engine's compiler (its tokenizer tables are
shared copy-on-write, nothing is rebuilt) and sends the compiled grammar
back serialized; a child still compiling when the budget
(``VLLM_SPYRE_GUIDED_COMPILE_TIMEOUT_S``) runs out is killed and the
request refused with a ``ValueError`` naming the budget.  The child runs
only xgrammar: no model code, no OpenMP, nothing the engine's threads hold.

Compiled grammars are kept, most recently used first, within vLLM's
``VLLM_XGRAMMAR_CACHE_MB``, so a schema seen before compiles nothing.
"""
from __future__ import annotations

import multiprocessing
import os
from collections import OrderedDict
from dataclasses import dataclass, field

import xgrammar as xgr

from vllm import envs
from vllm.logger import init_logger
from vllm.v1.structured_output.backend_xgrammar import (XgrammarBackend,
                                                        XgrammarGrammar)

logger = init_logger(__name__)


@dataclass
class BoundedXgrammarBackend(XgrammarBackend):
    """``XgrammarBackend`` compiling in a killable child process."""

    #: Seconds a compilation may take.
    timeout_s: float = 10.0
    _compiled: OrderedDict = field(default_factory=OrderedDict, init=False,
                                   repr=False)
    _tokenizer_info: object = field(default=None, init=False, repr=False)

    def __post_init__(self):
        super().__post_init__()
        # The tokenizer tables the compiler was built with, which a
        # serialized grammar is read back against.
        self._tokenizer_info = self.compiler.compile_regex(
            "a").tokenizer_info

    def compile_grammar(self, request_type, grammar_spec: str):
        key = (request_type, grammar_spec)
        ctx = self._compiled.get(key)
        if ctx is None:
            ctx = self._compile_in_child(request_type, grammar_spec)
            self._keep(key, ctx)
        else:
            self._compiled.move_to_end(key)
        return self.grammar(ctx)

    def grammar(self, ctx) -> XgrammarGrammar:
        """A fresh matcher over the compiled grammar ``ctx``."""
        return XgrammarGrammar(
            matcher=xgr.GrammarMatcher(
                ctx, max_rollback_tokens=self.num_speculative_tokens),
            vocab_size=self.vocab_size, ctx=ctx)

    def _keep(self, key, ctx) -> None:
        self._compiled[key] = ctx
        limit = envs.VLLM_XGRAMMAR_CACHE_MB * 2**20
        held = sum(c.memory_size_bytes for c in self._compiled.values())
        while len(self._compiled) > 1 and held > limit:
            _, dropped = self._compiled.popitem(last=False)
            held -= dropped.memory_size_bytes

    def _compile_in_child(self, request_type, grammar_spec: str):
        context = multiprocessing.get_context("fork")
        ours, theirs = context.Pipe(duplex=False)
        child = context.Process(target=self._compile_and_send,
                                args=(theirs, request_type, grammar_spec),
                                name="spyre-grammar-compile", daemon=True)
        child.start()
        theirs.close()
        try:
            if not ours.poll(self.timeout_s):
                raise ValueError(
                    f"the grammar did not compile within "
                    f"{self.timeout_s:g} s "
                    "(VLLM_SPYRE_GUIDED_COMPILE_TIMEOUT_S); simplify it, "
                    "e.g. smaller repetition bounds (minLength, maxLength, "
                    "minItems, maxItems, {n,m}) or fewer enum values")
            try:
                kind, payload = ours.recv()
            except EOFError:
                child.join(5)
                raise ValueError(
                    "the grammar could not be compiled: its compiler "
                    f"process ended with code {child.exitcode}") from None
        finally:
            if child.is_alive():
                child.kill()
            child.join()
            ours.close()
        if kind == "error":
            raise ValueError(payload)
        return xgr.CompiledGrammar.deserialize_json(payload,
                                                    self._tokenizer_info)

    def _compile_and_send(self, conn, request_type, grammar_spec) -> None:
        """Body of the child: vLLM's compilation with the compiler this
        process inherited, the result sent serialized."""
        try:
            ctx = XgrammarBackend.compile_grammar(self, request_type,
                                                  grammar_spec).ctx
            conn.send(("ok", ctx.serialize_json()))
        except Exception as e:  # noqa: BLE001  reported to the engine
            conn.send(("error", f"{type(e).__name__}: {e}"))
        finally:
            conn.close()
            os._exit(0)
