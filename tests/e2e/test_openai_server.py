"""The OpenAI-compatible server (``vllm serve``) on the Spyre backend, as a
real process on loopback, driven by real clients: endpoints, greedy equality
with offline generation, static batching of concurrent requests, HTTP 400s
that name the limits, and a server that keeps serving after bad input."""
from __future__ import annotations

import json
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest
import requests

from spyre_support.engines import spyre_llm
from spyre_support.envs import spyre_env
from spyre_support.server import (Server, check_echo_logprobs, metric,
                                  openai_client)
from spyre_support.soak import metric_in

SHAPES = dict(prompt_lens=[64, 128], new_tokens=[16, 8], batch_sizes=[4, 2])
ENV = spyre_env("eager", **SHAPES)
PROMPTS = [[11, 42, 99, 7, 250], [5] * 30, [17, 18, 19] * 20, [100] * 90]
MAX_TOKENS = [16, 5, 12, 8]


@pytest.fixture(scope="module")
def server(tiny_llama):
    # Its engine process started as ``vllm serve`` starts it (spawned).
    with Server(tiny_llama, ENV, fork_engine=False) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


def model_name(server) -> str:
    return server.model


def completion_ids(choice) -> list[int]:
    """Token ids of a completion asked with return_tokens_as_token_ids."""
    return [int(t.split(":")[1]) for t in choice.logprobs.tokens]


def test_engine_is_mqllmengine_in_its_own_process(server):
    log = server.log()
    pid = int(re.search(r"Started engine process with PID (\d+)",
                        log).group(1))
    children = {p.pid for p in psutil.Process(server.proc.pid).children(
        recursive=True)}
    assert pid in children
    assert "Initializing a V0 LLM engine" in log
    assert "Spyre warm-up of 2 shape(s)" in log


def test_models_health_metrics(server, client):
    assert requests.get(server.url + "/health", timeout=10).status_code == 200
    models = client.models.list().data
    assert [m.id for m in models] == [server.model]
    assert models[0].max_model_len == 136  # 128 + 8
    client.completions.create(model=server.model, prompt="x", max_tokens=2)
    assert "vllm:num_requests_running" in requests.get(
        server.url + "/metrics", timeout=10).text


def test_greedy_over_http_equals_offline(server, client, tiny_llama):
    from vllm import SamplingParams, TokensPrompt
    http = []
    for prompt, n in zip(PROMPTS, MAX_TOKENS):
        resp = client.completions.create(
            model=server.model, prompt=prompt, max_tokens=n, temperature=0,
            logprobs=0, extra_body=dict(ignore_eos=True,
                                        return_tokens_as_token_ids=True))
        http.append(completion_ids(resp.choices[0]))
    with spyre_llm(tiny_llama, ENV) as llm:
        offline = llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p in PROMPTS],
            [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
             for n in MAX_TOKENS], use_tqdm=False)
    assert http == [list(o.outputs[0].token_ids) for o in offline]
    assert [len(ids) for ids in http] == MAX_TOKENS


def test_streaming_matches_non_streaming(server, client):
    kwargs = dict(model=server.model, prompt="spyre card batch",
                  max_tokens=10, temperature=0,
                  extra_body=dict(ignore_eos=True))
    whole = client.completions.create(**kwargs).choices[0].text
    chunks = [c.choices[0].text for c in client.completions.create(
        stream=True, **kwargs) if c.choices]
    assert "".join(chunks) == whole


def test_chat_completions(server, client):
    messages = [{"role": "user", "content": "spyre shape compile"}]
    kwargs = dict(model=server.model, messages=messages, max_tokens=6,
                  temperature=0.9, seed=123, n=2,
                  extra_body=dict(ignore_eos=True))
    first = client.chat.completions.create(**kwargs)
    second = client.chat.completions.create(**kwargs)
    assert len(first.choices) == 2
    assert [c.message.content for c in first.choices] == \
        [c.message.content for c in second.choices]
    assert first.usage.completion_tokens == 12
    streamed = "".join(
        c.choices[0].delta.content or "" for c in
        client.chat.completions.create(model=server.model,
                                       messages=messages, max_tokens=6,
                                       temperature=0, stream=True,
                                       extra_body=dict(ignore_eos=True))
        if c.choices)
    greedy = client.chat.completions.create(
        model=server.model, messages=messages, max_tokens=6, temperature=0,
        extra_body=dict(ignore_eos=True)).choices[0].message.content
    assert streamed == greedy


