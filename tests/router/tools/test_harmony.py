"""gpt-oss's harmony channels: thinking, answer and calls read out of the messages it
writes, whole or split anywhere; through the ingress with its markers as special tokens."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from replica.wire import Reply
from router.tools.harmony import HarmonyParser
from tests.fakes import FakeReplicas
from tests.router.client import BASE, ingress_client
from tests.router.tools.chats import CHAT, summary
from tests.router.tools.messages import answer, read
from tests.router.tools.models import model_with_template

CALL = ("get_weather", json.dumps({"city": "Paris"}))
CASES = [
    (
        "<|channel|>analysis<|message|>Weather, so call.<|end|><|start|>assistant<|channel|>"
        'commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}',
        answer(calls=[CALL], reasoning="Weather, so call."),
    ),
    (
        "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final"
        "<|message|>It is sunny.",
        answer("It is sunny.", reasoning="Easy."),
    ),
    (  # the recipient before the channel, and a call that is not JSON: text
        '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"ci',
        answer('{"ci'),
    ),
    (
        "<|channel|>commentary<|message|>Let me check.<|end|><|start|>assistant<|channel|>"
        'commentary to=functions.get_weather<|message|>{"city": "Paris"}<|call|>',
        answer("Let me check.", [CALL]),
    ),
    ("no channels at all", answer("no channels at all")),
]


@pytest.mark.parametrize("text, expected", CASES)
def test_messages_read_whole_and_one_character_at_a_time(text, expected):
    assert read(HarmonyParser(), [text]) == expected
    assert read(HarmonyParser(), list(text)) == expected


@settings(max_examples=40, deadline=None)
@given(case=st.sampled_from(CASES), cuts=st.lists(st.integers(0, 300), max_size=8))
def test_any_split_reads_as_the_whole(case, cuts):
    text, expected = case
    bounds = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    assert read(HarmonyParser(), [text[a:b] for a, b in zip(bounds, bounds[1:])]) == expected


def test_without_calls_a_message_to_a_function_is_text():
    text = CASES[0][0]
    assert read(HarmonyParser(calls=False), [text]) == answer(
        '{"city": "Paris"}', reasoning="Weather, so call."
    )


HARMONY_TEMPLATE = (
    "{% for m in messages %}<|start|>{{ m.role }}{% if m.role == 'assistant' %}"
    "<|channel|>final{% endif %}<|message|>{{ m.content }}<|end|>"
    "{% endfor %}{% if tools %}<|start|>developer<|message|>{{ tools | tojson }}<|end|>"
    "{% endif %}<|start|>assistant"
)
MARKERS = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|call|>", "<|constrain|>"]


@pytest.fixture(scope="module")
def harmony_dir(tmp_path_factory) -> str:
    root = model_with_template(tmp_path_factory.mktemp("harmony") / "model", HARMONY_TEMPLATE)
    tokenizer = AutoTokenizer.from_pretrained(root)
    tokenizer.add_special_tokens({"additional_special_tokens": MARKERS})
    tokenizer.save_pretrained(root)
    return root


@pytest.mark.parametrize("tools", [True, False])
def test_through_the_ingress_channels_are_split_with_or_without_tools(harmony_dir, tools):
    tok = AutoTokenizer.from_pretrained(harmony_dir)
    text = CASES[0][0] if tools else CASES[1][0]
    ids = (*tok.encode(text, add_special_tokens=False), tok.convert_tokens_to_ids("<|call|>"))
    replicas = FakeReplicas(lambda r: [Reply(ids, "stop", num_prompt_tokens=3)])
    body = CHAT if tools else {**CHAT, "tools": None}
    with ingress_client(harmony_dir, None, replicas) as (client, _):
        card = client.get(f"/v1/models/{BASE}").json()
        whole = summary(client.post("/v1/chat/completions", json=body).json())
    assert (card["tool_parser"], card["reasoning_parser"]) == ("harmony", "harmony")
    if tools:
        assert whole["reasoning_content"] == "Weather, so call."
        assert whole["tool_calls"] == [{"name": CALL[0], "arguments": CALL[1]}]
        assert whole["finish_reason"] == "tool_calls"
    else:
        assert (whole["reasoning_content"], whole["content"]) == ("Easy.", "It is sunny.")
