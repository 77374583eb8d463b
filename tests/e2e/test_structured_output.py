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
import json
import re
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