def test_sampling_parameters(server, client):
    base = dict(model=server.model, prompt=[3, 4, 5, 6], max_tokens=8,
                extra_body=dict(ignore_eos=True, top_k=20))
    a = client.completions.create(temperature=1.0, top_p=0.9, seed=9, **base)
    b = client.completions.create(temperature=1.0, top_p=0.9, seed=9, **base)
    assert a.choices[0].text == b.choices[0].text
    top = client.completions.create(
        model=server.model, prompt=[3, 4, 5, 6], max_tokens=8, temperature=0,
        logprobs=3, extra_body=dict(ignore_eos=True,
                                    return_tokens_as_token_ids=True))
    lp = top.choices[0].logprobs
    for tok, tok_lp, alts in zip(lp.tokens, lp.token_logprobs,
                                 lp.top_logprobs):
        assert len(alts) >= 3
        assert alts[tok] == tok_lp == max(alts.values())
    greedy = client.completions.create(temperature=0, **base).choices[0].text
    stop = greedy[3:5]
    stopped = client.completions.create(temperature=0, stop=[stop], **base)
    assert stopped.choices[0].text == greedy[:greedy.index(stop)]
    assert stopped.choices[0].finish_reason == "stop"


def test_vllm_sampling_fields_over_http(server, client):
    """vLLM's own fields (``extra_body``) and OpenAI's ``logit_bias`` reach
    the engine with their offline meaning (``test_sampling.py`` checks
    each offline, static and CB)."""
    from spyre_support.tiny_models import EOS_ID

    def ids(**fields):
        extra = dict(return_tokens_as_token_ids=True, ignore_eos=True)
        extra.update(fields.pop("extra", {}))
        out = client.completions.create(
            model=server.model, prompt=fields.pop("prompt", [3, 4, 5, 6]),
            max_tokens=fields.pop("max_tokens", 8), temperature=0,
            logprobs=0, extra_body=extra, **fields)
        return completion_ids(out.choices[0]), out

    assert ids(logit_bias={"77": 100})[0] == [77] * 8
    allowed, _ = ids(extra=dict(allowed_token_ids=[5, 6]))
    assert len(allowed) == 8 and set(allowed) <= {5, 6}
    held, out = ids(extra=dict(min_tokens=3, ignore_eos=False),
                    logit_bias={str(EOS_ID): 100})
    assert EOS_ID not in held[:3] and out.choices[0].finish_reason == "stop"
    prompt = [11, 42, 99, 7, 250, 31, 8, 9, 10]
    cut, out = ids(prompt=prompt, extra=dict(truncate_prompt_tokens=4))
    assert out.usage.prompt_tokens == 4
    assert cut == ids(prompt=prompt[-4:])[0]


def test_echo_with_logprobs_as_lm_eval_asks(server, tiny_llama):
    check_echo_logprobs(server, tiny_llama)


def post(server, body, path="/v1/completions"):
    return requests.post(server.url + path, json=body, timeout=60)


@pytest.mark.parametrize("prompt_len,max_tokens", [
    (130, 4),  # prompt longer than every shape (fits max_model_len)
    (100, 12),  # the long shape holds the prompt, not 12 new tokens
    (10, 17),  # more new tokens than any shape
])
def test_request_fitting_no_shape_is_400(server, prompt_len, max_tokens):
    resp = post(server, dict(model=server.model, prompt=[7] * prompt_len,
                             max_tokens=max_tokens))
    assert resp.status_code == 400, resp.text
    msg = resp.json()["message"] if "message" in resp.json() else resp.text
    assert f"prompt length {prompt_len}" in msg
    assert f"max_tokens {max_tokens}" in msg
    assert "prompt_len=64, new_tokens=16, batch_size=4" in msg
    assert "prompt_len=128, new_tokens=8, batch_size=2" in msg
    # Greedy and past end-of-text: a sampled end-of-text token would end
    # the request after one token.
    ok = post(server, dict(model=server.model, prompt=[7] * 5, max_tokens=2,
                           temperature=0, ignore_eos=True))
    assert ok.status_code == 200 and ok.json()["usage"][
        "completion_tokens"] == 2


