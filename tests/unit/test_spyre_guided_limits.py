"""``vllm.engine.spyre_guided_limits``: a structured-output request that
would unroll too many repetitions, nest too deep or weigh too much is
refused with the field, its value and the setting named; what stays
within the limits passes.  The settings themselves are parsed by
``SpyreConfig`` and refused when malformed."""
from __future__ import annotations

import json
import re

import pytest

from vllm.config.spyre import SpyreConfig
from vllm.engine.spyre_guided_limits import (GuidedLimits, check,
                                             check_regex, check_schema)
from vllm.sampling_params import GuidedDecodingParams

from spyre_env import no_sendnn  # noqa: F401 (fixture)

LIMITS = GuidedLimits(max_repeat=4096, max_depth=64, max_bytes=1 << 20)


def nested(levels: int) -> dict:
    schema = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


@pytest.mark.parametrize("regex", [
    r"[a-c]{3}-\d{2}", "a{4096}", "(ab){2048}", "(a{64}){64}", "(a+)+$",
    r"\{99999\}", "[{]99999}", "x{2,}", "((a{4}){4}){256}",
])
def test_regexes_within_the_limit_pass(regex):
    check_regex("guided_regex", regex, LIMITS)


@pytest.mark.parametrize("regex, quantifier, total", [
    ("a{1000000}", "{1000000}", "1,000,000"),
    ("x{2,5000}", "{2,5000}", "5,000"),
    ("(a{1000}){1000}", "{1000}", "1,000,000"),
    ("((a{10}){10}){100}", "{100}", "10,000"),
    ("b{4097,}", "{4097,}", "4,097"),
])
def test_regex_repetitions_over_the_limit_are_refused(regex, quantifier,
                                                      total):
    with pytest.raises(ValueError) as e:
        check_regex("guided_regex", regex, LIMITS)
    message = str(e.value)
    for part in ("guided_regex", repr(quantifier), total,
                 "VLLM_SPYRE_GUIDED_MAX_REPEAT=4096"):
        assert part in message, message


@pytest.mark.parametrize("schema, where, value", [
    ({"type": "string", "minLength": 1000000}, "$.minLength", "1,000,000"),
    ({"type": "string", "maxLength": 5000}, "$.maxLength", "5,000"),
    ({"type": "array", "minItems": 100000}, "$.minItems", "100,000"),
    ({"type": "object", "properties": {"tags": {
        "type": "array", "maxItems": 4097}}}, "$.properties.tags.maxItems",
     "4,097"),
])
def test_schema_repetitions_over_the_limit_are_refused(schema, where, value):
    with pytest.raises(ValueError) as e:
        check_schema("guided_json", schema, LIMITS)
    message = str(e.value)
    for part in ("guided_json", where, value,
                 "VLLM_SPYRE_GUIDED_MAX_REPEAT=4096"):
        assert part in message, message


def test_a_pattern_inside_a_schema_is_checked_as_a_regex():
    schema = {"properties": {"code": {"type": "string",
                                      "pattern": "(x{100}){100}"}}}
    with pytest.raises(ValueError, match=r"\$\.properties\.code\.pattern"):
        check_schema("guided_json", schema, LIMITS)


def test_depth_is_bounded_without_recursion():
    check_schema("guided_json", nested(31), LIMITS)  # 62 levels
    with pytest.raises(ValueError) as e:
        check_schema("guided_json", nested(300), LIMITS)
    assert "VLLM_SPYRE_GUIDED_MAX_DEPTH=64" in str(e.value)
    assert "nest 65 deep" in str(e.value)
    # Far deeper than Python's recursion limit: still a clean refusal.
    deep: list = []
    for _ in range(100000):
        deep = [deep]
    with pytest.raises(ValueError, match="VLLM_SPYRE_GUIDED_MAX_DEPTH"):
        check_schema("guided_json", deep, LIMITS)


def test_schema_text_is_measured_before_it_is_parsed():
    text = "[" * 100000 + "]" * 100000
    guided = GuidedDecodingParams(json=text)
    with pytest.raises(ValueError, match="guided_json: objects and arrays "
                       "nest 99999 deep"):
        check(guided, LIMITS)
    with pytest.raises(ValueError, match="not valid JSON"):
        check(GuidedDecodingParams(json="{"), LIMITS)
    with pytest.raises(ValueError, match="not valid JSON"):
        check(GuidedDecodingParams(json=""), LIMITS)


