"""Requests built to stall or crash the server, through the OpenAI server
on continuous batching with prefix caching, a plain stream decoding
beside them: each is answered 400 naming the field and the setting, and
the stream keeps its pace to its last token.

* structured output too large to compile (``minLength`` 1,000,000,
  ``minItems`` 1,000,000, a regex ``a{1000000}``: refused by the size
  limits before anything compiles, in about a second at most), nested
  300 objects deep (refused before the API server passes it to the
  engine, where pickling it failed with a 500), and within the limits
  but slow to compile (refused when its compilation, in a child process
  of the engine, outlives ``VLLM_SPYRE_GUIDED_COMPILE_TIMEOUT_S``, while
  the engine's steps go on: no gap in the stream comes near the budget),
  and empty (a schema, a choice list, a regex or a grammar with nothing
  in it); a grammar that takes
  a fraction of a second to compile is answered, the stream decoding
  meanwhile;
* a field the endpoint does not take: a 400 naming it, not silence;
  ``bad_words``, which vLLM's completion request lacks, is honoured on
  ``/v1/completions`` as on ``/v1/chat/completions``; a field the
  requests declare but nothing here would act on (``vllm_xargs``,
  ``kv_transfer_params``, ``length_penalty`` without beam search,
  ``prompt_embeds``, ``reasoning_effort`` for a model without it): a 400
  naming it.
"""
from __future__ import annotations

import json
import threading
import time

import pytest
import requests

from spyre_support.envs import cb_env
from spyre_support.server import Server

#: The budget of this server's grammar compilations, and the repetition
#: limit raised so that a slow string bound reaches the compiler (the tiny
#: model's 384 tokens compile ``minLength`` n in about n x 75 us).
TIMEOUT_S = 3
MAX_REPEAT = 200000
STREAM_TOKENS = 2000


ENV = dict(cb_env("eager"),
           VLLM_SPYRE_GUIDED_COMPILE_TIMEOUT_S=str(TIMEOUT_S),
           VLLM_SPYRE_GUIDED_MAX_REPEAT=str(MAX_REPEAT))
ARGS = ("--max-num-seqs", "4", "--max-model-len", "2048",
        "--enable-prefix-caching", "--guided-decoding-backend", "xgrammar",
        "--guided-decoding-disable-any-whitespace")
#: Within the limits, slow to compile (about 11 s): the budget ends it.
SLOW = {"type": "string", "minLength": 150000}
#: Compiles in about a quarter of a second, well within the budget.
QUICK = {"type": "string", "minLength": 3000}


@pytest.fixture(scope="module")
def server(tiny_llama_2k):
    with Server(tiny_llama_2k, ENV, args=ARGS) as srv:
        yield srv


def nested(levels: int) -> dict:
    schema = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def post(server, path: str, **body) -> requests.Response:
    body.setdefault("model", server.model)
    body.setdefault("max_tokens", 8)
    if path.endswith("chat/completions"):
        body.setdefault("messages", [{"role": "user", "content": "hi"}])
    else:
        body.setdefault("prompt", "hi")
    return requests.post(server.url + path, json=body, timeout=120)


class Stream(threading.Thread):
    """Greedy streamed completions of ``STREAM_TOKENS`` tokens each, one
    after another until ``stop`` is called: the arrival time of every
    chunk, a list per completion.  A single completion is bounded by the
    model's length, and on a fast machine it can end before the grammars
    do; one after another, the decoding lasts as long as the test needs."""

    def __init__(self, server) -> None:
        super().__init__(daemon=True)
        self.server = server
        self.runs: list[list[float]] = []
        self.finishes: list[str | None] = []
        self.started = threading.Event()
        self._halt = threading.Event()

    def run(self) -> None:
        body = dict(model=self.server.model, prompt=[5, 6, 7, 8],
                    max_tokens=STREAM_TOKENS, temperature=0,
                    ignore_eos=True, stream=True)
        while not self._halt.is_set():
            times, finish = [], None
            self.runs.append(times)
            with requests.post(self.server.url + "/v1/completions",
                               json=body, stream=True, timeout=300) as resp:
                for line in resp.iter_lines():
                    if not line.startswith(b"data: ") or \
                            line == b"data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    times.append(time.monotonic())
                    self.started.set()
                    finish = chunk["choices"][0]["finish_reason"] or finish
            self.finishes.append(finish)

    def stop(self) -> None:
        self._halt.set()
        self.join(300)
        assert not self.is_alive()

    def decoded_throughout(self, start: float, end: float) -> bool:
        """A token arrived before ``start`` and one after ``end``."""
        times = [t for run in self.runs for t in run]
        return min(times) < start and max(times) > end


