"""Hermes calls, as Qwen2.5, Qwen3 and Qwen3.5 templates write them: each call a JSON
object in its own block, `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`,
anywhere in the answer."""

from __future__ import annotations

import json

from router.tools.calls import json_values, read_call
from router.tools.tagged import Call, CallFormat


def decode(body: str) -> list[Call] | None:
    values = json_values(body)
    if values is None or len(values) != 1:
        return None
    call = read_call(values[0])
    return None if call is None else [call]


def wrap(name: str) -> tuple[str, str]:
    """A strict call of `name` as Qwen's templates write one, around its arguments."""
    return f'<tool_call>\n{{"name": {json.dumps(name)}, "arguments": ', "}\n</tool_call>"


HERMES = CallFormat(
    "hermes", "<tool_call>", "</tool_call>", decode, wrap=wrap, trigger="<tool_call>"
)
