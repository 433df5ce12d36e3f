"""`auto` with strict tools: the request carries a structural tag (free text, then a call
in the template's format whose arguments follow the tool's schema), which the replica's
grammar compiler takes and enforces."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from replica.engine.structured import StructuredOutputs
from replica.errors import RequestError
from replica.wire import StructuredOutput
from router.tools.forced import strict_tag
from router.tools.hermes import HERMES
from router.tools.llama import LLAMA3_JSON
from tests.router.tools.chats import CHAT, PING, WEATHER, chat
from tests.router.tools.models import model_with_template

STRICT = {"type": "function", "function": {**WEATHER["function"], "strict": True}}
SIGNATURES = [("get_weather", WEATHER["function"]["parameters"], True), ("ping", None, False)]


@pytest.fixture(scope="module")
def hermes_dir(tmp_path_factory) -> str:
    return model_with_template(tmp_path_factory.mktemp("hermes-strict") / "model")


def test_a_strict_tool_makes_auto_answers_carry_the_tag(hermes_dir):
    _, replicas = chat(hermes_dir, {**CHAT, "tools": [STRICT, PING]})
    spec = replicas.requests[0].sampling.structured_output
    assert spec.kind == "structural_tag"
    fmt = json.loads(spec.json_schema)["format"]
    assert fmt["triggers"] == ["<tool_call>"]
    assert [tag["begin"] for tag in fmt["tags"]] == [
        '<tool_call>\n{"name": "get_weather", "arguments": ',
        '<tool_call>\n{"name": "ping", "arguments": ',
    ]
    assert fmt["tags"][0]["content"]["json_schema"] == WEATHER["function"]["parameters"]


@pytest.mark.parametrize(
    "fields",
    [
        {},  # no strict tool
        {"tools": [STRICT], "tool_choice": "none"},
        {"tools": [STRICT], "response_format": {"type": "json_object"}},  # response_format wins
    ],
)
def test_otherwise_auto_answers_are_free(hermes_dir, fields):
    _, replicas = chat(hermes_dir, {**CHAT, **fields})
    spec = replicas.requests[0].sampling.structured_output
    assert spec is None or spec.kind == "json_object"


@pytest.fixture(scope="module")
def structured(hermes_dir) -> StructuredOutputs:
    tokenizer = AutoTokenizer.from_pretrained(hermes_dir)
    return StructuredOutputs(hermes_dir, len(tokenizer), [tokenizer.eos_token_id])


@pytest.mark.parametrize(
    "fmt, text, accepted",
    [
        (HERMES, 'Let me see. <tool_call>\n{"name": "get_weather", "arguments": {"city": '
         '"Rome"}}\n</tool_call> Done.', True),
        (HERMES, 'x <tool_call>\n{"name": "get_weather", "arguments": {"city": "Lyon"', False),
        (HERMES, 'x <tool_call>\n{"name": "ping", "arguments": {"any": [1]}}\n</tool_call>', True),
        (HERMES, "x <tool_call>\n{\"name\": \"nope\"", False),
        (HERMES, "Only words, no call.", True),
        (LLAMA3_JSON, '{"name": "get_weather", "parameters": {"city": "Paris"}}', True),
        (LLAMA3_JSON, '{"name": "get_weather", "parameters": {"town": "Paris"}}', False),
    ],
)  # fmt: skip
def test_the_replica_grammar_holds_a_begun_call_to_its_schema(structured, fmt, text, accepted):
    import xgrammar as xgr

    tag = strict_tag(fmt.wrap, fmt.trigger, SIGNATURES)
    grammar = structured.grammar(StructuredOutput(kind="structural_tag", json_schema=tag))
    assert xgr.GrammarMatcher(grammar).accept_string(text) is accepted


def test_an_invalid_structural_tag_is_refused(structured):
    with pytest.raises(RequestError, match="invalid structural tag"):
        structured.grammar(StructuredOutput(kind="structural_tag", json_schema='{"type": 1}'))
