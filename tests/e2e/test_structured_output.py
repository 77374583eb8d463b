"""Structured output (guided decoding) on Spyre, offline: every request
form holds its constraint in static and continuous batching and over two
tensor-parallel ranks (through the OpenAI server with the clients people
bring: test_structured_output_server.py); only the requests that ask are
constrained; bad schemas, regexes and grammars are refused
naming the problem while the engine keeps serving; a request's grammar
state goes with it.

The tiny random model would pad JSON with whitespace without end, so the
engines here keep it compact (``--guided-decoding-backend xgrammar
--guided-decoding-disable-any-whitespace``), and schemas use enums,
booleans and small enumerations: what a random model fills in within a
few tokens.
"""
from __future__ import annotations

import gc
import itertools
import json
import re
import time
import weakref

import pytest

from spyre_support.engines import GUIDED_COMPACT, mode_llm, request_llm
from structured_cases import CHOICES, MAX_NEW, REGEX, SCHEMA, check_schema


# "cb" first: test_sampling.py, which runs just before on the same worker,
# ends on the continuous-batching engine, and this file takes it over.
@pytest.fixture(scope="module", params=["cb", "static"])
def llm(request, tiny_llama):
    return request_llm(tiny_llama, request.param)


def guided(**kwargs):
    from vllm import SamplingParams
    from vllm.sampling_params import GuidedDecodingParams
    extra = {k: kwargs.pop(k) for k in ("n", "seed", "temperature",
                                        "max_tokens") if k in kwargs}
    return SamplingParams(**{"max_tokens": MAX_NEW, "temperature": 0.0,
                             **extra},
                          guided_decoding=GuidedDecodingParams(**kwargs))


def text(llm, params, prompt="the spyre card") -> str:
    out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop", out
    return out.text


def test_regex(llm):
    assert re.fullmatch(REGEX, text(llm, guided(regex=REGEX)))


def test_choice(llm):
    assert text(llm, guided(choice=CHOICES)) in CHOICES


def test_json_schema(llm):
    check_schema(text(llm, guided(json=SCHEMA)))
    check_schema(text(llm, guided(json=json.dumps(SCHEMA))))


def test_json_object(llm):
    assert isinstance(json.loads(text(llm, guided(json_object=True))), dict)


@pytest.mark.parametrize("grammar", [
    'root ::= "yes" | "no"',  # EBNF, as xgrammar takes it
    'start: "yes" | "no"',  # Lark, converted to EBNF
])
def test_grammar(llm, grammar):
    assert text(llm, guided(grammar=grammar)) in ("yes", "no")


def test_n_samples_each_follow_the_grammar(llm):
    outs = llm.generate(["the spyre card"],
                        guided(regex=REGEX, n=3, seed=3, temperature=1.5),
                        use_tqdm=False)[0].outputs
    assert len(outs) == 3
    assert all(re.fullmatch(REGEX, o.text) for o in outs)
    assert len({o.text for o in outs}) > 1


def test_only_the_rows_that_ask_are_constrained(llm):
    """Beside guided requests in one batch, a plain request generates
    what it generates alone."""
    from vllm import SamplingParams
    plain = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    alone = llm.generate(["a plain prompt"], plain,
                         use_tqdm=False)[0].outputs[0].token_ids
    outs = llm.generate(
        ["the spyre card", "a plain prompt", "the card"],
        [guided(regex=REGEX), plain, guided(choice=CHOICES)],
        use_tqdm=False)
    assert re.fullmatch(REGEX, outs[0].outputs[0].text)
    assert outs[1].outputs[0].token_ids == alone
    assert outs[2].outputs[0].text in CHOICES


@pytest.mark.parametrize("bad, names", [
    (dict(regex="(["), "regex"),
    (dict(json='{"type": "objec'), "JSON"),
    (dict(grammar="root ::= "), "grammar"),
    (dict(regex=REGEX, whitespace_pattern=r"[ ]?"),
     "guided_whitespace_pattern"),
    (dict(regex=REGEX, backend="outlines"), "'outlines'"),
])
def test_bad_input_is_refused_and_the_engine_serves_on(llm, bad, names):
    with pytest.raises(ValueError, match=re.escape(names)) as err:
        llm.generate(["x"], guided(**bad), use_tqdm=False)
    assert "Guided decoding" in str(err.value)
    assert re.fullmatch(REGEX, text(llm, guided(regex=REGEX)))


@pytest.fixture
def made(monkeypatch) -> list:
    """Weak references to every grammar processor made during the test."""
    from vllm.engine import spyre_structured_output as so
    made = []
    real = so.GrammarLogitsProcessor

    def recording(*args, **kwargs):
        processor = real(*args, **kwargs)
        made.append(weakref.ref(processor))
        return processor

    monkeypatch.setattr(so, "GrammarLogitsProcessor", recording)
    return made


