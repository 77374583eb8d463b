"""``vllm.LLM`` engines on the Spyre backend, built under given settings,
and the greedy helpers the tests run through them.

Building an engine (load, warm-up compilation) is most of an end-to-end
test's time: tests that need the same engine share it.  ``shared_llm``
keeps one engine for the whole session, keyed by (model, settings, engine
arguments), for every test that only generates through it, in any file;
a module-scoped fixture shares results within a file.  Only one engine
lives in a process at a time (they share vLLM's process groups and
dynamo's state): each is torn down (``release_engine``) before the next
starts, the shared one included.
"""
from __future__ import annotations

import contextlib
import gc
import os
from pathlib import Path
from typing import Iterator, Optional
from unittest import mock

from spyre_support.envs import cb_env, spyre_env


def compile_count() -> int:
    """Frames dynamo has compiled so far in this process (each recompile
    counts once)."""
    from torch._dynamo.utils import counters
    return sum(counters["frames"].values()) + sum(
        counters["stats"].values())


def release_engine() -> None:
    """Tears down what an engine left in this process, so the next one
    starts clean: the process group, every compiled graph, and the
    objects its start-up left to the permanent generation
    (``spyre_heap.freeze_start_up_objects``), collected with the rest."""
    import torch
    from vllm.distributed import (destroy_distributed_environment,
                                  destroy_model_parallel)
    destroy_model_parallel()
    destroy_distributed_environment()
    torch._dynamo.reset()
    gc.unfreeze()
    gc.collect()


def collector_reach(llm, made_later) -> dict:
    """Which of an in-process engine's objects the cycle collector still
    walks: its model runner (made at start-up, frozen after warm-up:
    ``spyre_heap.freeze_start_up_objects``) and ``made_later`` (made while
    serving, which it must)."""
    runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
    tracked = {id(o) for o in gc.get_objects()}
    return dict(runner=id(runner) in tracked,
                made_later=id(made_later) in tracked,
                frozen=gc.get_freeze_count())


def _build(model: Path, env: dict, kwargs: dict):
    from vllm import LLM
    with mock.patch.dict(os.environ, env):
        return LLM(model=str(model), **kwargs)


#: The session's shared engine: {key: engine}, one entry at most.
_SHARED: dict = {}


def _key(model: Path, env: dict, kwargs: dict) -> tuple:
    return (str(model), tuple(sorted(env.items())),
            repr(sorted(kwargs.items())))


def shared_llm(model: Path, env: dict, **kwargs):
    """The session's ``vllm.LLM`` for (``model``, ``env``, ``kwargs``):
    built on first use and handed to every later caller with the same key,
    in any test file, until a caller asks for another engine (this one is
    then torn down first).  Only for tests that generate through it and
    whose results do not depend on what it ran before: never one that
    changes its weights or settings, counts what it did from its start, or
    reads what it cached (prefix caching)."""
    key = _key(model, env, kwargs)
    if key not in _SHARED:
        drop_shared()
        _SHARED[key] = _build(model, env, kwargs)
    return _SHARED[key]


def drop_shared() -> None:
    """Tears down the shared engine, if one is held."""
    if _SHARED:
        _SHARED.clear()
        release_engine()


@contextlib.contextmanager
def spyre_llm(model: Path, env: dict, **kwargs) -> Iterator:
    """A private ``vllm.LLM`` on the Spyre backend under ``env``, torn down
    after the block: for tests that change the engine or count what it
    does from its start."""
    drop_shared()
    llm = _build(model, env, kwargs)
    try:
        yield llm
    finally:
        del llm
        release_engine()


def mode_env(mode: str, backend: str, prompt_lens, new_tokens, batch_sizes,
             max_model_len: int, kwargs: dict) -> tuple[dict, dict]:
    """The settings and engine arguments of static batching (``mode``
    ``"static"``: the warm-up shapes given) or continuous batching
    (``"cb"``: ``--max-num-seqs`` the largest batch size,
    ``max_model_len``)."""
    if mode == "static":
        return spyre_env(backend, prompt_lens, new_tokens, batch_sizes), kwargs
    return cb_env(backend), dict(kwargs, max_num_seqs=max(batch_sizes),
                                 max_model_len=max_model_len)


def mode_llm(model: Path, mode: str, backend: str, prompt_lens, new_tokens,
             batch_sizes, max_model_len: int, **kwargs):
    """``spyre_llm`` in the mode ``mode_env`` sets."""
    env, kwargs = mode_env(mode, backend, prompt_lens, new_tokens,
                           batch_sizes, max_model_len, kwargs)
    return spyre_llm(model, env, **kwargs)


#: Guided decoding by xgrammar with no whitespace between JSON tokens
#: (the tiny random model would otherwise fill its budget with spaces).
GUIDED_COMPACT = dict(guided_decoding_backend="xgrammar",
                      guided_decoding_disable_any_whitespace=True)


def request_llm(model: Path, mode: str):
    """The engine on which the tests of what one request asks for
    (sampling parameters, structured output) run, shared by their files
    (tests/conftest.py runs them on one worker): eager, 64-token prompts
    with up to 64 new tokens at batch 4 (``"static"``) or 4 sequences of
    128 positions (``"cb"``), ``GUIDED_COMPACT``."""
    env, kwargs = mode_env(mode, "eager", [64], [64], [4], 128,
                           GUIDED_COMPACT)
    return shared_llm(model, env, **kwargs)


@contextlib.contextmanager
def spyre_engine(model: Path, env: dict, **kwargs) -> Iterator:
    """A bare ``LLMEngine`` on the Spyre backend, for stepping by hand."""
    from vllm import EngineArgs, LLMEngine
    drop_shared()
    with mock.patch.dict(os.environ, env):
        engine = LLMEngine.from_engine_args(
            EngineArgs(model=str(model), **kwargs))
    try:
        yield engine
    finally:
        del engine
        release_engine()


def model_runner(llm):
    """The driver worker's model runner of an in-process ``LLM``."""
    return llm.llm_engine.model_executor.driver_worker.worker.model_runner


def greedy_tokens(llm, prompts: list[list[int]], max_tokens: int):
    """``llm.generate`` of token-id prompts, greedy, EOS ignored."""
    from vllm import SamplingParams, TokensPrompt
    return llm.generate(
        [TokensPrompt(prompt_token_ids=p) for p in prompts],
        SamplingParams(temperature=0, max_tokens=max_tokens,
                       ignore_eos=True), use_tqdm=False)


def greedy_requests(llm, requests) -> list[list[int]]:
    """``llm.generate`` of ``(prompt ids, new tokens)`` requests, each with
    its own ``max_tokens``, greedy, EOS ignored: the generated ids."""
    from vllm import SamplingParams, TokensPrompt
    outs = llm.generate(
        [TokensPrompt(prompt_token_ids=p) for p, _ in requests],
        [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True)
         for _, m in requests], use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def first_logprob(output) -> Optional[list[float]]:
    """Log-probability vLLM reported for each sampled token."""
    if output.logprobs is None:
        return None
    return [
        step[tok].logprob for step, tok in zip(output.logprobs,
                                               output.token_ids)
    ]
