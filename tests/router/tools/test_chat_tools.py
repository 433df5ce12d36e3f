"""Tools through the ingress (in-process, fake replicas answering fixed text): requests
validated, tools and tool history rendered by the model's template, answers read into
OpenAI's tool_calls and reasoning_content, streamed deltas adding up to the whole answer;
forced choices sent to the replica as a JSON schema; an adapter's own template."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from replica.wire import Reply
from tests.fakes import FakeReplicas, FakeStore, registered
from tests.net import assert_openai_error
from tests.router.client import BASE, ingress_client
from tests.router.tools.chats import (
    ASK,
    CALL_TEXT,
    CHAT,
    PING_TEXT,
    WEATHER,
    chat,
    summary,
)
from tests.router.tools.models import answering, model_with_template


@pytest.fixture(scope="module")
def hermes_dir(tmp_path_factory) -> str:
    return model_with_template(tmp_path_factory.mktemp("hermes") / "model")


@pytest.fixture(scope="module")
def tok(hermes_dir):
    return AutoTokenizer.from_pretrained(hermes_dir)


def chunks(r) -> list[dict]:
    lines = [line.removeprefix("data: ") for line in r.text.splitlines() if line]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def reassembled(events: list[dict]) -> dict:
    """The message a client builds from a stream's deltas (as the openai SDK does)."""
    content, reasoning, calls, finish = "", "", {}, None
    for event in events:
        for choice in event["choices"]:
            delta = choice["delta"]
            content += delta.get("content") or ""
            reasoning += delta.get("reasoning_content") or ""
            for call in delta.get("tool_calls") or ():
                entry = calls.setdefault(call["index"], {"name": "", "arguments": ""})
                if "id" in call:
                    assert "name" in call["function"], "id and name come first"
                    entry["name"] = call["function"]["name"]
                entry["arguments"] += call["function"].get("arguments") or ""
            finish = choice["finish_reason"] or finish
    return {
        "content": content or None,
        "reasoning_content": reasoning or None,
        "tool_calls": [calls[i] for i in sorted(calls)],
        "finish_reason": finish,
    }


# -- validation ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fields, param, needle",
    [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
         "'nope' is not among tools (get_weather, ping)"),
        ({"tools": None, "tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"tools": [WEATHER, WEATHER]}, "tools", "unique: get_weather"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools.0.function.name",
         "pattern"),
        ({"tool_choice": "required", "response_format": {"type": "json_object"}}, None,
         "response_format: not with tool_choice"),
        ({"functions": [{"name": "f"}]}, "functions", "not supported"),
        ({"parallel_tool_calls": "maybe"}, "parallel_tool_calls", "bool"),
    ],
)  # fmt: skip
def test_invalid_tool_requests_are_400_naming_the_problem(hermes_dir, fields, param, needle):
    r, replicas = chat(hermes_dir, {**CHAT, **fields})
    error = assert_openai_error(r, 400, param)
    assert needle in error["message"] and not replicas.requests


def test_auto_without_a_parser_for_the_template_is_400(model_dir):
    """The demo template writes no call format: auto would silently never call."""
    with ingress_client(model_dir) as (client, _):
        r = client.post("/v1/chat/completions", json=CHAT)
    error = assert_openai_error(r, 400, "tool_choice")
    assert "tool_parser" in error["message"]


# -- rendering ----------------------------------------------------------------------------------


def test_tools_and_tool_history_go_through_the_template(hermes_dir, tok):
    history = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    ]
    _, replicas = chat(hermes_dir, {**CHAT, "messages": history})
    prompt = tok.decode(replicas.requests[0].prompt_ids)
    assert json.dumps(WEATHER["function"]["parameters"]) in prompt  # the tool's schema
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in prompt  # the call
    assert "<tool_response>sunny, 21 C</tool_response>" in prompt
    assert prompt.endswith("<|assistant|>\n")


def test_tool_choice_none_renders_no_tools_and_reads_no_calls(hermes_dir, tok):
    r, replicas = chat(hermes_dir, {**CHAT, "tool_choice": "none"}, answering(tok, CALL_TEXT))
    assert "<tools>" not in tok.decode(replicas.requests[0].prompt_ids)
    assert replicas.requests[0].sampling.structured_output is None
    assert summary(r.json())["content"] == CALL_TEXT


