"""Thinking split from the answer; forced tool choices' schemas (they validate what they
must) and their output read as calls, whole and streamed."""

from __future__ import annotations

import json

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.tools.events import Reasoning, Text
from router.tools.forced import NamedCallParser, RequiredCallsParser, named_schema, required_schema
from router.tools.reasoning import ThinkParser
from tests.router.tools.messages import answer, read

THINKING = [
    # (prompt opened <think>, output, reasoning, content)
    (False, "<think>\nhmm\n</think>\n\nParis.", "\nhmm\n", "Paris."),
    (False, "  <think>a</think>b", "a", "b"),
    (False, "Paris.", None, "Paris."),
    (False, "<thin", None, "<thin"),
    (False, "<think>cut sho", "cut sho", None),  # max_tokens: thinking still
    (True, "hmm</think>\n\nParis.", "hmm", "Paris."),
    (True, "</think>Paris.", None, "Paris."),
    (False, "<think></think>\n\n", None, None),
]


def split(text: str, cuts: list[int]) -> list[str]:
    bounds = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


def thought(opened: bool, pieces: list[str]) -> tuple[str | None, str | None]:
    parser, events = ThinkParser(opened), []
    for piece in pieces:
        events += parser.feed(piece)
    events += parser.finish()
    reasoning = "".join(e.text for e in events if isinstance(e, Reasoning))
    content = "".join(e.text for e in events if isinstance(e, Text))
    return reasoning or None, content or None


@pytest.mark.parametrize("opened, text, reasoning, content", THINKING)
def test_thinking_is_split_from_the_answer(opened, text, reasoning, content):
    assert thought(opened, [text]) == (reasoning, content)
    assert thought(opened, list(text)) == (reasoning, content)


@settings(max_examples=40, deadline=None)
@given(case=st.sampled_from(THINKING), cuts=st.lists(st.integers(0, 100), max_size=6))
def test_thinking_split_anywhere(case, cuts):
    opened, text, reasoning, content = case
    assert thought(opened, split(text, cuts)) == (reasoning, content)


WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city"],
}
TOOLS = [("get_weather", WEATHER), ("ping", None)]


def test_named_schema_is_the_tools_parameters():
    schema = json.loads(named_schema(WEATHER))
    jsonschema.validate({"city": "Paris"}, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"days": 2}, schema)
    assert json.loads(named_schema(None)) == {"type": "object"}


def test_required_schema_takes_calls_of_the_tools_only():
    schema = json.loads(required_schema(TOOLS))
    good = [
        {"name": "get_weather", "arguments": {"city": "Rome"}},
        {"name": "ping", "arguments": {}},
    ]
    jsonschema.validate(good, schema)
    for bad in (
        [],
        [{"name": "nope", "arguments": {}}],
        [{"name": "get_weather", "arguments": {"days": 1}}],
        [{"name": "ping"}],
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    one = json.loads(required_schema(TOOLS, parallel=False))
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(good, one)


REQUIRED = (
    '[{"name":"get_weather","arguments":{"city":"Pa\\"ris]}"}},{"name":"ping","arguments":{}}]'
)


@settings(max_examples=40, deadline=None)
@given(cuts=st.lists(st.integers(0, 200), max_size=8))
def test_required_output_reads_as_its_calls_split_anywhere(cuts):
    expected = answer(calls=[("get_weather", json.dumps({"city": 'Pa"ris]}'})), ("ping", "{}")])
    assert read(RequiredCallsParser(), split(REQUIRED, cuts)) == expected


def test_required_output_cut_short_keeps_the_whole_calls_only():
    cut = REQUIRED[: REQUIRED.index('{"name":"ping"') + 5]
    expected = answer(calls=[("get_weather", json.dumps({"city": 'Pa"ris]}'}))])
    assert read(RequiredCallsParser(), [cut]) == expected


def test_named_output_streams_its_arguments_as_they_come():
    parser = NamedCallParser("get_weather")
    assert read(parser, ['{"ci', 'ty":', '"Rome"}']) == answer(
        calls=[("get_weather", '{"city":"Rome"}')]
    )
