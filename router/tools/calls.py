"""A call object as models write them ({"name": ..., "arguments": {...}}) read into a
(name, arguments JSON) pair; the shared piece of every format's decoder."""

from __future__ import annotations

import json
from typing import Any

from router.tools.tagged import Call


def read_call(value: Any, arguments_keys: tuple[str, ...] = ("arguments",)) -> Call | None:
    """(name, arguments as JSON text) of a call object; None if it is not one: a name that
    is a non-empty string, arguments (under the first of `arguments_keys` present) an
    object or a string holding one, or absent (no arguments)."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    name = value["name"]
    key = next((k for k in arguments_keys if k in value), None)
    arguments = {} if key is None else value[key]
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not name or not isinstance(arguments, dict):
        return None
    return name, json.dumps(arguments, ensure_ascii=False)


def json_values(text: str, separators: str = "") -> list[Any] | None:
    """The JSON values `text` holds one after another (whitespace, or any of
    `separators`, between them); None if anything else is there or there is none."""
    decoder, values, at = json.JSONDecoder(), [], 0
    while True:
        while at < len(text) and (text[at].isspace() or text[at] in separators):
            at += 1
        if at == len(text):
            return values or None
        try:
            value, at = decoder.raw_decode(text, at)
        except ValueError:
            return None
        values.append(value)
