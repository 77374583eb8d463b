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

A compilation is a ``Compilation``: ``compile_grammar`` waits for one
(offline, where a refusal reaches the caller of ``add_request``), while
the OpenAI server's engine polls it between steps
(``spyre_pending_grammars``).  Requests asking for the same grammar share
one compilation; at most half the CPUs' worth of children compile at once
(as vLLM's V1 engine bounds its compiling threads), the rest wait their
turn, their budget counted from their own start.
"""
from __future__ import annotations

import multiprocessing
import os
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Optional

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
    #: Compilations running or queued, oldest first, by grammar.
    _inflight: OrderedDict = field(default_factory=OrderedDict, init=False,
                                   repr=False)

    def __post_init__(self):
        super().__post_init__()
        info = byte_level_info(self.tokenizer, self.vocab_size)
        if info is not None:
            self.compiler = xgr.GrammarCompiler(
                info, max_threads=8, cache_enabled=True,
                cache_limit_bytes=envs.VLLM_XGRAMMAR_CACHE_MB * 2**20)
        # The tokenizer tables the compiler was built with, which a
        # serialized grammar is read back against.
        self._tokenizer_info = self.compiler.compile_regex(
            "a").tokenizer_info

    def compile_grammar(self, request_type, grammar_spec: str):
        return self.grammar(self.compilation(request_type,
                                             grammar_spec).wait())

    def compilation(self, request_type, grammar_spec: str) -> "Compilation":
        """The compilation of this grammar: done already if it was
        compiled before, shared with the requests that asked for it while
        it compiles, started if a child is free, else queued."""
        key = (request_type, grammar_spec)
        ctx = self._compiled.get(key)
        if ctx is not None:
            self._compiled.move_to_end(key)
            return Compilation(self, key, ctx=ctx)
        compilation = self._inflight.get(key)
        if compilation is None:
            compilation = self._inflight[key] = Compilation(self, key)
        compilation.waiters += 1
        self.advance()
        return compilation

    @property
    def max_children(self) -> int:
        """Children compiling at once: half the CPUs, at least one."""
        return max(1, ((os.cpu_count() or 1) + 1) // 2)

    def advance(self) -> None:
        """Starts queued compilations, oldest first, while children are
        free."""
        running = sum(c.child is not None for c in self._inflight.values())
        # A start that fails ends its compilation, which leaves the dict.
        for compilation in list(self._inflight.values()):
            if running >= self.max_children:
                break
            if compilation.child is None:
                compilation.start()
                running += 1

    def ended(self, compilation: "Compilation") -> None:
        """A compilation finished, failed or was given up: its result kept
        if any, its child's place given to the next."""
        if self._inflight.get(compilation.key) is compilation:
            del self._inflight[compilation.key]
        if compilation.ctx is not None:
            self._keep(compilation.key, compilation.ctx)
        self.advance()

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


def byte_level_info(tokenizer, vocab_size: int):
    """xgrammar's tokenizer information for a byte-level BPE vocabulary
    that xgrammar takes for a byte-fallback one, or None when it reads the
    vocabulary right.

    xgrammar 0.1.21 reads a Hugging Face tokenizer's decoder, and one
    whose decoders include ``ByteFallback`` before ``ByteLevel`` (SmolLM2's,
    the default model's) is taken as byte-fallback: its ``Ġ`` stays a
    letter instead of a space, so no token that starts with a space fits
    a grammar.  A JSON schema's default separators (``", "``, ``": "``)
    then end in a dead end after the first key, where every token is
    masked, and no choice or string with a space can be generated.  A
    vocabulary with no byte tokens (``<0x..>``) and no ``▁`` but with
    ``Ġ`` is byte-level."""
    if not hasattr(tokenizer, "get_vocab"):
        return None
    info = xgr.TokenizerInfo.from_huggingface(tokenizer,
                                              vocab_size=vocab_size)
    if info.vocab_type != xgr.VocabType.BYTE_FALLBACK:
        return None
    vocab = tokenizer.get_vocab()
    if (any(t.startswith("<0x") or "\u2581" in t for t in vocab)
            or not any("\u0120" in t for t in vocab)):
        return None
    encoded = [""] * (max(vocab.values()) + 1)
    for token, i in vocab.items():
        encoded[i] = token
    return xgr.TokenizerInfo(encoded, xgr.VocabType.BYTE_LEVEL,
                             vocab_size=vocab_size,
                             stop_token_ids=info.stop_token_ids,
                             add_prefix_space=False)


class Compilation:
    """One grammar's compilation, in a child process of its own: queued
    (``child`` None), compiling, then done (``ctx``) or failed (``error``,
    a ``ValueError`` for the client).  ``poll`` never blocks beyond its
    ``timeout``; ``wait`` blocks until the end, within the budget."""

    def __init__(self, backend: BoundedXgrammarBackend, key: tuple,
                 ctx=None) -> None:
        self.backend = backend
        self.key = key
        self.ctx = ctx
        self.error: Optional[ValueError] = None
        self.child: Optional[multiprocessing.Process] = None
        self.conn: Optional[Connection] = None
        self.deadline = 0.0
        #: Requests waiting for it; the last to give up ends it.
        self.waiters = 0

    @property
    def pending(self) -> bool:
        return self.ctx is None and self.error is None

    def start(self) -> None:
        context = multiprocessing.get_context("fork")
        ours, theirs = context.Pipe(duplex=False)
        child = context.Process(target=self.backend._compile_and_send,
                                args=(theirs, *self.key),
                                name="spyre-grammar-compile", daemon=True)
        try:
            child.start()
        except OSError as e:  # fork refused (EAGAIN, ENOMEM)
            ours.close()
            self._fail(f"the grammar's compiler process could not start: "
                       f"{e}")
            return
        finally:
            theirs.close()
        self.conn, self.child = ours, child
        self.deadline = time.monotonic() + self.backend.timeout_s

    def poll(self, timeout: float = 0.0) -> bool:
        """Whether the compilation has ended (compiled or failed), after
        waiting at most ``timeout`` seconds for it."""
        if not self.pending:
            return True
        if self.child is None:
            return False
        left = self.deadline - time.monotonic()
        if self.conn.poll(max(0.0, min(timeout, left))):
            try:
                kind, payload = self.conn.recv()
            except EOFError:
                self.child.join(5)
                self._fail("the grammar could not be compiled: its "
                           "compiler process ended with code "
                           f"{self.child.exitcode}")
            else:
                if kind == "error":
                    self._fail(payload)
                else:
                    try:
                        self.ctx = xgr.CompiledGrammar.deserialize_json(
                            payload, self.backend._tokenizer_info)
                    except Exception as e:  # noqa: BLE001  for the client
                        self._fail(f"the compiled grammar could not be "
                                   f"read back: {e}")
                    else:
                        self._end()
        elif time.monotonic() >= self.deadline:
            self._fail(
                f"the grammar did not compile within "
                f"{self.backend.timeout_s:g} s "
                "(VLLM_SPYRE_GUIDED_COMPILE_TIMEOUT_S); simplify it, "
                "e.g. smaller repetition bounds (minLength, maxLength, "
                "minItems, maxItems, {n,m}) or fewer enum values")
        return not self.pending

    def wait(self):
        """The compiled grammar, or its ``ValueError``, blocking."""
        if self.pending and self.child is None:
            self.start()
        while not self.poll(timeout=3600.0):
            pass
        if self.error is not None:
            raise self.error
        return self.ctx

    def give_up(self) -> None:
        """A waiting request no longer needs it (aborted): the last one to
        give up kills the child."""
        self.waiters -= 1
        if self.waiters <= 0 and self.pending:
            self.error = ValueError("the request was aborted")
            self._end()

    def _fail(self, message: str) -> None:
        self.error = ValueError(message)
        self._end()

    def _end(self) -> None:
        if self.child is not None:
            if self.child.is_alive():
                self.child.kill()
            self.child.join()
            self.conn.close()
        self.backend.ended(self)
