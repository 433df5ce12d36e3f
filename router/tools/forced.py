"""tool_choice `required` or a named function: the JSON schema the output is decoded
under (the replica's structured-output grammar), and how that output reads as calls;
and `auto` with strict tools: the structural tag that constrains a call's arguments once
the model starts one in its template's format.

Whatever the template's own call format, a forced choice is decoded as plain JSON (as
vLLM does): a named function's output is its arguments object, validated by the tool's
schema; `required`'s is a list of {"name", "arguments"} objects, each name one of the
tools and its arguments that tool's schema (one item when parallel_tool_calls is false).
The grammar makes the output a call that parses; only max_tokens can cut it short.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from router.tools.events import CallArguments, CallStart, Event

ANY_OBJECT: Mapping[str, Any] = {"type": "object"}


def arguments_schema(parameters: Mapping[str, Any] | None) -> dict[str, Any]:
    """A tool's parameters schema (an object of anything when it declares none)."""
    return dict(parameters if parameters is not None else ANY_OBJECT)


def named_schema(parameters: Mapping[str, Any] | None) -> str:
    """The schema of a named function's output: its arguments."""
    return json.dumps(arguments_schema(parameters))


def required_schema(
    tools: Sequence[tuple[str, Mapping[str, Any] | None]], parallel: bool = True
) -> str:
    """The schema of `required`'s output: a list of calls of `tools` ((name, parameters)
    pairs), at least one, at most one unless `parallel`."""
    items = [
        {
            "type": "object",
            "properties": {"name": {"enum": [name]}, "arguments": arguments_schema(params)},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for name, params in tools
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    return json.dumps(schema)


def strict_tag(
    wrap: Callable[[str], tuple[str, str]],
    trigger: str,
    tools: Sequence[tuple[str, Mapping[str, Any] | None, bool]],
) -> str | None:
    """xgrammar's structural tag for `auto` calls when some tool is strict ((name,
    parameters, strict) triples): text is free until `trigger`, then a call of one of the
    tools as `wrap` writes it, a strict tool's arguments under its schema (the others' any
    object). None when no tool is strict."""
    if not any(strict for _, _, strict in tools):
        return None
    tags = []
    for name, params, strict in tools:
        begin, end = wrap(name)
        schema = arguments_schema(params) if strict else dict(ANY_OBJECT)
        content = {"type": "json_schema", "json_schema": schema}
        tags.append({"type": "tag", "begin": begin, "content": content, "end": end})
    fmt = {"type": "triggered_tags", "triggers": [trigger], "tags": tags}
    return json.dumps({"type": "structural_tag", "format": fmt})


class NamedCallParser:
    """A named function's output: one call, its arguments streamed as they come."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._started = False

    def feed(self, text: str) -> list[Event]:
        events: list[Event] = [] if self._started else [CallStart(self.name)]
        self._started = True
        return events + ([CallArguments(text)] if text else [])

    def finish(self) -> list[Event]:
        return self.feed("")


class RequiredCallsParser:
    """`required`'s output, a JSON list of calls: each call once its object is whole (an
    object cut short by max_tokens is dropped)."""

    def __init__(self) -> None:
        self._text = ""
        self._at = 0  # scanned up to here
        self._depth = 0
        self._in_string = self._escaped = False
        self._item = -1  # where the current item object began

    def feed(self, text: str) -> list[Event]:
        self._text += text
        events: list[Event] = []
        for i in range(self._at, len(self._text)):
            char = self._text[i]
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif char == "\\":
                    self._escaped = True
                elif char == '"':
                    self._in_string = False
            elif char == '"':
                self._in_string = True
            elif char in "[{":
                self._depth += 1
                if self._depth == 2:
                    self._item = i
            elif char in "]}":
                self._depth -= 1
                if self._depth == 1 and self._item >= 0:
                    events += _call(self._text[self._item : i + 1])
                    self._item = -1
        self._at = len(self._text)
        return events

    def finish(self) -> list[Event]:
        return []


def _call(item: str) -> list[Event]:
    try:
        value = json.loads(item)
        name, arguments = value["name"], value["arguments"]
    except (ValueError, KeyError, TypeError):
        return []  # not what the grammar writes: no call rather than a half one
    return [CallStart(name), CallArguments(json.dumps(arguments, ensure_ascii=False))]