@pytest.mark.parametrize("guided, field", [
    (dict(json={"enum": ["v" * 1000] * 2000}), "guided_json"),
    (dict(json=json.dumps({"enum": ["v" * 1000] * 2000})), "guided_json"),
    (dict(regex="a" * (2 << 20)), "guided_regex"),
    (dict(choice=["c" * 1000] * 2000), "guided_choice"),
    (dict(grammar="root ::= " + '"a"' * 400000), "guided_grammar"),
])
def test_size_over_the_limit_is_refused(guided, field):
    with pytest.raises(ValueError) as e:
        check(GuidedDecodingParams(**guided), LIMITS)
    assert e.value.args[0].startswith(field)
    assert "VLLM_SPYRE_GUIDED_MAX_BYTES=1048576" in str(e.value)


@pytest.mark.parametrize("guided, field", [
    (dict(choice=[]), "guided_choice is empty"),
    (dict(regex=""), "guided_regex is empty"),
    (dict(grammar=""), "guided_grammar is empty"),
    (dict(grammar=" \n "), "guided_grammar is empty"),
    (dict(json=""), "guided_json is not valid JSON"),
])
def test_empty_constraints_are_refused(guided, field):
    with pytest.raises(ValueError, match=field):
        check(GuidedDecodingParams(**guided), LIMITS)


def test_grammar_and_structural_tag_repetitions_are_checked():
    with pytest.raises(ValueError, match=re.escape("guided_grammar: '{9000}'")):
        check(GuidedDecodingParams(grammar='root ::= "a"{9000}'), LIMITS)
    tag = json.dumps({"structures": [{"begin": "<f>", "end": "</f>",
                                      "schema": {"type": "string",
                                                 "minLength": 10000}}],
                      "triggers": ["<f>"]})
    with pytest.raises(ValueError, match=r"structural_tag: \$\.structures"):
        check(GuidedDecodingParams(structural_tag=tag), LIMITS)


def test_ordinary_requests_pass():
    check(None, LIMITS)
    for guided in (dict(json={"type": "object", "properties": {
            "name": {"type": "string", "maxLength": 200},
            "tags": {"type": "array", "items": {"type": "string"},
                     "maxItems": 10}}}),
                   dict(json='{"type": "integer"}'), dict(json={}),
                   dict(regex=r"\d{3}-\d{4}"), dict(choice=["yes", "no"]),
                   dict(grammar='root ::= "a" | "b"'),
                   dict(json_object=True)):
        check(GuidedDecodingParams(**guided), LIMITS)


def test_limits_come_from_the_settings(no_sendnn):
    config = SpyreConfig.from_env(environ={
        "VLLM_SPYRE_GUIDED_MAX_REPEAT": "100",
        "VLLM_SPYRE_GUIDED_MAX_DEPTH": "8",
        "VLLM_SPYRE_GUIDED_MAX_BYTES": "5000",
        "VLLM_SPYRE_GUIDED_COMPILE_TIMEOUT_S": "2.5"})
    assert GuidedLimits.from_config(config) == GuidedLimits(100, 8, 5000)
    assert config.guided_compile_timeout_s == 2.5
    default = SpyreConfig.from_env(environ={})
    assert GuidedLimits.from_config(default) == LIMITS
    assert default.guided_compile_timeout_s == 10.0
    # Carried to the engine with the rest of the settings.
    assert SpyreConfig.from_dict(config.to_dict()) == config


@pytest.mark.parametrize("var, raw", [
    ("VLLM_SPYRE_GUIDED_MAX_REPEAT", "0"),
    ("VLLM_SPYRE_GUIDED_MAX_DEPTH", "-3"),
    ("VLLM_SPYRE_GUIDED_MAX_BYTES", "1MB"),
    ("VLLM_SPYRE_GUIDED_COMPILE_TIMEOUT_S", "0"),
    ("VLLM_SPYRE_GUIDED_COMPILE_TIMEOUT_S", "soon"),
    ("VLLM_SPYRE_GUIDED_COMPILE_TIMEOUT_S", "nan"),
])
def test_malformed_limits_are_refused(no_sendnn, var, raw):
    with pytest.raises(ValueError) as e:
        SpyreConfig.from_env(environ={var: raw})
    assert f"{var}={raw!r}" in str(e.value)
