"""Llama 3.1+ JSON calls: the whole answer is the call, `{"name": ..., "parameters":
{...}}` (after `<|python_tag|>`, a special token the detokenizer drops), several of them
separated by `;`. An answer that begins with `{` is held to its end to be read."""

from __future__ import annotations

import json

from router.tools.calls import json_values, read_call
from router.tools.tagged import Call, CallFormat


def decode(body: str) -> list[Call] | None:
    values = json_values(body, separators=";")
    if values is None:
        return None
    calls = [read_call(v, ("parameters", "arguments")) for v in values]
    return None if any(c is None for c in calls) else calls  # type: ignore[return-value]


def wrap(name: str) -> tuple[str, str]:
    """A strict call of `name` as Llama 3.1's template writes one, around its arguments."""
    return f'{{"name": {json.dumps(name)}, "parameters": ', "}"


LLAMA3_JSON = CallFormat(
    "llama3_json",
    "{",
    None,
    decode,
    anchored=True,
    start_in_body=True,
    wrap=wrap,
    trigger='{"name": ',
)