def test_prompt_over_max_model_len_is_400(server):
    resp = post(server, dict(model=server.model, prompt=[7] * 200,
                             max_tokens=4))
    assert resp.status_code == 400
    assert "136" in resp.text and "200" in resp.text


def test_omitted_max_tokens_gets_largest_fitting_shape(server):
    """Chat requests without max_tokens ask for the rest of the context:
    they get as many tokens as the largest shape holding the prompt."""
    def chat(words):
        resp = post(server, dict(model=server.model, temperature=0,
                                 ignore_eos=True,
                                 messages=[{"role": "user",
                                            "content": " ".join(words)}]),
                    path="/v1/chat/completions")
        assert resp.status_code == 200, resp.text
        return resp.json()["usage"]

    short = chat(["spyre"] * 5)
    assert short["prompt_tokens"] <= 64
    assert short["completion_tokens"] == 16
    long = chat(["spyre", "card"] * 45)
    assert 64 < long["prompt_tokens"] <= 128
    assert long["completion_tokens"] == 8



@pytest.mark.parametrize("extra", [
    dict(n=5), dict(n=1, best_of=5), dict(n=1000),
])
def test_n_above_largest_batch_is_400(server, extra):
    """The n samples of a request share one batch: more than the largest
    batch size (4) is refused at once."""
    n = extra.get("best_of", extra["n"])
    resp = post(server, dict(model=server.model, prompt=[7] * 5,
                             max_tokens=4, temperature=1.0, **extra))
    assert resp.status_code == 400, resp.text
    assert f"n={n} parallel samples" in resp.text
    assert "largest batch size 4" in resp.text
    assert metric(server, "vllm:num_requests_waiting") == 0
    assert metric(server, "vllm:num_requests_running") == 0
    ok = post(server, dict(model=server.model, prompt=[7] * 5, max_tokens=4,
                           n=4, temperature=1.0, ignore_eos=True))
    assert ok.status_code == 200, ok.text
    assert [c["index"] for c in ok.json()["choices"]] == [0, 1, 2, 3]


