"""Every field of vLLM's two generation requests, one at a time, on both
endpoints: a field that becomes a sampling parameter reaches
``SamplingParams`` with the value sent, a field the server reads itself
is listed with what reads it (the server test,
tests/e2e/test_hostile_requests_server.py, checks the refusals over
HTTP), and a field nothing on this server would act on is refused naming
it.  A field a
later vLLM adds to either request fails
``test_every_field_is_accounted_for`` until it is placed here."""
from __future__ import annotations

import pytest

from vllm.entrypoints.openai import spyre_request_checks
from vllm.entrypoints.openai.protocol import (ChatCompletionRequest,
                                              CompletionRequest)
from vllm.sampling_params import RequestOutputKind

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}


def guided(attr):
    return lambda p: getattr(p.guided_decoding, attr, None)


#: field -> (value sent, what of the sampling parameters shows it, what
#: it must be).  Shared by both endpoints unless overridden below.
SAMPLING = {
    "n": (3, lambda p: p.n, 3),
    "best_of": (3, lambda p: p.best_of, 3),
    "frequency_penalty": (0.5, lambda p: p.frequency_penalty, 0.5),
    "presence_penalty": (0.25, lambda p: p.presence_penalty, 0.25),
    "repetition_penalty": (1.3, lambda p: p.repetition_penalty, 1.3),
    "temperature": (0.7, lambda p: p.temperature, 0.7),
    "top_p": (0.9, lambda p: p.top_p, 0.9),
    "top_k": (7, lambda p: p.top_k, 7),
    "min_p": (0.05, lambda p: p.min_p, 0.05),
    "seed": (1234, lambda p: p.seed, 1234),
    "stop": (["zz"], lambda p: p.stop, ["zz"]),
    "stop_token_ids": ([5, 6], lambda p: p.stop_token_ids, [5, 6]),
    "include_stop_str_in_output": (
        True, lambda p: p.include_stop_str_in_output, True),
    "ignore_eos": (True, lambda p: p.ignore_eos, True),
    "min_tokens": (3, lambda p: p.min_tokens, 3),
    "skip_special_tokens": (False, lambda p: p.skip_special_tokens, False),
    "spaces_between_special_tokens": (
        False, lambda p: p.spaces_between_special_tokens, False),
    "truncate_prompt_tokens": (
        5, lambda p: p.truncate_prompt_tokens, 5),
    "allowed_token_ids": ([1, 2, 3], lambda p: p.allowed_token_ids,
                          [1, 2, 3]),
    "logit_bias": ({"7": 3.0}, lambda p: p.logit_bias, {7: 3.0}),
    "bad_words": (["blue"], lambda p: p.bad_words, ["blue"]),
    "prompt_logprobs": (2, lambda p: p.prompt_logprobs, 2),
    "stream": (True, lambda p: p.output_kind, RequestOutputKind.DELTA),
    "guided_json": (SCHEMA, guided("json"), SCHEMA),
    "guided_regex": ("[a-z]+", guided("regex"), "[a-z]+"),
    "guided_choice": (["yes", "no"], guided("choice"), ["yes", "no"]),
    "guided_grammar": ('root ::= "a"', guided("grammar"), 'root ::= "a"'),
    "guided_decoding_backend": ("xgrammar", guided("backend"), "xgrammar"),
    # Refused by the engine's admission (spyre_structured_output): xgrammar
    # has no whitespace pattern; it must reach it to be refused there.
    "guided_whitespace_pattern": (r"[ ]?", guided("whitespace_pattern"),
                                  r"[ ]?"),
    "response_format": ({"type": "json_object"}, guided("json_object"),
                        True),
}
COMPLETION_SAMPLING = dict(
    SAMPLING,
    logprobs=(2, lambda p: p.logprobs, 2),
    # echo: the prompt's log-probabilities, as many as logprobs asks.
    echo=(True, lambda p: p.prompt_logprobs, None),
)
CHAT_SAMPLING = dict(
    SAMPLING,
    logprobs=(True, lambda p: p.logprobs, 0),
    top_logprobs=(2, lambda p: p.logprobs, None),
    echo=(True, lambda p: p.prompt_logprobs, None),
    structural_tag=('{"type": "structural_tag", "structures": [], '
                    '"triggers": []}', guided("structural_tag"),
                    '{"type": "structural_tag", "structures": [], '
                    '"triggers": []}'),
)
#: Fields the server reads itself, and what reads them.
SERVER_READ = {
    "model": "the served model's name, checked (404 otherwise)",
    "prompt": "the prompt, tokenized by the completion handler",
    "messages": "the chat handler, through the chat template",
    "max_tokens": "the handler's token budget, passed as max_tokens",
    "max_completion_tokens": "the chat handler's budget, before max_tokens",
    "stream_options": "the streaming generators (include_usage, "
                      "continuous_usage_stats)",
    "suffix": "the completion handler, which refuses it (HTTP 400)",
    "user": "nothing: informational, as in the OpenAI API",
    "use_beam_search": "the handlers' beam search path",
    "length_penalty": "the handlers' beam search path (refused without "
                      "use_beam_search)",
    "add_special_tokens": "the tokenizer call of the prompt",
    "priority": "the engine's scheduler, which refuses a non-zero value "
                "without --scheduling-policy priority",
    "request_id": "the request's id in the engine and the response",
    "return_tokens_as_token_ids": "the logprobs of the response",
    "cache_salt": "the request model's validator (V1 engine only)",
    "prompt_embeds": "the completion handler, refused on Spyre before the "
                     "prompt is read",
    "logits_processors": "get_logits_processors, which refuses them "
                         "without --logits-processor-pattern",
    "tools": "the chat handler: tool parsing and guided decoding",
    "tool_choice": "the chat handler: tool parsing and guided decoding",
    "parallel_tool_calls": "the chat handler",
    "reasoning_effort": "the chat template of harmony models (gpt-oss); "
                        "refused for other models",
    "include_reasoning": "the chat handler's reasoning parser",
    "add_generation_prompt": "the chat template",
    "continue_final_message": "the chat template",
    "documents": "the chat template",
    "chat_template": "the chat handler",
    "chat_template_kwargs": "the chat template",
    "mm_processor_kwargs": "the multimodal processor",
}
#: Fields nothing on this server acts on: refused, naming the field.
REFUSED = {"vllm_xargs": {"a": 1},
           "kv_transfer_params": {"do_remote_decode": True}}

