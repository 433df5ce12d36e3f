"""Mistral calls: `[TOOL_CALLS]` (a special token, so the text is decoded keeping special
tokens) then, to the end of the answer, either a JSON list of `{"name", "arguments"}`
(v0.3 templates) or, in newer ones, `name[ARGS]{...}` per call, each after its own
`[TOOL_CALLS]`."""

from __future__ import annotations

from router.tools.calls import json_values, read_call
from router.tools.tagged import Call, CallFormat

START = "[TOOL_CALLS]"
ARGS = "[ARGS]"


def decode(body: str) -> list[Call] | None:
    if ARGS in body:
        return _named(body)
    values = json_values(body)
    if values is None or len(values) != 1 or not isinstance(values[0], list) or not values[0]:
        return None
    calls = [read_call(v) for v in values[0]]
    return None if any(c is None for c in calls) else calls  # type: ignore[return-value]


def _named(body: str) -> list[Call] | None:
    calls = []
    for part in body.split(START):
        name, sep, arguments = part.partition(ARGS)
        values = json_values(arguments) if sep else None
        call = read_call({"name": name.strip(), "arguments": values[0]}) if values else None
        if call is None or len(values) != 1:
            return None
        calls.append(call)
    return calls


MISTRAL = CallFormat("mistral", START, None, decode, special_tokens=True)
