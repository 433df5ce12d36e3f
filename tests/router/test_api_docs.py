"""docs/serving/api.md's request field table says what the request models do: every field
they declare is in it, those accepting only their "off" values (or none) in the rows that
say so, the fields honoured in the others."""

from __future__ import annotations

import re
from pathlib import Path
from types import NoneType

import pytest
from pydantic import BaseModel

from router.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    LoadLoRAAdapterRequest,
    UnloadLoRAAdapterRequest,
)
from router.responses_api.request import ResponsesRequest

API_DOC = Path(__file__).parents[2] / "docs" / "serving" / "api.md"
NOT_SERVED_ROWS = ("| off values only |", "| refused with a 400 |")


def _names(rows: list[str]) -> set[str]:
    """Backticked field names in `rows`, with each dotted name's prefixes (text.format:
    text too)."""
    names = set()
    for row in rows:
        for name in re.findall(r"`([a-z_][a-z_.]*)`", row):
            parts = name.split(".")
            names.update(".".join(parts[: i + 1]) for i in range(len(parts)))
    return names


def _table() -> tuple[set[str], set[str]]:
    """(names in the rows of fields served, names in the rows of those not served)."""
    text = API_DOC.read_text()
    section = text.split("## Request fields\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    not_served = [line for line in section.splitlines() if line.startswith(NOT_SERVED_ROWS)]
    assert rows and len(not_served) == len(NOT_SERVED_ROWS)
    return _names(rows), _names(not_served)


def _not_served(model: type[BaseModel], name: str) -> bool:
    accepted = getattr(model, "_ACCEPTED", {})
    return name in accepted or model.model_fields[name].annotation is NoneType


@pytest.mark.parametrize(
    "model",
    [
        CompletionRequest,
        ChatCompletionRequest,
        ResponsesRequest,
        LoadLoRAAdapterRequest,
        UnloadLoRAAdapterRequest,
    ],
)
def test_the_field_table_says_what_each_field_does(model):
    served, not_served = _table()
    for name, field in model.model_fields.items():
        wire = field.alias or name
        rows = not_served if _not_served(model, name) else served
        assert wire in rows, f"{model.__name__}.{wire} is not in api.md's table where it belongs"