def test_grammar_state_goes_with_the_request(llm, made):
    """Once a guided request has finished and later steps have run (vLLM
    keeps its last step's sequence groups until the next), its grammar
    state is gone."""
    from vllm import SamplingParams
    assert re.fullmatch(REGEX, text(llm, guided(regex=REGEX)))
    assert len(made) == 1 and made[0]() is not None
    for _ in range(2):
        llm.generate(["x"], SamplingParams(max_tokens=2), use_tqdm=False)
    gc.collect()
    assert made[0]() is None


def test_llm_chat_follows_the_grammar(llm):
    """``LLM.chat``: the chat template, then the same constraint."""
    out = llm.chat([{"role": "user", "content": "pick one"}],
                   guided(choice=CHOICES), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.text in CHOICES


def test_an_aborted_requests_grammar_state_is_freed(llm, made):
    """A guided request aborted halfway (as the server does when its client
    disconnects): its grammar state goes with it."""
    from vllm import SamplingParams
    engine = llm.llm_engine
    engine.add_request("abort-me", "the spyre card",
                       guided(regex="[a-c]{40}", max_tokens=MAX_NEW))
    for _ in range(4):
        engine.step()
    assert engine.has_unfinished_requests() and made[0]() is not None
    engine.abort_request("abort-me")
    assert not engine.has_unfinished_requests()
    # vLLM's scheduler reuses its per-step objects, which hold the last
    # requests scheduled until later steps overwrite them.
    for _ in range(2):
        llm.generate(["x"], SamplingParams(max_tokens=2), use_tqdm=False)
    gc.collect()
    assert made[0]() is None
    assert re.fullmatch(REGEX, text(llm, guided(regex=REGEX)))


@pytest.fixture
def beside_steps(llm):
    """The shared engine compiling grammars beside its steps, as the
    OpenAI server's engine does, for one test."""
    from vllm.engine import spyre_pending_grammars as pg
    engine = llm.llm_engine
    pg.compile_beside_steps(engine)
    yield engine
    assert not pg.held(engine) and not pg.take_failures(engine)
    for key in ("_spyre_compile_beside_steps", "_spyre_held_for_grammar",
                "_spyre_grammar_failures"):
        del engine.__dict__[key]
    for scheduler in engine.scheduler:
        del scheduler.schedule


#: String bounds never compiled before in this process (compiled grammars
#: are kept).
_bounds = itertools.count(250)


@pytest.fixture
def slow_compiles(beside_steps, monkeypatch):
    """Every compilation takes ``seconds`` longer (the tiny model's
    vocabulary compiles any grammar the limits let through in well under
    a second): its child process sleeps first."""
    from vllm.engine import spyre_structured_output as so
    backend = so._backend(beside_steps, "xgrammar")
    compile_and_send = backend._compile_and_send

    def slowly(seconds: float) -> None:

        def sleep_then_compile(*args):
            time.sleep(seconds)
            compile_and_send(*args)

        monkeypatch.setattr(backend, "_compile_and_send", sleep_then_compile)

    return slowly


def test_a_compiling_grammar_holds_back_only_its_request(llm, beside_steps,
                                                         slow_compiles):
    """Step by step: while a grammar compiles, its request waits in the
    queue and a plain request added with it decodes; once compiled, the
    guided request runs and gives the same tokens as when its grammar was
    compiled at admission."""
    from vllm import SamplingParams
    from vllm.engine import spyre_pending_grammars as pg
    engine = beside_steps
    slow_compiles(1.0)
    params = guided(json={"type": "string", "maxLength": next(_bounds)})
    engine.add_request("plain", "a plain prompt",
                       SamplingParams(temperature=0.0, max_tokens=MAX_NEW,
                                      ignore_eos=True))
    engine.add_request("guided", "the spyre card", params)
    processor = pg.held(engine)["guided"]
    assert processor.pending.pending
    steps = []  # (grammar still compiling, {request: tokens so far})
    while engine.has_unfinished_requests():
        outs = {o.request_id: o.outputs[0].token_ids for o in engine.step()}
        # Still compiling after the step: it was during the step.
        steps.append((processor.pending is not None, outs))
    assert all("guided" not in outs for compiling, outs in steps if
               compiling)
    assert any("plain" in outs for compiling, outs in steps if compiling)
    assert not pg.held(engine)
    guided_ids = [outs["guided"] for _, outs in steps if "guided" in outs]
    alone = llm.generate(["the spyre card"], params,
                         use_tqdm=False)[0].outputs[0].token_ids
    assert list(guided_ids[-1]) == list(alone)


def test_requests_answered_whole_keep_their_pace_while_a_grammar_compiles(
        llm, beside_steps, slow_compiles):
    """A request answered whole (``FINAL_ONLY``, as the server's
    non-streaming ones) has no output until it finishes, and its steps are
    not idle: it finishes its 64 steps while a grammar compiles for 2.5 s
    (a 50 ms wait after each step would have taken 3.2 s)."""
    from vllm import SamplingParams
    from vllm.engine import spyre_pending_grammars as pg
    from vllm.sampling_params import RequestOutputKind
    engine = beside_steps
    slow_compiles(2.5)
    engine.add_request("guided", "the spyre card", guided(
        json={"type": "string", "maxLength": next(_bounds)}))
    processor = pg.held(engine)["guided"]
    engine.add_request("whole", "a plain prompt", SamplingParams(
        temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True,
        output_kind=RequestOutputKind.FINAL_ONLY))
    while_compiling = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == "whole" and out.finished:
                while_compiling = processor.pending is not None
                assert len(out.outputs[0].token_ids) == MAX_NEW
    assert while_compiling is True


def test_a_grammar_over_its_budget_is_refused_between_steps(
        llm, beside_steps, slow_compiles, monkeypatch):
    """A grammar still compiling when its budget ends: the request is
    aborted with a ValueError naming the budget, its compiler killed, and
    a request sharing the engine finishes."""
    from vllm import SamplingParams
    from vllm.engine import spyre_pending_grammars as pg
    from vllm.engine import spyre_structured_output as so
    engine = beside_steps
    backend = so._backend(engine, "xgrammar")
    monkeypatch.setattr(backend, "timeout_s", 0.5)
    slow_compiles(30.0)
    engine.add_request("slow", "x", guided(
        json={"type": "string", "maxLength": next(_bounds)}))
    compilation = pg.held(engine)["slow"].pending
    engine.add_request("plain", "a plain prompt",
                       SamplingParams(temperature=0.0, max_tokens=4))
    done = []
    while engine.has_unfinished_requests():
        done += [o.request_id for o in engine.step() if o.finished]
    assert done == ["plain"]
    [(request, error)] = pg.take_failures(engine)
    assert request == "slow"
    assert "did not compile within 0.5 s" in str(error)
    assert "VLLM_SPYRE_GUIDED_COMPILE_TIMEOUT_S" in str(error)
    assert not compilation.child.is_alive()


def test_an_aborted_request_gives_up_its_compilation(llm, beside_steps,
                                                     slow_compiles):
    """A request aborted while its grammar compiles (its client went):
    the compiling child is killed; a second request for the same grammar
    shares one compilation, which outlives the first one's abort."""
    from vllm.engine import spyre_pending_grammars as pg
    engine = beside_steps
    slow_compiles(30.0)
    params = guided(json={"type": "string", "maxLength": next(_bounds)})
    engine.add_request("a", "x", params)
    engine.add_request("b", "y", params)
    first, second = (pg.held(engine)[r].pending for r in "ab")
    assert first is second and first.child.is_alive()
    engine.abort_request("a")
    assert first.child.is_alive()
    engine.abort_request("b")
    assert not first.child.is_alive() and not pg.held(engine)
    assert not engine.has_unfinished_requests()


def test_a_preempted_guided_request_keeps_its_grammar(tiny_llama,
                                                      monkeypatch):
    """Continuous batching with 7 blocks of 64 tokens: three requests of
    2 blocks each grow to 3 while decoding, and the scheduler preempts the
    latest, the guided one; recomputed, it gives the same text as alone,
    within its grammar."""
    import torch
    from vllm import SamplingParams, TokensPrompt
    regex = "[a-c]{48}"
    gen = torch.Generator().manual_seed(3)

    def prompt(n):
        return TokensPrompt(prompt_token_ids=torch.randint(
            4, 384, (n, ), generator=gen).tolist())
    prompts = [prompt(100), prompt(110), prompt(120)]
    plain = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True)
             for m in (60, 50)]
    with mode_llm(tiny_llama, "cb", "eager", [64], [MAX_NEW], [3],
                  max_model_len=576, num_gpu_blocks_override=7,
                  **GUIDED_COMPACT) as llm:
        alone = llm.generate(prompts[2:], guided(regex=regex),
                             use_tqdm=False)[0].outputs[0].text
        scheduler = llm.llm_engine.scheduler[0]
        preempted = []
        real = scheduler._preempt

        def spy(seq_group, *args, **kwargs):
            preempted.append(seq_group.request_id)
            return real(seq_group, *args, **kwargs)

        monkeypatch.setattr(scheduler, "_preempt", spy)
        outs = llm.generate(prompts, [*plain, guided(regex=regex)],
                            use_tqdm=False)
        manager = scheduler.block_manager
        assert (manager.get_num_free_gpu_blocks()
                == manager.num_total_gpu_blocks == 7)
    assert outs[2].request_id in preempted
    assert re.fullmatch(regex, alone)
    assert outs[2].outputs[0].text == alone
    assert [len(o.outputs[0].token_ids) for o in outs[:2]] == [60, 50]
