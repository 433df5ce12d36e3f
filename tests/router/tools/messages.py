"""Messages the parser tests expect: what a parser makes of streamed output."""

from __future__ import annotations

import json

from router.tools.events import StreamParser
from router.tools.message import MessageAssembler


def read(parser: StreamParser, pieces: list[str], parallel: bool = True) -> dict:
    """Return the message `pieces` (the output, as it streams) make; call ids left out."""
    message = MessageAssembler(parser, parallel)
    for piece in pieces:
        message.feed(piece)
    message.finish()
    whole = message.message()
    whole["tool_calls"] = [
        (c["function"]["name"], c["function"]["arguments"]) for c in whole["tool_calls"]
    ]
    return whole


def answer(content=None, calls=(), reasoning=None) -> dict:
    """Return an assistant message as `read` returns it."""
    return {
        "role": "assistant",
        "content": content,
        "reasoning_content": reasoning,
        "tool_calls": list(calls),
    }


def args(**values) -> str:
    """Return a call's arguments as JSON text."""
    return json.dumps(values)
