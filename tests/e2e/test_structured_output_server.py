"""Structured output through the OpenAI server, with the clients people
bring: the openai client's ``parse``, ``response_format``, the completions
API's ``guided_*`` fields, streaming and ``n``, tools with ``tool_choice``
(forced and auto), LangChain's ``with_structured_output``; a bad schema
is answered 400 while the server serves on.  The offline forms are
test_structured_output.py's."""
from __future__ import annotations

import json
import re

import pytest

from spyre_support.envs import spyre_env
from spyre_support.server import Server, openai_client
from structured_cases import CHOICES, MAX_NEW, REGEX, SCHEMA, check_schema


@pytest.fixture(scope="module")
def server(tiny_llama):
    with Server(tiny_llama, spyre_env("eager", [64], [MAX_NEW], [4]),
                args=("--guided-decoding-backend", "xgrammar",
                      "--guided-decoding-disable-any-whitespace",
                      "--enable-auto-tool-choice",
                      "--tool-call-parser", "llama3_json")) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


def chat(server, client, **kwargs):
    return client.chat.completions.create(
        model=server.model, temperature=0, max_tokens=MAX_NEW,
        messages=[{"role": "user", "content": "pick a color"}], **kwargs)


def test_openai_parse_with_a_pydantic_model(server, client):
    from typing import Literal

    from pydantic import BaseModel

    class Answer(BaseModel):
        color: Literal["red", "green", "blue"]
        ok: bool
        n: Literal[1, 2, 3]

    out = client.beta.chat.completions.parse(
        model=server.model, temperature=0, max_tokens=MAX_NEW,
        messages=[{"role": "user", "content": "pick a color"}],
        response_format=Answer)
    parsed = out.choices[0].message.parsed
    assert isinstance(parsed, Answer)


def test_response_format_json_schema_and_object(server, client):
    out = chat(server, client, response_format={
        "type": "json_schema",
        "json_schema": {"name": "answer", "schema": SCHEMA}})
    check_schema(out.choices[0].message.content)
    out = client.completions.create(
        model=server.model, prompt="the spyre card", temperature=0,
        max_tokens=MAX_NEW,
        extra_body=dict(response_format={"type": "json_object"}))
    assert isinstance(json.loads(out.choices[0].text), dict)


@pytest.mark.parametrize("extra, check", [
    (dict(guided_regex=REGEX), lambda t: re.fullmatch(REGEX, t)),
    (dict(guided_choice=CHOICES), lambda t: t in CHOICES),
    (dict(guided_json=SCHEMA), check_schema),
    (dict(guided_grammar='root ::= "yes" | "no"'),
     lambda t: t in ("yes", "no")),
])
def test_completions_guided_fields(server, client, extra, check):
    out = client.completions.create(model=server.model,
                                    prompt="the spyre card", temperature=0,
                                    max_tokens=MAX_NEW, extra_body=extra)
    assert check(out.choices[0].text)


def test_streaming_and_n(server, client):
    stream = client.completions.create(
        model=server.model, prompt="the spyre card", temperature=0,
        max_tokens=MAX_NEW, stream=True, extra_body=dict(guided_regex=REGEX))
    assert re.fullmatch(REGEX, "".join(c.choices[0].text for c in stream))
    out = client.completions.create(
        model=server.model, prompt="the spyre card", temperature=1.5,
        seed=4, n=3, max_tokens=MAX_NEW, extra_body=dict(guided_regex=REGEX))
    assert all(re.fullmatch(REGEX, c.text) for c in out.choices)


LIGHT = {
    "type": "object",
    "properties": {"color": {"enum": ["red", "green", "blue"]}},
    "required": ["color"],
    "additionalProperties": False,
}
TOOL = {
    "type": "function",
    "function": {
        "name": "set_light",
        "description": "Sets the light",
        "parameters": LIGHT,
    },
}


@pytest.mark.parametrize("tool_choice", [
    "required", {"type": "function", "function": {"name": "set_light"}},
])
def test_forced_tool_calls_have_valid_arguments(server, client, tiny_llama,
                                                tool_choice):
    """``required`` asks for a list of one or more calls; a trained model
    closes it after one, the random one here needs a bias towards ``]``
    (among the tokens the grammar allows) to do the same."""
    from transformers import AutoTokenizer
    close = AutoTokenizer.from_pretrained(tiny_llama).convert_tokens_to_ids(
        "]")
    out = chat(server, client, tools=[TOOL], tool_choice=tool_choice,
               logit_bias={str(close): 20})
    calls = out.choices[0].message.tool_calls
    assert calls and calls[0].function.name == "set_light"
    arguments = json.loads(calls[0].function.arguments)
    assert list(arguments) == ["color"]
    assert arguments["color"] in ("red", "green", "blue")


#: A call in the format of ``--tool-call-parser llama3_json``.
LLAMA3_CALL = {
    "type": "object",
    "properties": {"name": {"enum": ["set_light"]}, "parameters": LIGHT},
    "required": ["name", "parameters"],
    "additionalProperties": False,
}


def check_call(name: str, arguments: str) -> None:
    assert name == "set_light"
    assert json.loads(arguments)["color"] in ("red", "green", "blue")


@pytest.mark.parametrize("stream", [False, True])
def test_auto_tool_choice_parses_the_models_call(server, client, stream):
    """``--enable-auto-tool-choice --tool-call-parser llama3_json`` and
    ``tool_choice: "auto"``: the model decides, and a reply in the parser's
    format comes back as ``tool_calls``.  A trained model writes that
    format itself; the random one here is held to it by ``guided_json``."""
    kwargs = dict(tools=[TOOL], tool_choice="auto",
                  extra_body=dict(guided_json=LLAMA3_CALL))
    if not stream:
        out = chat(server, client, **kwargs).choices[0]
        assert out.finish_reason == "tool_calls"
        assert not out.message.content
        (call, ) = out.message.tool_calls
        check_call(call.function.name, call.function.arguments)
        return
    name, arguments, finish = None, "", None
    for chunk in chat(server, client, stream=True, **kwargs):
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        for delta in choice.delta.tool_calls or []:
            assert delta.index == 0
            name = delta.function.name or name
            arguments += delta.function.arguments or ""
        finish = choice.finish_reason or finish
    assert finish == "tool_calls"
    check_call(name, arguments)


def test_auto_tool_choice_lets_plain_text_through(server, client):
    out = chat(server, client, tools=[TOOL], tool_choice="auto",
               extra_body=dict(guided_regex=REGEX)).choices[0]
    assert not out.message.tool_calls
    assert re.fullmatch(REGEX, out.message.content)


def test_langchain_with_structured_output(server):
    from typing import Literal

    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel

    class Answer(BaseModel):
        color: Literal["red", "green", "blue"]
        ok: bool
        n: Literal[1, 2, 3]

    model = ChatOpenAI(base_url=server.url + "/v1", api_key="unused",
                       model=server.model, temperature=0,
                       max_tokens=MAX_NEW)
    answer = model.with_structured_output(
        Answer, method="json_schema").invoke("pick a color")
    assert isinstance(answer, Answer)


def test_bad_schema_is_400_and_the_server_serves_on(server, client):
    import openai
    with pytest.raises(openai.BadRequestError, match="Guided decoding"):
        client.completions.create(model=server.model, prompt="x",
                                  max_tokens=4,
                                  extra_body=dict(guided_regex="(["))
    out = client.completions.create(model=server.model, prompt="x",
                                    temperature=0, max_tokens=MAX_NEW,
                                    extra_body=dict(guided_regex=REGEX))
    assert re.fullmatch(REGEX, out.choices[0].text)
