"""``vllm.entrypoints.openai.spyre_request_checks`` on the request models
themselves (the server end to end: tests/e2e/test_hostile_requests_server.py):
``bad_words`` reaches the completion's sampling parameters, a field an
endpoint does not take is a ``ValueError`` naming it, and a schema nested
too deep to pickle is refused before anything tries."""
from __future__ import annotations

import pytest

from vllm.entrypoints.openai import spyre_request_checks
from vllm.entrypoints.openai.protocol import (ChatCompletionRequest,
                                              CompletionRequest)


@pytest.fixture(autouse=True, scope="module")
def installed():
    spyre_request_checks.install()
    spyre_request_checks.install()  # a second load changes nothing


def completion(**fields) -> CompletionRequest:
    return CompletionRequest(model="m", prompt="hi", **fields)


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(
        model="m", messages=[{"role": "user", "content": "hi"}], **fields)


def completion_params(request):
    return request.to_sampling_params(16, None, {})


def chat_params(request):
    return request.to_sampling_params(16, None, {})


def nested(levels: int) -> dict:
    schema = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def test_bad_words_reach_a_completion():
    params = completion_params(completion(bad_words=["blue", "sky"]))
    assert params.bad_words == ["blue", "sky"]
    assert completion_params(completion()).bad_words == []
    with pytest.raises(ValueError, match="bad_words must be a list"):
        completion_params(completion(bad_words="blue"))
    # The chat request declares it: passed on as upstream does.
    assert chat_params(chat(bad_words=["blue"])).bad_words == ["blue"]


@pytest.mark.parametrize("make, params, endpoint", [
    (completion, completion_params, "/v1/completions"),
    (chat, chat_params, "/v1/chat/completions"),
])
def test_fields_an_endpoint_lacks_are_refused(make, params, endpoint):
    with pytest.raises(ValueError) as e:
        params(make(colour="blue", temprature=0.5))
    assert str(e.value).startswith("colour, temprature: not a field of "
                                   f"{endpoint}")
    with pytest.raises(ValueError, match="remove it"):
        params(make(colour="blue"))


def test_a_schema_too_deep_to_pickle_is_refused_first():
    """Nested 300 objects deep: refused here, in the API server (passing
    it to the engine pickled it, over Python's recursion limit in the
    server's deeper stack: an HTTP 500 before)."""
    deep = nested(300)
    for request, params in ((completion(guided_json=deep),
                             completion_params),
                            (chat(guided_json=deep), chat_params)):
        with pytest.raises(ValueError, match="VLLM_SPYRE_GUIDED_MAX_DEPTH"):
            params(request)


def test_limits_apply_to_every_guided_form():
    with pytest.raises(ValueError, match="minLength"):
        chat_params(chat(response_format=dict(
            type="json_schema", json_schema=dict(
                name="s", schema={"type": "string", "minLength": 10**6}))))
    with pytest.raises(ValueError, match="guided_regex"):
        completion_params(completion(guided_regex="a{1000000}"))
    # Within the limits: the parameters upstream builds.
    params = completion_params(completion(guided_json={"enum": ["a", "b"]}))
    assert params.guided_decoding.json == {"enum": ["a", "b"]}
