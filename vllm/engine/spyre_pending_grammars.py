"""Grammars compiled beside the engine's steps, in the OpenAI server.

A grammar can take seconds to compile (xgrammar, a long string bound), and
the engine's steps would stop for that long if the engine waited for it
when the request arrives: every running stream would pause.  In the
MQLLMEngine process (the engine behind ``vllm serve``) a request whose
grammar is not compiled yet is queued at once, its compilation running in
a child process (``spyre_grammar_compile.Compilation``), and:

* every scheduler of the engine holds such requests back: while their
  grammar compiles, the scheduler does not see them in its waiting queue,
  so running requests keep decoding and later requests may start first;
  they keep their place in the queue for when it has compiled;
* before each step the engine asks every compilation once, without
  waiting; a request whose grammar failed (invalid for the compiler, or
  over ``VLLM_SPYRE_GUIDED_COMPILE_TIMEOUT_S``) is aborted and its client
  gets the ``ValueError`` (HTTP 400), as for a request refused on arrival;
* a step that ran nothing while grammars compile waits up to 50 ms for
  one of them instead of spinning on a core the compilers need;
* a request aborted while its grammar compiles (a client that went) gives
  it up: the child is killed unless another request waits for the same
  grammar.

The same holds for ``vllm serve --disable-frontend-multiprocessing``,
whose engine (``AsyncLLMEngine``) steps in the API server's event loop:
there the wait of a step that ran nothing runs in a thread, so the server
keeps answering, and a failed grammar ends its request's stream with the
``ValueError``.  ``LLM(...)`` keeps compiling at ``add_request``: its
caller gets a refusal there, before anything runs.  ``install`` is a
``vllm.general_plugins`` entry point and does nothing unless the platform
is Spyre.
"""
from __future__ import annotations

import asyncio
from collections import deque
from multiprocessing.connection import wait
from typing import Any, Iterable, Union

from vllm.engine.spyre_upstream_wraps import wrap_once
from vllm.logger import init_logger

logger = init_logger(__name__)

#: Keys in an engine's ``__dict__``.
_BESIDE = "_spyre_compile_beside_steps"
_HELD = "_spyre_held_for_grammar"
_FAILED = "_spyre_grammar_failures"
#: Key in a scheduler's ``__dict__``: its last schedule ran nothing.
_RAN_NOTHING = "_spyre_ran_nothing"
#: Longest wait for a compilation in a step that ran nothing.
IDLE_WAIT_S = 0.05


def install() -> None:
    """Entry point of the ``vllm.general_plugins`` group (idempotent)."""
    from vllm.engine.async_llm_engine import AsyncLLMEngine, _AsyncLLMEngine
    from vllm.engine.llm_engine import LLMEngine
    from vllm.engine.multiprocessing.engine import MQLLMEngine
    wrap_once(MQLLMEngine, "__init__", _beside_steps_in_server)
    wrap_once(MQLLMEngine, "engine_step", _sending_failures)
    wrap_once(AsyncLLMEngine, "__init__", _beside_steps_in_server)
    wrap_once(AsyncLLMEngine, "engine_step", _ending_streams_of_failures)
    wrap_once(LLMEngine, "step", _settling_first)
    wrap_once(_AsyncLLMEngine, "step_async", _settling_first_async)
    wrap_once(LLMEngine, "abort_request", _giving_up)


def beside_steps(engine) -> bool:
    """Whether ``engine`` compiles grammars beside its steps."""
    return engine.__dict__.get(_BESIDE, False)


def compile_beside_steps(engine) -> None:
    """From now on, ``engine`` compiles grammars beside its steps, its
    schedulers holding back the requests whose grammar compiles."""
    if beside_steps(engine):
        return
    engine.__dict__[_BESIDE] = True
    engine.__dict__[_HELD] = {}
    engine.__dict__[_FAILED] = []
    for scheduler in engine.scheduler:
        scheduler.schedule = _holding_back(engine, scheduler,
                                           scheduler.schedule)


def hold(engine, processor) -> None:
    """``processor``'s request waits for its grammar."""
    engine.__dict__[_HELD][processor.request] = processor


def held(engine) -> dict:
    """The requests waiting for their grammar, by id."""
    return engine.__dict__.get(_HELD) or {}


def take_failures(engine) -> list[tuple[str, ValueError]]:
    """The requests aborted since the last call because their grammar
    failed to compile, with why."""
    failures = engine.__dict__.get(_FAILED)
    if not failures:
        return []
    taken = list(failures)
    failures.clear()
    return taken


