"""Size limits of a structured-output request, checked before anything
compiles its grammar.

xgrammar, which serves guided decoding (``spyre_structured_output``),
unrolls every bounded repetition into one grammar element per repeat and
computes a token mask for each over the whole vocabulary: a
``{"type": "string", "minLength": 1000000}`` schema, ``minItems: 100000``
or a regex ``a{1000000}`` keeps a core busy for many minutes and cannot be
cancelled.  A schema nested a few hundred objects deep cannot even be
passed from the API server to the engine (pickling it exceeds Python's
recursion limit).  ``check`` refuses such a request with a ``ValueError``
(an HTTP 400 through the OpenAI server) naming the field, its value and
the setting that bounds it:

* ``max_repeat``: the largest repetition a grammar may unroll: a string's
  ``minLength``/``maxLength``, an array's ``minItems``/``maxItems``, a regex
  ``{n}``, ``{n,}`` or ``{n,m}`` (nested regex repetitions multiply);
* ``max_depth``: how deep objects and arrays of a schema may nest;
* ``max_bytes``: the size of a schema, regex, grammar or choice list.

Every walk here is iterative: a request cannot exhaust the stack.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Iterator

#: Schema keywords that xgrammar unrolls into that many elements.
REPEAT_KEYWORDS = ("minLength", "maxLength", "minItems", "maxItems")


@dataclass(frozen=True)
class GuidedLimits:
    """The bounds ``check`` applies, each named by its setting."""

    max_repeat: int
    max_depth: int
    max_bytes: int

    @classmethod
    def from_config(cls, config) -> "GuidedLimits":
        """The limits a ``SpyreConfig`` holds."""
        return cls(max_repeat=config.guided_max_repeat,
                   max_depth=config.guided_max_depth,
                   max_bytes=config.guided_max_bytes)


def check(guided: Any, limits: GuidedLimits) -> None:
    """Refuses (``ValueError``) the ``GuidedDecodingParams`` ``guided``
    when it asks for more than ``limits`` allow."""
    if guided is None:
        return
    if guided.json is not None:
        schema = guided.json
        if isinstance(schema, str):
            _check_bytes("guided_json", len(schema.encode()), limits)
            schema = _parse_json("guided_json", schema, limits)
        check_schema("guided_json", schema, limits)
    if guided.regex is not None:
        if not guided.regex:
            # xgrammar 0.1.21's compiler crashes on it (SIGSEGV).
            raise ValueError("guided_regex is empty: it would allow only "
                             "the empty answer")
        _check_bytes("guided_regex", len(guided.regex.encode()), limits)
        check_regex("guided_regex", guided.regex, limits)
    if guided.grammar is not None:
        if not guided.grammar.strip():
            raise ValueError("guided_grammar is empty: a grammar needs at "
                             "least its root rule")
        _check_bytes("guided_grammar", len(guided.grammar.encode()), limits)
        check_regex("guided_grammar", guided.grammar, limits)
    if guided.choice is not None:
        if not guided.choice:
            raise ValueError("guided_choice is empty: no text could follow "
                             "it; give at least one choice")
        _check_bytes("guided_choice",
                     sum(len(str(c).encode()) for c in guided.choice), limits)
    if guided.structural_tag is not None:
        _check_bytes("structural_tag", len(guided.structural_tag.encode()),
                     limits)
        tag = _parse_json("structural_tag", guided.structural_tag, limits)
        check_schema("structural_tag", tag, limits)


def check_schema(field: str, schema: Any, limits: GuidedLimits) -> None:
    """A JSON schema (or any JSON value holding schemas): nesting depth,
    size, repetition keywords and ``pattern`` regexes."""
    size = 0
    for path, node, depth in _walk(schema):
        if depth > limits.max_depth:
            raise ValueError(
                f"{field}: objects and arrays nest {depth} deep at "
                f"{_where(path)}, deeper than VLLM_SPYRE_GUIDED_MAX_DEPTH="
                f"{limits.max_depth}")
        if isinstance(node, str):
            size += len(node.encode())
        elif not isinstance(node, (dict, list)):
            size += 8
        if isinstance(node, dict):
            size += sum(len(str(k).encode()) for k in node)
            for key in REPEAT_KEYWORDS:
                value = node.get(key)
                if (isinstance(value, (int, float))
                        and not isinstance(value, bool)
                        and value > limits.max_repeat):
                    raise ValueError(
                        f"{field}: {_where(path + [key])} = {value:,} "
                        f"unrolls into more repetitions than "
                        f"VLLM_SPYRE_GUIDED_MAX_REPEAT={limits.max_repeat} "
                        "allows")
            if isinstance(node.get("pattern"), str):
                check_regex(f"{field}: {_where(path + ['pattern'])}",
                            node["pattern"], limits)
        if size > limits.max_bytes:
            raise ValueError(
                f"{field}: the schema is larger than "
                f"VLLM_SPYRE_GUIDED_MAX_BYTES={limits.max_bytes} bytes")


def check_regex(field: str, text: str, limits: GuidedLimits) -> None:
    """Bounded repetitions of a regex (or of an EBNF grammar, which
    writes them the same way): each ``{n}``, ``{n,}`` or ``{n,m}``,
    multiplied by the repetitions of the groups around it, must stay
    within ``max_repeat``."""
    # Per open group, the largest repetition unrolled inside it so far;
    # ``last`` is that of the atom a quantifier would repeat (1 for a
    # character or class, the group's own for a group, 0 for none).
    stack = [1]
    last = 0
    i = 0
    while i < len(text):
        c = text[i]
        if c == "\\":
            i += 2
            last = 1
            continue
        if c == "[":
            j = i + 1
            while j < len(text) and text[j] != "]":
                j += 2 if text[j] == "\\" else 1
            i = j + 1
            last = 1
            continue
        if c == "{":
            j = text.find("}", i)
            bound = _repeat_bound(text[i + 1:j]) if j > i else None
            if bound is not None and last:
                total = bound * last
                if total > limits.max_repeat:
                    raise ValueError(
                        f"{field}: {text[i:j + 1]!r} unrolls into {total:,} "
                        f"repetitions, more than "
                        f"VLLM_SPYRE_GUIDED_MAX_REPEAT={limits.max_repeat} "
                        "allows")
                stack[-1] = max(stack[-1], total)
                last = 0
                i = j + 1
                continue
            last = 1
        elif c == "(":
            stack.append(1)
            last = 0
        elif c == ")" and len(stack) > 1:
            last = stack.pop()
            stack[-1] = max(stack[-1], last)
        elif c in "|*+?":
            last = 0
        else:
            last = 1
        i += 1


def _repeat_bound(inside: str):
    """The largest count of ``{n}``, ``{n,}`` or ``{n,m}`` (``{n,}``
    unrolls ``n`` copies before its star), or None if it is not one."""
    parts = inside.replace(" ", "").split(",")
    if len(parts) > 2 or not all(p.isdigit() for p in parts if p) \
            or not parts[0]:
        return None
    return max(int(p) for p in parts if p)


def _walk(value: Any) -> Iterator[tuple[list, Any, int]]:
    """(path, node, depth) of every node, depth counting the objects and
    arrays around it, without recursion."""
    stack = [([], value, 0)]
    while stack:
        path, node, depth = stack.pop()
        yield path, node, depth
        if isinstance(node, dict):
            stack.extend((path + [k], v, depth + 1) for k, v in node.items())
        elif isinstance(node, list):
            stack.extend((path + [i], v, depth + 1)
                         for i, v in enumerate(node))


def _parse_json(field: str, text: str, limits: GuidedLimits) -> Any:
    depth = deepest = 0
    in_string = escaped = False
    for c in text:
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        elif c in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif c in "]}":
            depth -= 1
    if deepest > limits.max_depth + 1:
        raise ValueError(
            f"{field}: objects and arrays nest {deepest - 1} deep, deeper "
            f"than VLLM_SPYRE_GUIDED_MAX_DEPTH={limits.max_depth}")
    try:
        return json.loads(text)
    except ValueError as e:
        raise ValueError(f"{field} is not valid JSON: {e}") from e


def _check_bytes(field: str, size: int, limits: GuidedLimits) -> None:
    if size > limits.max_bytes:
        raise ValueError(
            f"{field} is {size:,} bytes, more than "
            f"VLLM_SPYRE_GUIDED_MAX_BYTES={limits.max_bytes}")


def _where(path: list) -> str:
    """A JSONPath of ``path``, its middle elided past eight steps."""
    steps = [f"[{p}]" if isinstance(p, int) else f".{p}" for p in path]
    if len(steps) > 8:
        steps = steps[:4] + [".(...)"] + steps[-4:]
    return "$" + "".join(steps)
