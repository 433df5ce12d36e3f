"""Each call format's parser on text its template family writes: complete calls, several,
with text around them, cut short, not calls at all; whole and streamed, split anywhere."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.tools.events import Chain
from router.tools.hermes import HERMES
from router.tools.llama import LLAMA3_JSON
from router.tools.message import MessageAssembler
from router.tools.mistral import MISTRAL
from router.tools.reasoning import ThinkParser
from router.tools.tagged import CallFormat, TaggedCallParser
from tests.router.tools.messages import answer, args, read

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
TIME = '{"name": "get_time", "arguments": {"zone": "CET", "h24": true}}'
CALL_W = ("get_weather", args(city="Paris"))
CALL_T = ("get_time", args(zone="CET", h24=True))

# (format, output text, the message it reads as)
CASES = [
    # Hermes (Qwen2.5/Qwen3): a block per call, anywhere
    (HERMES, f"<tool_call>\n{WEATHER}\n</tool_call>", answer(calls=[CALL_W])),
    (
        HERMES,
        f"<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n{TIME}\n</tool_call>",
        answer(calls=[CALL_W, CALL_T]),
    ),
    (
        HERMES,
        f"Let me look.\n\n<tool_call>\n{WEATHER}\n</tool_call>\nDone.",
        answer("Let me look.Done.", [CALL_W]),
    ),
    (HERMES, "The weather <is> fine.\n", answer("The weather <is> fine.\n")),
    # cut short (max_tokens) or not JSON: text, exactly as written
    (
        HERMES,
        'Sure <tool_call>\n{"name": "get_weather", "argu',
        answer('Sure <tool_call>\n{"name": "get_weather", "argu'),
    ),
    (HERMES, "<tool_call>not json</tool_call> ok", answer("<tool_call>not json</tool_call> ok")),
    (
        HERMES,
        '<tool_call>{"arguments": {}}</tool_call>',
        answer('<tool_call>{"arguments": {}}</tool_call>'),
    ),
    (HERMES, "a <tool_", answer("a <tool_")),
    # a call with no arguments, and arguments sent as a JSON string
    (HERMES, '<tool_call>{"name": "ping"}</tool_call>', answer(calls=[("ping", "{}")])),
    (
        HERMES,
        '<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>',
        answer(calls=[("f", args(x=1))]),
    ),
    # Llama 3.1+: the whole answer is the call(s)
    (
        LLAMA3_JSON,
        '{"name": "get_weather", "parameters": {"city": "Paris"}}',
        answer(calls=[CALL_W]),
    ),
    (
        LLAMA3_JSON,
        ' {"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", '
        '"parameters": {"zone": "CET", "h24": true}}',
        answer(calls=[CALL_W, CALL_T]),
    ),
    (LLAMA3_JSON, 'Use {"name": "x"} here', answer('Use {"name": "x"} here')),
    (LLAMA3_JSON, '{"city": "Paris"}', answer('{"city": "Paris"}')),
    (
        LLAMA3_JSON,
        '{"name": "get_weather", "parameters": {"ci',
        answer('{"name": "get_weather", "parameters": {"ci'),
    ),
    (LLAMA3_JSON, "  hello", answer("  hello")),
    # Mistral: [TOOL_CALLS] then a list (v0.3) or name[ARGS]{...} per call (v11+)
    (MISTRAL, f"[TOOL_CALLS][{WEATHER}, {TIME}]", answer(calls=[CALL_W, CALL_T])),
    (
        MISTRAL,
        'Checking.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]'
        '{"zone": "CET", "h24": true}',
        answer("Checking.", [CALL_W, CALL_T]),
    ),
    (MISTRAL, "[TOOL_CALLS][{", answer("[TOOL_CALLS][{")),
    (MISTRAL, "No [TOOL_CALL here", answer("No [TOOL_CALL here")),
]
IDS = [f"{fmt.name}-{i}" for i, (fmt, _, _) in enumerate(CASES)]


@pytest.mark.parametrize("fmt, text, expected", CASES, ids=IDS)
def test_whole_answers(fmt: CallFormat, text: str, expected: dict):
    assert read(TaggedCallParser(fmt), [text]) == expected


@pytest.mark.parametrize("fmt, text, expected", CASES, ids=IDS)
def test_streamed_one_character_at_a_time(fmt: CallFormat, text: str, expected: dict):
    assert read(TaggedCallParser(fmt), list(text)) == expected


@settings(max_examples=60, deadline=None)
@given(case=st.sampled_from(CASES), cuts=st.lists(st.integers(0, 200), max_size=8))
def test_any_split_reads_as_the_whole(case, cuts):
    fmt, text, expected = case
    bounds = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    assert read(TaggedCallParser(fmt), pieces) == expected


def test_text_is_never_sent_before_it_is_decided():
    """A stream holds what may begin a marker, and never sends a call's text as content."""
    message = MessageAssembler(TaggedCallParser(HERMES))
    assert message.feed("Hi <tool").content == "Hi"
    parts = message.feed(f"_call>\n{WEATHER}\n</tool_call>")
    assert parts.content == ""
    assert [(c["index"], c["function"]["name"]) for c in parts.tool_calls] == [(0, "get_weather")]
    assert parts.tool_calls[0]["id"].startswith("call_")
    assert message.feed("<b>").content == "<b>"


def test_parallel_tool_calls_false_keeps_the_first_call():
    text = f"<tool_call>{WEATHER}</tool_call><tool_call>{TIME}</tool_call>"
    assert read(TaggedCallParser(HERMES), [text], parallel=False) == answer(calls=[CALL_W])


def test_thinking_then_calls():
    """Qwen3: <think>...</think>, then the answer's calls."""
    text = f"<think>\nThe user wants weather.\n</think>\n\n<tool_call>\n{WEATHER}\n</tool_call>"
    expected = answer(calls=[CALL_W], reasoning="\nThe user wants weather.\n")
    for pieces in ([text], list(text)):
        assert read(Chain(ThinkParser(), TaggedCallParser(HERMES)), pieces) == expected