def test_chat_template_kwargs_reach_the_template(hermes_dir, tok):
    body = {**CHAT, "chat_template_kwargs": {"enable_thinking": False}}
    _, replicas = chat(hermes_dir, body)
    assert tok.decode(replicas.requests[0].prompt_ids).endswith("<think>\n\n</think>\n\n")


# -- answers ------------------------------------------------------------------------------------

ANSWERS = [
    (CALL_TEXT, None, [{"name": "get_weather", "arguments": '{"city": "Paris"}'}], "tool_calls"),
    (
        f"Checking.\n{CALL_TEXT}\n{PING_TEXT}",
        "Checking.",
        [
            {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            {"name": "ping", "arguments": "{}"},
        ],
        "tool_calls",
    ),
    ("No call <tool_call>{oops}</tool_call>", "No call <tool_call>{oops}</tool_call>", [], "stop"),
    ("<think>It is Paris.</think>\n\n" + CALL_TEXT, None,
     [{"name": "get_weather", "arguments": '{"city": "Paris"}'}], "tool_calls"),
]  # fmt: skip


@pytest.mark.parametrize("text, content, calls, finish", ANSWERS)
def test_auto_answers_read_as_tool_calls_streamed_or_not(
    hermes_dir, tok, text, content, calls, finish
):
    r, _ = chat(hermes_dir, CHAT, answering(tok, text))
    assert r.status_code == 200, r.text
    whole = summary(r.json())
    assert (whole["content"], whole["tool_calls"], whole["finish_reason"]) == (
        content,
        calls,
        finish,
    )
    assert all(c["id"].startswith("call_") and c["type"] == "function"
               for c in r.json()["choices"][0]["message"]["tool_calls"])  # fmt: skip
    streamed, _ = chat(hermes_dir, CHAT, answering(tok, text, per_token=True), stream=True)
    assert reassembled(chunks(streamed)) == whole


def test_reasoning_is_split_off_without_tools_too(hermes_dir, tok):
    body = {**CHAT, "tools": None}
    r, _ = chat(hermes_dir, body, answering(tok, "<think>Paris, in spring.</think>\n\nSunny."))
    whole = summary(r.json())
    assert (whole["reasoning_content"], whole["content"]) == ("Paris, in spring.", "Sunny.")
    streamed, _ = chat(
        hermes_dir, body, answering(tok, "<think>Paris, in spring.</think>\n\nSunny.", True), True
    )
    assert reassembled(chunks(streamed)) == whole


def test_parallel_tool_calls_false_answers_one_call(hermes_dir, tok):
    text = f"{CALL_TEXT}\n{PING_TEXT}"
    r, _ = chat(hermes_dir, {**CHAT, "parallel_tool_calls": False}, answering(tok, text))
    assert [c["name"] for c in summary(r.json())["tool_calls"]] == ["get_weather"]


# -- forced choices -----------------------------------------------------------------------------


def test_a_named_choice_decodes_under_the_tools_schema(hermes_dir, tok):
    body = {**CHAT, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    r, replicas = chat(hermes_dir, body, answering(tok, '{"city": "Rome"}'))
    spec = replicas.requests[0].sampling.structured_output
    assert spec.kind == "json_schema"
    assert json.loads(spec.json_schema) == WEATHER["function"]["parameters"]
    whole = summary(r.json())
    assert whole["tool_calls"] == [{"name": "get_weather", "arguments": '{"city": "Rome"}'}]
    assert (whole["content"], whole["finish_reason"]) == (None, "tool_calls")


def test_required_decodes_a_list_of_calls(hermes_dir, tok):
    out = '[{"name": "ping", "arguments": {}}]'
    r, replicas = chat(hermes_dir, {**CHAT, "tool_choice": "required"}, answering(tok, out))
    schema = json.loads(replicas.requests[0].sampling.structured_output.json_schema)
    names = [item["properties"]["name"]["enum"] for item in schema["items"]["anyOf"]]
    assert names == [["get_weather"], ["ping"]] and "maxItems" not in schema
    assert summary(r.json())["tool_calls"] == [{"name": "ping", "arguments": "{}"}]


# -- an adapter's own template ------------------------------------------------------------------


def test_an_adapters_own_template_is_used_for_its_requests(model_dir, hermes_dir, tmp_path, tok):
    adapter = tmp_path / "ad-tools"
    adapter.mkdir()
    shutil.copy(Path(hermes_dir) / "chat_template.jinja", adapter / "chat_template.jinja")
    store = FakeStore({"ad-tools": registered("ad-tools", 1, str(adapter))})
    messages = {"messages": ASK, "tools": [WEATHER]}
    with ingress_client(model_dir, store) as (client, _):
        own = client.post("/tokenize", json={"model": "ad-tools", **messages}).json()["tokens"]
        base = client.post("/tokenize", json={"model": BASE, **messages}).json()["tokens"]
        card = client.get("/v1/models/ad-tools").json()
        base_card = client.get(f"/v1/models/{BASE}").json()
    assert "<tools>" in tok.decode(own) and "<tools>" not in tok.decode(base)
    assert card["chat_template"] == str(adapter / "chat_template.jinja")
    assert (card["tool_parser"], card["reasoning_parser"]) == ("hermes", "think")
    assert (base_card["chat_template"], base_card.get("tool_parser")) == ("tokenizer", None)


def test_config_overrides_the_parsers_per_adapter(hermes_dir):
    store = FakeStore({"ad-1": registered("ad-1", 3, "/adapters/ad-1")})
    options = {
        "adapter_parsers": {"ad-*": {"tool_parser": "llama3_json", "reasoning_parser": "none"}}
    }
    with ingress_client(hermes_dir, store, **options) as (client, _):
        card = client.get("/v1/models/ad-1").json()
        base = client.get(f"/v1/models/{BASE}").json()
    assert (card.get("tool_parser"), card.get("reasoning_parser")) == ("llama3_json", None)
    assert (base["tool_parser"], base["reasoning_parser"]) == ("hermes", "think")


# -- a format whose markers are special tokens --------------------------------------------------

MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]"
    "{% endif %}{% for m in messages %}{{ m.content }}{% endfor %} [TOOL_CALLS] "
)