HOSTILE = [
    # (endpoint, body, words the answer must name)
    ("/v1/completions", dict(guided_json=SLOW),
     ["did not compile within 3 s", "VLLM_SPYRE_GUIDED_COMPILE_TIMEOUT_S"]),
    ("/v1/completions", dict(guided_json={"type": "string",
                                          "minLength": 1000000}),
     ["minLength", "1,000,000", "VLLM_SPYRE_GUIDED_MAX_REPEAT"]),
    ("/v1/chat/completions", dict(response_format=dict(
        type="json_schema", json_schema=dict(name="list", schema={
            "type": "array", "items": {"type": "integer"},
            "minItems": 1000000}))),
     ["minItems", "1,000,000", "VLLM_SPYRE_GUIDED_MAX_REPEAT"]),
    ("/v1/completions", dict(guided_regex="a{1000000}"),
     ["guided_regex", "{1000000}", "VLLM_SPYRE_GUIDED_MAX_REPEAT"]),
    ("/v1/completions", dict(guided_json=nested(300)),
     ["guided_json", "VLLM_SPYRE_GUIDED_MAX_DEPTH"]),
    ("/v1/chat/completions", dict(guided_json=nested(300)),
     ["guided_json", "VLLM_SPYRE_GUIDED_MAX_DEPTH"]),
    ("/v1/chat/completions", dict(guided_json=json.dumps(nested(300))),
     ["guided_json", "VLLM_SPYRE_GUIDED_MAX_DEPTH"]),
    ("/v1/completions", dict(guided_json="{"), ["guided_json", "JSON"]),
    # Empty.
    ("/v1/completions", dict(guided_json=""), ["guided_json", "JSON"]),
    ("/v1/completions", dict(guided_choice=[]), ["guided_choice is empty"]),
    # xgrammar's compiler crashed on an empty regex (in its child).
    ("/v1/completions", dict(guided_regex=""), ["guided_regex is empty"]),
    ("/v1/chat/completions", dict(guided_grammar=""),
     ["guided_grammar is empty"]),
]


def test_hostile_structured_output_is_400_while_a_stream_keeps_its_pace(
        server):
    stream = Stream(server)
    stream.start()
    assert stream.started.wait(120)
    begun = time.monotonic()
    for path, body, words in HOSTILE:
        start = time.monotonic()
        reply = post(server, path, **body)
        took = time.monotonic() - start
        assert reply.status_code == 400, (body, reply.text[:500])
        message = reply.json()["error"]["message"]
        for word in words:
            assert word in message, (word, message)
        assert took < TIMEOUT_S + 2, (body, took)
        if "did not compile" in message:
            quick_grammar_is_answered(server)
    stream_kept_its_pace(stream, begun, time.monotonic())
    # And the server still constrains what fits.
    reply = post(server, "/v1/completions", max_tokens=16,
                 guided_json={"enum": ["red", "green"]})
    assert reply.status_code == 200, reply.text
    assert json.loads(reply.json()["choices"][0]["text"]) in ("red", "green")


def quick_grammar_is_answered(server) -> None:
    reply = post(server, "/v1/completions", max_tokens=4, guided_json=QUICK)
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["text"].startswith('"')


def stream_kept_its_pace(stream: Stream, start: float, end: float) -> None:
    """The streams decoded from before ``start`` to after ``end``, each
    ran to its length, and no token waited for a grammar: the engine
    stepped on while the grammars compiled (waiting for the slow one would
    have been a gap of its whole budget, within a completion or between
    one and the next)."""
    deadline = time.monotonic() + 120
    while stream.is_alive() and max(stream.runs[-1], default=0.0) <= end:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    stream.stop()
    assert stream.decoded_throughout(start, end)
    assert stream.finishes == ["length"] * len(stream.runs)
    assert all(len(times) == STREAM_TOKENS for times in stream.runs)
    times = [t for run in stream.runs for t in run]
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert max(gaps) < TIMEOUT_S / 2, max(gaps)