ENDPOINTS = {
    "/v1/completions": (CompletionRequest, COMPLETION_SAMPLING),
    "/v1/chat/completions": (ChatCompletionRequest, CHAT_SAMPLING),
}
#: What a request needs beside the field under test.
COMPANIONS = {"best_of": {"n": 1}, "top_logprobs": {"logprobs": True},
              "echo": {"logprobs": 1},
              # Both qualify a guided form; alone they ask for nothing.
              "guided_decoding_backend": {"guided_regex": "[a-z]+"},
              "guided_whitespace_pattern": {"guided_json": SCHEMA}}


@pytest.fixture(autouse=True, scope="module")
def installed():
    spyre_request_checks.install()


def make(endpoint: str, **fields):
    cls = ENDPOINTS[endpoint][0]
    if cls is CompletionRequest:
        return cls(model="m", prompt="hi", **fields)
    return cls(model="m", messages=[{"role": "user", "content": "hi"}],
               **fields)


def params_of(request):
    return request.to_sampling_params(16, None, {})


@pytest.mark.parametrize("endpoint", sorted(ENDPOINTS))
def test_every_field_is_accounted_for(endpoint):
    cls, sampling = ENDPOINTS[endpoint]
    fields = set(cls.model_fields)
    placed = (set(sampling) | set(SERVER_READ) | set(REFUSED)) & fields
    assert fields - placed == set(), "fields placed nowhere"
    # bad_words: honoured on completions though vLLM's request lacks it.
    honoured = set(spyre_request_checks.HONOURED_EXTRA.get(cls.__name__, ()))
    assert set(sampling) - fields == honoured, "listed fields it lacks"


@pytest.mark.parametrize("endpoint, field", [
    (endpoint, field) for endpoint in sorted(ENDPOINTS)
    for field in sorted(ENDPOINTS[endpoint][1])])
def test_sampling_field_reaches_the_sampling_parameters(endpoint, field):
    value, read, expected = ENDPOINTS[endpoint][1][field]
    companions = COMPANIONS.get(field, {})
    if field == "echo" and endpoint == "/v1/chat/completions":
        companions = {"logprobs": True, "top_logprobs": 2}
    request = make(endpoint, **{field: value, **companions})
    got = read(params_of(request))
    if expected is None:  # echo, top_logprobs: the count logprobs asks
        expected = 1 if endpoint == "/v1/completions" else 2
    assert got == expected, (field, got)
    # The value came from the field, not from a default.
    assert read(params_of(make(endpoint, **companions))) != expected, field


@pytest.mark.parametrize("endpoint", sorted(ENDPOINTS))
@pytest.mark.parametrize("field", sorted(REFUSED))
def test_field_nothing_acts_on_is_refused(endpoint, field):
    with pytest.raises(ValueError, match=f"^{field}: "):
        params_of(make(endpoint, **{field: REFUSED[field]}))


@pytest.mark.parametrize("endpoint", sorted(ENDPOINTS))
def test_length_penalty_without_beam_search_is_refused(endpoint):
    with pytest.raises(ValueError, match=r"length_penalty=2.0 applies to "
                       "beam search only"):
        params_of(make(endpoint, length_penalty=2.0))
    # With beam search the handlers build beam search parameters from it.
    beam = make(endpoint, length_penalty=2.0, use_beam_search=True, n=2)
    assert beam.to_beam_search_params(16, {}).length_penalty == 2.0
    assert params_of(make(endpoint, length_penalty=1.0)).n == 1