@pytest.fixture(scope="module")
def mistral_dir(tmp_path_factory) -> str:
    root = model_with_template(tmp_path_factory.mktemp("mistral") / "model", MISTRAL_TEMPLATE)
    tokenizer = AutoTokenizer.from_pretrained(root)
    tokenizer.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]"]})
    tokenizer.save_pretrained(root)
    return root


@pytest.mark.parametrize(
    "text, content, calls",
    [
        ('[TOOL_CALLS][{"name": "ping", "arguments": {}}]', None, [("ping", "{}")]),
        ("Plain words.", "Plain words.", []),
    ],
)
def test_special_token_markers_are_read_and_the_eos_is_not_text(mistral_dir, text, content, calls):
    """Mistral's [TOOL_CALLS] is a special token: the answer is decoded keeping special
    tokens, all but the EOS that ends it."""
    tok = AutoTokenizer.from_pretrained(mistral_dir)
    ids = (*tok.encode(text, add_special_tokens=False), tok.eos_token_id)
    script = lambda r: [Reply(ids, "stop", num_prompt_tokens=len(r.prompt_ids))]  # noqa: E731
    with ingress_client(mistral_dir, None, FakeReplicas(script)) as (client, _):
        card = client.get(f"/v1/models/{BASE}").json()
        r = client.post("/v1/chat/completions", json=CHAT)
    assert card["tool_parser"] == "mistral"
    whole = summary(r.json())
    assert whole["content"] == content
    assert [(c["name"], c["arguments"]) for c in whole["tool_calls"]] == calls


def test_strict_tools_with_auto_are_served_unconstrained_where_markers_are_special(mistral_dir):
    """Mistral's (and harmony's) markers are special tokens the grammar excludes, so
    `strict` cannot hold an `auto` call there: the request is served, unconstrained (the
    Agents SDK marks every tool strict), and a forced choice is decoded under the
    schema."""
    strict = {"type": "function", "function": {**WEATHER["function"], "strict": True}}
    replicas = FakeReplicas()
    with ingress_client(mistral_dir, None, replicas) as (client, _):
        auto = client.post("/v1/chat/completions", json={**CHAT, "tools": [strict]})
        forced = {**CHAT, "tools": [strict], "tool_choice": "required"}
        served = client.post("/v1/chat/completions", json=forced)
    assert auto.status_code == 200 and served.status_code == 200, (auto.text, served.text)
    unconstrained, held = (r.sampling.structured_output for r in replicas.requests)
    assert unconstrained is None and held is not None