def settle(engine) -> None:
    """Asks every compilation once: a request whose grammar compiled is
    released to its scheduler, one whose grammar failed is aborted and its
    failure kept for ``take_failures``."""
    waiting = held(engine)
    for request_id, processor in list(waiting.items()):
        try:
            if not processor.grammar_ready():
                continue
        except Exception as e:  # noqa: BLE001  the request's, not the engine's
            if not isinstance(e, ValueError):
                e = ValueError(f"Guided decoding: the grammar could not be "
                               f"used: {type(e).__name__}: {e}")
            del waiting[request_id]
            engine.abort_request(request_id)
            engine.__dict__[_FAILED].append((request_id, e))
            logger.info("Refused request %s: %s", request_id, e)
            continue
        del waiting[request_id]


def _compiling(seq_group) -> bool:
    params = seq_group.sampling_params
    return params is not None and any(
        getattr(p, "pending", None) is not None
        for p in params.logits_processors or ())


def _holding_back(engine, scheduler, schedule):

    def schedule_without_compiling() -> Any:
        # Every step: look through the queue only while grammars compile.
        order = list(scheduler.waiting) if held(engine) else []
        back = [g for g in order if _compiling(g)]
        if not back:
            out = schedule()
        else:
            ids = {id(g) for g in back}
            scheduler.waiting = deque(g for g in order if id(g) not in ids)
            try:
                out = schedule()
            finally:
                scheduler.waiting = put_back(order, back, scheduler.waiting)
        # (sequence groups' metadata, outputs, async allowed): none ran.
        scheduler.__dict__[_RAN_NOTHING] = not out[0]
        return out

    return schedule_without_compiling


def put_back(order: list, back: list, after) -> deque:
    """The waiting queue ``after`` a schedule that did not see ``back``,
    with those put back where they were in ``order`` (the queue before):
    each ahead of the first request that was behind it.  What the schedule
    added (a preempted request, at the front) stays where it put it."""
    rank = {id(g): i for i, g in enumerate(order)}
    back = deque(back)
    queue: deque = deque()
    for group in after:
        i = rank.get(id(group))
        if i is not None:
            while back and rank[id(back[0])] < i:
                queue.append(back.popleft())
        queue.append(group)
    queue.extend(back)
    return queue


def _settling_first(original):

    def step(engine, *args, **kwargs) -> Any:
        if not held(engine):
            return original(engine, *args, **kwargs)
        settle(engine)
        outputs = original(engine, *args, **kwargs)
        conns = _idle_waits(engine)
        if conns:
            wait(conns, timeout=IDLE_WAIT_S)
        return outputs

    return step


def _settling_first_async(original):

    async def step_async(engine, *args, **kwargs) -> Any:
        if not held(engine):
            return await original(engine, *args, **kwargs)
        settle(engine)
        outputs = await original(engine, *args, **kwargs)
        conns = _idle_waits(engine)
        if conns:
            # The API server answers on this event loop meanwhile.
            await asyncio.get_running_loop().run_in_executor(
                None, wait, conns, IDLE_WAIT_S)
        return outputs

    return step_async


def _idle_waits(engine) -> list:
    """After a step: the compilations' connections to wait on when every
    scheduler ran nothing while grammars compile (else none).  Not "no
    outputs": a step of requests answered whole (the server's
    non-streaming ones) has none until they finish."""
    waiting = held(engine)
    if not waiting or not all(s.__dict__.get(_RAN_NOTHING, False)
                              for s in engine.scheduler):
        return []
    return [p.pending.conn for p in waiting.values()
            if p.pending is not None and p.pending.conn is not None]


def _giving_up(original):

    def abort_request(engine, request_id: Union[str, Iterable[str]], *args,
                      **kwargs) -> Any:
        waiting = held(engine)
        if waiting:
            if not isinstance(request_id, str):
                request_id = list(request_id)
            for one in ([request_id] if isinstance(request_id, str) else
                        request_id):
                processor = waiting.pop(one, None)
                if processor is not None:
                    processor.give_up()
        return original(engine, request_id, *args, **kwargs)

    return abort_request


def _beside_steps_in_server(original):
    """For ``MQLLMEngine`` and ``AsyncLLMEngine``, which both hold their
    ``LLMEngine`` as ``engine``."""

    def __init__(server_engine, *args, **kwargs) -> None:
        original(server_engine, *args, **kwargs)
        from vllm.config.spyre import is_spyre
        if is_spyre():
            compile_beside_steps(server_engine.engine)

    return __init__


def _sending_failures(original):

    def engine_step(mq_engine) -> Any:
        outputs = original(mq_engine)
        from vllm.engine.multiprocessing import RPCError
        for request_id, error in take_failures(mq_engine.engine):
            mq_engine._send_outputs(
                RPCError(request_id=request_id, is_engine_errored=False,
                         exception=error))
        return outputs

    return engine_step


def _ending_streams_of_failures(original):

    async def engine_step(async_engine, virtual_engine: int) -> bool:
        in_progress = await original(async_engine, virtual_engine)
        for request_id, error in take_failures(async_engine.engine):
            async_engine._request_tracker.process_exception(
                request_id, error, verbose=async_engine.log_requests)
        return in_progress

    return engine_step