@pytest.mark.parametrize("path,extra,names", [
    ("/v1/completions", dict(prompt="hello", guided_regex="[0-9"), "regex"),
    ("/v1/completions", dict(prompt="hello", guided_grammar="root ::= ("),
     "grammar"),
    ("/v1/chat/completions", dict(
        messages=[{"role": "user", "content": "hello"}],
        response_format={"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "objec"}}}), "objec"),
])
def test_bad_guided_decoding_is_400(server, path, extra, names):
    """The default backend (auto) tries xgrammar, then llguidance, and
    answers with the last library's complaint."""
    resp = post(server, dict(model=server.model, max_tokens=4, **extra),
                path=path)
    assert resp.status_code == 400, resp.text
    assert "Guided decoding" in resp.text and names in resp.text
    assert metric(server, "vllm:num_requests_waiting") == 0


@pytest.mark.parametrize("path,api", [
    ("/v1/embeddings", "Embeddings"), ("/pooling", "Pooling"),
    ("/classify", "Classification"), ("/v1/score", "Score"),
    ("/rerank", "Rerank"),
])
def test_apis_a_generator_lacks_are_400(server, path, api):
    resp = post(server, dict(model=server.model, input="hi", text_1="a",
                             text_2="b", query="q", documents=["d"]),
                path=path)
    assert resp.status_code == 400, resp.text
    assert f"does not support {api}" in resp.json()["error"]["message"]
    assert post(server, dict(model=server.model, prompt="x",
                             max_tokens=1)).status_code == 200

@pytest.mark.parametrize("body,status", [
    ("{not json", 400),
    (dict(model="no-such-model", prompt="x", max_tokens=2), 404),
    (dict(prompt="x", max_tokens=-3), 400),
    (dict(prompt="x", max_tokens=2, temperature=-1), 400),
    (dict(prompt="x", max_tokens=2, top_p=7), 400),
    (dict(prompt="x", max_tokens=2, n=0), 400),
])
def test_malformed_requests_get_4xx(server, body, status):
    if isinstance(body, dict):
        body.setdefault("model", server.model)
        resp = post(server, body)
    else:
        resp = requests.post(server.url + "/v1/completions", data=body,
                             headers={"Content-Type": "application/json"},
                             timeout=30)
    assert resp.status_code == status, resp.text
    assert post(server, dict(model=server.model, prompt="x",
                             max_tokens=1)).status_code == 200


def stream_times(server, prompt, max_tokens, started=None):
    """Streams one completion; returns (arrival time of each chunk).
    ``started`` (an Event), if given, is set at the first chunk."""
    times = []
    with requests.post(server.url + "/v1/completions",
                       json=dict(model=server.model, prompt=prompt,
                                 max_tokens=max_tokens, temperature=0,
                                 ignore_eos=True, stream=True),
                       stream=True, timeout=120) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith(b"data: ") and line != b"data: [DONE]":
                if json.loads(line[6:])["choices"]:
                    times.append(time.monotonic())
                    if started is not None:
                        started.set()
    return times


#: New tokens of the long batch.
LONG = 1984


@pytest.fixture(scope="module")
def long_batch_server(tiny_llama_2k):
    """One shape of 1,984 new tokens (the tiny Llama with 2,048
    positions): a running batch lasts long enough for later requests to
    arrive (and be tokenized and queued) while it runs.  The tiny model's
    steps are quicker than the API server's work per streamed token, so on
    a loaded machine the blocker's first chunk can reach the client late
    in its batch: with 512 steps, four requests sent at once straddled
    the end of the batch in CI."""
    env = spyre_env("eager", prompt_lens=[64], new_tokens=[LONG],
                    batch_sizes=[4])
    with Server(tiny_llama_2k, env) as srv:
        yield srv


def queued_behind_the_batch(server, blocker, count):
    """Waits until ``count`` requests wait while one batch runs (one
    scrape of the metrics shows both); False if ``blocker`` ended first."""
    while not blocker.done():
        text = requests.get(server.url + "/metrics", timeout=30).text
        if (metric_in(text, "vllm:num_requests_waiting") == count and
                metric_in(text, "vllm:num_requests_running") == 1):
            return True
        # Not too often: the same API server tokenizes the four.
        time.sleep(0.05)
    return False


def test_later_arrivals_wait_then_share_one_batch(long_batch_server):
    """While a batch runs, new requests wait; when it ends they form one
    batch together (16 engine steps for 4 rows of 16 tokens)."""
    server = long_batch_server
    steps = "vllm:iteration_tokens_total_count"
    # The four must all be queued before the batch ends: on a loaded
    # machine one can reach the engine after it, and then starts a batch
    # of its own.  That run proves nothing about batching and is repeated.
    for _ in range(3):
        before = metric(server, steps)
        running = threading.Event()
        with ThreadPoolExecutor(5) as pool:
            blocker = pool.submit(stream_times, server, [9] * 8, LONG,
                                  running)
            # Its first token has arrived: the batch runs LONG - 1 more
            # steps.
            assert running.wait(60)
            later = [pool.submit(stream_times, server, [9] * (4 + i), 16)
                     for i in range(4)]
            queued = queued_behind_the_batch(server, blocker, 4)
            first = blocker.result()
            others = [f.result() for f in later]
        if queued:
            break
    assert queued, f"the batch of {LONG} steps ended three times before " \
        "four requests sent together were queued"
    assert len(first) == LONG and all(len(t) == 16 for t in others)
    # The engine ran the blocker's LONG steps and one batch of 16 for the
    # four: none joined the running batch (which would leave LONG steps)
    # and they shared one batch.  (Arrival times on separate connections
    # can swap by a few ms, so they cannot order the two batches.)
    assert metric(server, steps) - before == LONG + 16
    assert min(t[0] for t in others) > first[0]