def test_grammars_compile_beside_the_steps_without_frontend_processes(
        tiny_llama_2k):
    """``vllm serve --disable-frontend-multiprocessing``: the engine steps
    in the API server's event loop.  A grammar over its budget is refused
    naming the budget, one within it is answered, and a stream decoding
    meanwhile never waits for either."""
    with Server(tiny_llama_2k, ENV,
                args=(*ARGS, "--disable-frontend-multiprocessing")) as srv:
        stream = Stream(srv)
        stream.start()
        assert stream.started.wait(120)
        start = time.monotonic()
        reply = post(srv, "/v1/completions", guided_json=SLOW)
        assert time.monotonic() - start < TIMEOUT_S + 2
        assert reply.status_code == 400, reply.text[:500]
        assert "did not compile within 3 s" in reply.json()["error"][
            "message"]
        quick_grammar_is_answered(srv)
        stream_kept_its_pace(stream, start, time.monotonic())


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_field_the_endpoint_lacks_is_400_naming_it(server, path):
    reply = post(server, path, no_such_field=1, another_one="x")
    assert reply.status_code == 400, reply.text
    message = reply.json()["error"]["message"]
    assert "another_one, no_such_field" in message and path in message
    assert post(server, path).status_code == 200


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_bad_words_are_honoured(server, path):
    """The first whole word the greedy answer generates, banned: its token
    appears nowhere in the answer any more."""
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(server.model)
    chat = path.endswith("chat/completions")

    def generated(**extra) -> list[int]:
        logprobs = dict(logprobs=True, top_logprobs=0) if chat else \
            dict(logprobs=0)
        reply = post(server, path, temperature=0, max_tokens=24,
                     ignore_eos=True, return_tokens_as_token_ids=True,
                     **logprobs, **extra)
        assert reply.status_code == 200, reply.text
        got = reply.json()["choices"][0]["logprobs"]
        tokens = ([t["token"] for t in got["content"]] if chat else
                  got["tokens"])
        return [int(t.removeprefix("token_id:")) for t in tokens]

    free = generated()
    token, word = next(
        (t, w) for t in free
        for w in [tokenizer.decode([t]).strip()]
        if w.isascii() and w.isalpha() and len(w) > 1)
    banned = generated(bad_words=[word])
    assert token not in banned, (word, banned)
    assert banned != free
    reply = post(server, path, bad_words="not a list")
    assert reply.status_code == 400


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("field, value, words", [
    ("vllm_xargs", {"a": 1}, ["vllm_xargs: ", "V1"]),
    ("kv_transfer_params", {"do_remote_decode": True},
     ["kv_transfer_params: ", "KV transfer connector"]),
    ("length_penalty", 2.0, ["length_penalty=2.0", "beam search only"]),
])
def test_a_field_nothing_here_acts_on_is_400_naming_it(server, path, field,
                                                       value, words):
    """Declared by vLLM's requests, but the V0 engine on Spyre would act
    on none of them (vLLM answered 200 as if it had)."""
    reply = post(server, path, **{field: value})
    assert reply.status_code == 400, reply.text
    for word in words:
        assert word in reply.json()["error"]["message"]


def test_prompt_embeds_are_400_not_500(server):
    """vLLM decoded the field before anything refused it: a malformed
    value was an HTTP 500, a well-formed one reached an engine that
    refuses prompt embeddings."""
    reply = post(server, "/v1/completions", prompt_embeds="AAAA")
    assert reply.status_code == 400, reply.text
    assert "prompt_embeds: prompt embeddings are not supported on Spyre" \
        in reply.json()["error"]["message"]


def test_reasoning_effort_for_a_model_without_it_is_400(server):
    reply = post(server, "/v1/chat/completions", reasoning_effort="high")
    assert reply.status_code == 400, reply.text
    message = reply.json()["error"]["message"]
    assert message.startswith("reasoning_effort: ") and "(llama)" in message
    assert post(server, "/v1/chat/completions").status_code == 200
