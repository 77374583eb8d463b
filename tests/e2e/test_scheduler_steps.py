"""SpyreStaticScheduler behaviour as step tables: step a real engine (tiny
Llama, eager backend) and check waiting / running / finished and the chosen
shape after every step."""
from __future__ import annotations

import pytest

from spyre_support.engines import spyre_engine
from spyre_support.envs import spyre_env
from vllm.config.spyre import WarmupShape

SHORT = WarmupShape(prompt_len=64, new_tokens=4, batch_size=2)
LONG = WarmupShape(prompt_len=128, new_tokens=3, batch_size=1)
ENV = spyre_env("eager", [64, 128], [4, 3], [2, 1])


@pytest.fixture(scope="module")
def engine(tiny_llama):
    with spyre_engine(tiny_llama, ENV) as engine:
        yield engine


def add(engine, rid: str, prompt_len: int, max_tokens: int) -> None:
    from vllm import SamplingParams, TokensPrompt
    engine.add_request(
        rid, TokensPrompt(prompt_token_ids=[7] * prompt_len),
        SamplingParams(temperature=0.0, max_tokens=max_tokens,
                       ignore_eos=True))


def run_table(engine, table) -> None:
    """table rows: (shape, running, waiting, finished) after each step."""
    sched = engine.scheduler[0]
    seen_tokens: dict[str, int] = {}
    for i, (shape, running, waiting, finished) in enumerate(table, 1):
        outputs = engine.step()
        done = sorted(o.request_id for o in outputs if o.finished)
        for o in outputs:
            seen_tokens[o.request_id] = len(o.outputs[0].token_ids)
        state = (sched.current_shape,
                 sorted(g.request_id for g in sched.running),
                 [g.request_id for g in sched.waiting], done)
        assert state == (shape, running, waiting, finished), f"step {i}"
    assert not engine.has_unfinished_requests()
    return seen_tokens


def test_early_finisher_and_waiting_request(engine):
    """r1 finishes after its prefill; r2 still waits for the whole batch."""
    add(engine, "r0", 10, 4)
    add(engine, "r1", 20, 1)
    add(engine, "r2", 30, 2)
    tokens = run_table(engine, [
        # shape, running,  waiting, finished this step
        (SHORT, ["r0"], ["r2"], ["r1"]),  # prefill r0+r1
        (SHORT, ["r0"], ["r2"], []),  # decode: no new prefill
        (SHORT, ["r0"], ["r2"], []),
        (SHORT, [], ["r2"], ["r0"]),  # r0 has its 4 tokens
        (SHORT, ["r2"], [], []),  # next batch: prefill r2
        (SHORT, [], [], ["r2"]),
    ])
    assert tokens == {"r0": 4, "r1": 1, "r2": 2}


def test_shape_choice_and_skipping(engine):
    """The oldest request picks the shape; requests that do not fit it wait
    and are batched together next, in arrival order."""
    add(engine, "a", 100, 3)  # only LONG holds a 100-token prompt
    add(engine, "b", 10, 4)  # only SHORT allows 4 new tokens
    add(engine, "c", 12, 2)  # fits both
    add(engine, "d", 90, 1)  # only LONG
    run_table(engine, [
        (LONG, ["a"], ["b", "c", "d"], []),
        (LONG, ["a"], ["b", "c", "d"], []),
        (LONG, [], ["b", "c", "d"], ["a"]),
        (SHORT, ["b", "c"], ["d"], []),  # b is oldest: SHORT, with c
        (SHORT, ["b"], ["d"], ["c"]),
        (SHORT, ["b"], ["d"], []),
        (SHORT, [], ["d"], ["b"]),
        (LONG, [], [], ["d"]),  # max_tokens=1: done at prefill
    ])


def test_cheapest_shape_for_small_batch(engine):
    """Two short requests that fit both shapes run on the cheaper SHORT
    shape; a lone long-prompt request runs on LONG."""
    add(engine, "x", 8, 2)
    add(engine, "y", 8, 2)
    run_table(engine, [
        (SHORT, ["x", "y"], [], []),
        (SHORT, [], [], ["x", "y"]),
    ])


def test_abort_frees_its_row(engine):
    """An aborted request leaves the batch; the rest completes and the next
    batch is scheduled."""
    add(engine, "p", 10, 4)
    add(engine, "q", 10, 4)
    add(engine, "s", 10, 2)
    engine.step()  # prefill p+q
    engine.abort_request("q")
    tokens = run_table(engine, [
        (SHORT, ["p"], ["s"], []),
        (SHORT, ["p"], ["s"], []),
        (SHORT, [], ["s"], ["p"]),
        (SHORT, ["s"], [], []),
        (SHORT, [], [], ["s"]),
    ])
    assert tokens == {"p": 4, "s": 2}


@pytest.mark.parametrize("prompt_len,max_tokens", [
    (129, 1),  # longer than every shape's prompt
    (100, 4),  # LONG holds the prompt, but only 3 new tokens
    (10, 5),  # more new tokens than any shape
])
def test_impossible_request_is_rejected(engine, prompt_len, max_tokens):
    with pytest.raises(ValueError) as err:
        add(engine, "bad", prompt_len, max_tokens)
    msg = str(err.value)
    assert f"prompt length {prompt_len}" in msg
    assert f"max_tokens {max_tokens}" in msg
    assert str(SHORT) in msg and str(LONG) in msg
    assert not engine.has_unfinished_requests()
    # The engine keeps serving.
    add(engine, "ok", 10, 1)
    run_table(engine, [(SHORT, [], [], ["ok"])])
