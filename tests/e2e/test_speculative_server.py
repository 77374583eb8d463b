"""Speculative decoding through ``vllm serve`` (the MQLLMEngine OpenAI
server) on loopback, driven by the openai client, with each method
(n-gram lookup, the tiny Llama drafting for itself, a random MLP
speculator): greedy ids equal transformers' for prompts that repeat
themselves, a stream's text equals the whole answer, a stop string ends
the text where plain decoding ends it (the tokens a verify step emits
after it are dropped), vLLM's speculative-decoding counters on
``/metrics`` count the drafts and the accepted tokens, and a guided
request proposes and keeps to its grammar."""
from __future__ import annotations

import json

import pytest

from spyre_support.bench import repeated_spans
from spyre_support.envs import cb_env
from spyre_support.server import Server, metric, openai_client, served_ids

#: Every step with proposals verifies (not the step times measured at
#: warm-up, which a busy machine skews).
SPEC = {"method": "ngram", "num_speculative_tokens": 4,
        "prompt_lookup_max": 4, "prompt_lookup_min": 2,
        "disable_by_batch_size": 64}
#: What each method's start-up log line says it runs.
SAYS = {"ngram": "n-gram prompt lookup", "draft": "draft model",
        "mlp": "MLP speculator"}
#: Prompts of a repeated span (the n-gram lookup finds it), 40 tokens
#: each; the tiny Llama's answers to them repeat themselves too.
PLAN = [(5, 6, 3, 40), (8, 8, 0, 40), (12, 4, 17, 40)]


@pytest.fixture(scope="module", params=list(SAYS))
def server(request, tiny_llama, tmp_path_factory):
    from spyre_support.tiny_models import build_tiny_mlp_speculator
    spec = SPEC
    if request.param != "ngram":
        proposer = tiny_llama if request.param == "draft" else \
            build_tiny_mlp_speculator(tmp_path_factory.mktemp("mlp"),
                                      tiny_llama)
        spec = {"model": str(proposer), "num_speculative_tokens": 4,
                "disable_by_batch_size": 64}
    args = ("--max-num-seqs", "4", "--max-model-len", "256",
            "--speculative-config", json.dumps(spec))
    with Server(tiny_llama, cb_env("eager"), args=args) as srv:
        srv.method = request.param
        yield srv


@pytest.fixture(scope="module")
def prompts(tiny_llama) -> list[list[int]]:
    from transformers import AutoConfig
    vocab = AutoConfig.from_pretrained(tiny_llama).vocab_size
    return [p for p, _ in repeated_spans(vocab, PLAN)]


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


def test_greedy_ids_equal_transformers(server, prompts, hf_tiny):
    for prompt in prompts:
        assert served_ids(server, prompt, 40) == hf_tiny.greedy(prompt,
                                                                40)[0]
    assert f"Spyre speculative decoding: {SAYS[server.method]}" in \
        server.log()


def test_a_stream_gives_the_whole_answer(server, prompts, client):
    whole = client.completions.create(model=server.model, prompt=prompts[0],
                                      max_tokens=40, temperature=0,
                                      extra_body=dict(ignore_eos=True))
    chunks = client.completions.create(model=server.model,
                                       prompt=prompts[0], max_tokens=40,
                                       temperature=0, stream=True,
                                       extra_body=dict(ignore_eos=True))
    assert "".join(c.choices[0].text for c in chunks) == \
        whole.choices[0].text


def test_a_stop_string_ends_the_text_where_plain_decoding_does(
        server, prompts, client):
    text = client.completions.create(
        model=server.model, prompt=prompts[2], max_tokens=40, temperature=0,
        extra_body=dict(ignore_eos=True)).choices[0].text
    stop = text[len(text) // 2:len(text) // 2 + 4]
    stopped = client.completions.create(
        model=server.model, prompt=prompts[2], max_tokens=40, temperature=0,
        stop=[stop], extra_body=dict(ignore_eos=True)).choices[0]
    assert stopped.finish_reason == "stop"
    assert stopped.text == text[:text.index(stop)]


def test_metrics_count_drafts_and_accepted_tokens(server, prompts):
    for prompt in prompts:
        served_ids(server, prompt, 40)
    drafts = metric(server, "vllm:spec_decode_num_drafts_total")
    proposed = metric(server, "vllm:spec_decode_num_draft_tokens_total")
    accepted = metric(server, "vllm:spec_decode_num_accepted_tokens_total")
    assert drafts > 0 and accepted <= proposed <= 4 * drafts
    if server.method != "mlp":  # a random speculator may guess nothing
        assert accepted > 0


def test_a_guided_request_speculates_within_its_grammar(server, client):
    """A request's grammar masks every position a verify step samples:
    the text holds its pattern while the request proposes."""
    before = metric(server, "vllm:spec_decode_num_draft_tokens_total")
    choice = client.completions.create(
        model=server.model, prompt="the spyre card", max_tokens=64,
        temperature=0, extra_body=dict(guided_regex="(ab-){12}")).choices[0]
    assert choice.finish_reason == "stop"
    assert choice.text == "ab-" * 12
    assert metric(server, "vllm:spec_decode_num_draft_tokens_total") > before
