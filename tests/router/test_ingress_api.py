"""The ingress's HTTP surface without Ray: its FastAPI app served in-process (TestClient), the
Ingress object built with fake AdapterStore and LoRAReplica handles. Every error has an
OpenAI body; invalid Unicode is a 400 naming the field; /health, /tokenize, /detokenize and
/v1/models/{id}.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

import pytest
from fastapi.testclient import TestClient

from replica.wire import Reply
from router import ingress
from tests.conftest import tiny_assets
from tests.fakes import registered
from tests.net import assert_openai_error
from tests.router.client import BASE, CHAT, COMPLETION, KEY, ingress_client


def post_json(client: TestClient, path: str, body: Any, **kw: Any):
    """POST `body` as json.dumps writes it: lone surrogates as \\ud800 escapes."""
    headers = {"content-type": "application/json", **kw.pop("headers", {})}
    return client.post(path, content=json.dumps(body), headers=headers, **kw)


# -- errors: always an OpenAI body -----------------------------------------------------------


@pytest.mark.parametrize("method, path", [("GET", "/nope"), ("POST", "/v1/nope"), ("GET", "/")])
def test_unknown_routes_are_404_with_an_openai_body(client, method, path):
    error = assert_openai_error(client.request(method, path), 404)
    assert path in error["message"] and error["type"] == "not_found_error"


@pytest.mark.parametrize(
    "method, path, allowed",
    [
        ("GET", "/v1/completions", "POST"),
        ("DELETE", "/v1/models", "GET"),
        ("PUT", "/health", "GET"),
        ("GET", "/tokenize", "POST"),
    ],
)
def test_wrong_methods_are_405_with_an_openai_body(client, method, path, allowed):
    r = client.request(method, path)
    error = assert_openai_error(r, 405)
    assert allowed in r.headers["allow"] and allowed in error["message"]


def test_validation_errors_are_400_naming_the_field(client):
    error = assert_openai_error(client.post("/v1/completions", json={"prompt": "x"}), 400, "model")
    assert "model: Field required" in error["message"]
    error = assert_openai_error(post_json(client, "/v1/completions", {**COMPLETION, "n": 0}), 400)
    assert error["param"] == "n"
    assert_openai_error(client.post("/v1/completions", content=b"{", headers={}), 400)


@pytest.mark.parametrize(
    "raw, message",
    [
        (b'{"model": "tiny-base", "prompt": "hi",}',
         "Expecting property name enclosed in double quotes (line 1 column 39)"),
        (b'{"model": "tiny-base",\n  "prompt": "hi"\n  "n": 1}',
         "Expecting ',' delimiter (line 3 column 3)"),
        (b"{", "Expecting property name enclosed in double quotes (line 1 column 2)"),
        (b"", None),  # no body at all: the fields it lacks
    ],
)  # fmt: skip
def test_malformed_json_is_a_400_saying_where(client, raw, message):
    """The parser's message with line and column; no param (FastAPI put the character
    offset where a field name goes: `"param": "40"`)."""
    r = client.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
    error = assert_openai_error(r, 400)
    if message is None:
        assert "Field required" in error["message"]
        return
    assert error["message"] == f"Invalid JSON body: {message}"
    assert error["param"] is None


@pytest.mark.parametrize(
    "content_type", [None, "application/x-www-form-urlencoded", "text/plain; charset=utf-8"]
)
def test_a_json_body_is_read_as_json_whatever_its_content_type_says(client, content_type):
    """`curl -d` without -H sends application/x-www-form-urlencoded; some clients send no
    Content-Type at all: the body is still the JSON every endpoint takes."""
    headers = {"content-type": content_type} if content_type else {}
    r = client.post("/v1/completions", content=json.dumps(COMPLETION), headers=headers)
    assert r.status_code == 200, r.text
    assert r.json()["object"] == "text_completion"


def test_an_unexpected_exception_is_a_500_with_an_openai_body_and_a_logged_traceback(
    client, store, caplog
):
    store.fail = RuntimeError("store exploded: /secret/path")
    with caplog.at_level(logging.ERROR, logger=ingress.__name__):
        r = client.get("/v1/models")
    error = assert_openai_error(r, 500)
    assert error["type"] == "internal_error"
    assert "Traceback" not in error["message"] and "/secret/path" not in error["message"]
    [record] = [rec for rec in caplog.records if rec.name == ingress.__name__]
    assert record.exc_info and isinstance(record.exc_info[1], RuntimeError)
    error_id = error["message"].split("(id ")[1].split(")")[0]
    assert error_id in record.getMessage()


def test_an_unexpected_exception_mid_stream_is_an_error_event(client, replicas, caplog):
    # a token id the tokenizer cannot decode: a bug below the ingress, not the client's
    replicas.script = lambda r: [Reply((5,)), Reply((-1,), "length")]
    with caplog.at_level(logging.ERROR, logger=ingress.__name__):
        r = client.post("/v1/completions", json={**COMPLETION, "stream": True})
    assert r.status_code == 200
    events = [line.removeprefix("data: ") for line in r.text.splitlines() if line]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == 500 and "Traceback" not in error["message"]
    assert any(rec.exc_info for rec in caplog.records if rec.name == ingress.__name__)
    # the same reply without streaming: a 500 with an OpenAI body
    assert_openai_error(client.post("/v1/completions", json=COMPLETION), 500)


def test_cross_field_sampling_errors_are_400_not_500(client):
    body = {**COMPLETION, "max_tokens": 2, "min_tokens": 5}
    error = assert_openai_error(client.post("/v1/completions", json=body), 400)
    assert "min_tokens" in error["message"]


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/completions", {**COMPLETION, "suffix": "x"}, "suffix"),
        ("/v1/completions", {**COMPLETION, "n": 2, "best_of": 3}, "best_of"),
        ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function"}]}, "tools.0.function"),
        ("/v1/chat/completions", {**CHAT, "tool_choice": "required"}, "tool_choice"),
        ("/v1/chat/completions", {**CHAT, "echo": True}, "echo"),
        ("/v1/chat/completions", {**CHAT, "best_of": 2}, "best_of"),
    ],
)
def test_features_not_served_are_refused_by_name(client, replicas, path, body, param):
    error = assert_openai_error(client.post(path, json=body), 400, param)
    assert param in error["message"] and not replicas.requests


# -- Unicode ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/completions", {**COMPLETION, "prompt": "a\ud800b"}, "prompt"),
        ("/v1/completions", {**COMPLETION, "prompt": ["\udfff"]}, "prompt.0"),
        ("/v1/completions", {**COMPLETION, "stop": ["ok", "\udc80"]}, "stop.1"),
        ("/v1/completions", {**COMPLETION, "user": "\ud83d"}, "user"),
        ("/v1/completions", {**COMPLETION, "model": "\ud800"}, "model"),
        (
            "/v1/chat/completions",
            {**CHAT, "messages": [{"role": "user", "content": "hi \ud800"}]},
            "messages.0.content",
        ),
        (
            "/v1/chat/completions",
            {
                **CHAT,
                "messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}],
            },
            "messages.0.content.0.text",
        ),
        ("/v1/chat/completions", {**CHAT, "chat_template_kwargs": {"x": "\ud800"}}, None),
        ("/tokenize", {"prompt": "\ud800"}, "prompt"),
        ("/detokenize", {"model": "\udbff", "tokens": [1]}, "model"),
    ],
)
def test_lone_surrogates_are_400_naming_the_field(client, replicas, path, body, param):
    error = assert_openai_error(post_json(client, path, body), 400)
    assert "lone surrogate" in error["message"], error
    if param is not None:
        assert error["param"] == param and error["message"].startswith(f"{param}:")
    assert not replicas.requests


def test_lone_surrogates_in_admin_bodies_are_400(model_dir):
    with ingress_client(model_dir, api_key=KEY) as (client, _):
        admin = {"Authorization": f"Bearer {KEY}"}
        body = {"lora_name": "x", "lora_path": "/adapters/\ud800"}
        r = post_json(client, "/v1/load_lora_adapter", body, headers=admin)
        assert_openai_error(r, 400, "lora_path")


def test_messages_quoting_surrogates_stay_valid_utf8(client):
    # keys are the client's text too; pydantic refuses a lone surrogate there
    r = post_json(client, "/v1/completions", {**COMPLETION, "x\ud800": 1})
    error = assert_openai_error(r, 400)
    assert "lone surrogate in 'x\\ud800'" in error["message"], error
    body = {**COMPLETION, "logit_bias": {"\udc00": 1}}
    error = assert_openai_error(post_json(client, "/v1/completions", body), 400, "logit_bias")
    assert "\\udc00" in error["message"]


@pytest.mark.parametrize(
    "text",
    [
        "a\x00b",
        "\x00",
        "e\u0301 \u00e9 \u212b \u00c5 \ufb01 \u1100\u1161 \uac00",
        "🙂\u200d🙂 \ufeff",
    ],
    ids=["nul-inside", "only-nul", "mixed-normalization", "joiners"],
)
def test_nuls_and_mixed_normalization_forms_are_valid_text(client, replicas, tokenizer, text):
    r = post_json(client, "/v1/completions", {**COMPLETION, "prompt": text})
    assert r.status_code == 200, r.text
    assert replicas.requests[-1].prompt_ids == tokenizer(text)["input_ids"]
    chat = {**CHAT, "messages": [{"role": "user", "content": text}]}
    assert post_json(client, "/v1/chat/completions", chat).status_code == 200
    r = post_json(client, "/tokenize", {"prompt": text})
    assert r.json()["tokens"] == tokenizer(text)["input_ids"]


# -- /health ------------------------------------------------------------------------------------


def test_health_is_ok_while_a_replica_reports(client, store):
    store.reports = {"dead": {"age_s": 300.0}, "live": {"age_s": 0.4}}
    r = client.get("/health")
    assert r.status_code == 200 and r.json() == {"status": "ok"}


@pytest.mark.parametrize(
    "reports",
    [{}, {"r1": {"age_s": ingress.HEALTH_MAX_REPORT_AGE_S + 1}, "r2": {"age_s": 1e4}}],
    ids=["no-replica", "engines-silent"],
)
def test_health_is_503_when_no_replica_can_serve(client, store, replicas, reports):
    store.reports = reports
    error = assert_openai_error(client.get("/health"), 503)
    assert "no replica can serve" in error["message"]
    assert not replicas.requests  # no generation is sent to find out


def test_health_is_503_when_the_store_does_not_answer(client, store):
    store.fail = ConnectionError("store gone")
    error = assert_openai_error(client.get("/health"), 503)
    assert "store" in error["message"]


def test_health_needs_no_key(model_dir):
    with ingress_client(model_dir, api_key=KEY, api_key_for_inference=True) as (client, _):
        assert client.get("/health").status_code == 200


# -- /tokenize, /detokenize ---------------------------------------------------------------------


def test_tokenize_a_prompt(client, tokenizer, model_dir):
    text = "Hello wörld 日本"
    r = client.post("/tokenize", json={"prompt": text, "model": "ad-1"})
    assert r.status_code == 200, r.text
    config = json.loads((tiny_assets("llama").model_dir / "config.json").read_text())
    ids = tokenizer(text)["input_ids"]
    assert r.json() == {
        "count": len(ids),
        "max_model_len": config["max_position_embeddings"],
        "tokens": ids,
    }


def test_tokenize_messages_as_chat_completions_does(client, replicas, tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    tokens = client.post("/tokenize", json={"messages": messages}).json()["tokens"]
    assert (
        client.post("/v1/chat/completions", json={**CHAT, "messages": messages}).status_code == 200
    )
    assert tokens == replicas.requests[-1].prompt_ids
    assert tokenizer.decode(tokens).endswith("<|assistant|>\n")
    bare = {"messages": messages, "add_generation_prompt": False}
    assert (
        client.post("/tokenize", json=bare).json()["tokens"]
        == tokens[: -len(tokenizer("<|assistant|>\n", add_special_tokens=False)["input_ids"])]
    )


@pytest.mark.parametrize(
    "body, needle",
    [
        ({"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, "exactly one"),
        ({}, "exactly one"),
        ({"prompt": "x", "add_generation_prompt": True}, "need messages"),
        ({"prompt": "x", "tokens": [1]}, "tokens: Extra inputs"),
        ({"prompt": "x", "model": "ghost"}, "does not exist"),
        (
            {
                "messages": [{"role": "user", "content": "x"}],
                "chat_template_kwargs": {"tokenize": 1},
            },
            "tokenize cannot be set",
        ),
    ],
)
def test_bad_tokenize_requests_are_4xx(client, body, needle):
    r = client.post("/tokenize", json=body)
    assert 400 <= r.status_code < 500
    assert needle in assert_openai_error(r, r.status_code)["message"]


def test_detokenize_round_trips(client, tokenizer):
    text = "Hello wörld 日本 🙂"
    ids = tokenizer(text)["input_ids"] + [tokenizer.eos_token_id]
    r = client.post("/detokenize", json={"tokens": ids, "model": BASE})
    assert r.status_code == 200 and r.json() == {"prompt": text + tokenizer.eos_token}
    assert client.post("/detokenize", json={"tokens": []}).json() == {"prompt": ""}


@pytest.mark.parametrize("bad", [-1, 10**6, 2**70])
def test_detokenize_refuses_unknown_ids(client, tokenizer, bad):
    r = client.post("/detokenize", json={"tokens": [1, bad, 2]})
    error = assert_openai_error(r, 400, "tokens")
    assert str(bad) in error["message"] and str(len(tokenizer) - 1) in error["message"]


# -- /v1/models/{id} ----------------------------------------------------------------------------


def test_model_cards(client, model_dir):
    base = client.get(f"/v1/models/{BASE}").json()
    assert base["id"] == BASE and base["root"] == model_dir and base["parent"] is None
    # the card of one model also says which chat template and parsers it uses
    assert base.pop("chat_template") == "tokenizer"
    assert base == client.get("/v1/models").json()["data"][0]
    adapter = client.get("/v1/models/ad-1").json()
    assert adapter == {
        "id": "ad-1",
        "object": "model",
        "created": 1700000000,
        "owned_by": "lorafleet",
        "root": "/adapters/ad-1",
        "parent": BASE,
        "chat_template": "tokenizer",  # the adapter ships none: the base's
    }


@pytest.mark.parametrize("model_id", ["ghost", "org/ghost", "ad-1/extra"])
def test_unknown_model_card_is_404(client, model_id):
    error = assert_openai_error(client.get(f"/v1/models/{model_id}"), 404, "model")
    assert repr(model_id) in error["message"]


# -- auth ---------------------------------------------------------------------------------------


def test_new_endpoints_follow_the_models_endpoint_auth(model_dir):
    requests = [
        ("GET", "/v1/models", None),
        ("GET", f"/v1/models/{BASE}", None),
        ("POST", "/tokenize", {"prompt": "x"}),
        ("POST", "/detokenize", {"tokens": [1]}),
    ]
    with ingress_client(model_dir, api_key=KEY) as (client, _):  # admin endpoints only
        for method, path, body in requests:
            assert client.request(method, path, json=body).status_code == 200, path
    with ingress_client(model_dir, api_key=KEY, api_key_for_inference=True) as (client, _):
        for method, path, body in requests:
            assert_openai_error(client.request(method, path, json=body), 401)
            ok = client.request(method, path, json=body, headers={"Authorization": f"Bearer {KEY}"})
            assert ok.status_code == 200, path


def test_generation_still_answers(client, replicas, tokenizer):
    started = time.time()
    r = client.post("/v1/completions", json=COMPLETION)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["text"] == tokenizer.decode([5, 6])
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["choices"][0]["stop_reason"] is None
    assert body["created"] >= int(started) - 1
    assert replicas.requests[0].prompt_ids == tokenizer("hello there")["input_ids"]


def test_models_lists_10000_adapters_and_renders_them_once_per_change(client, store):
    for i in range(10_000):
        store.adapters[f"customer-{i:05d}"] = registered(f"customer-{i:05d}", 1, f"/a/{i}")
    first = client.get("/v1/models")
    assert first.status_code == 200 and first.headers["content-type"] == "application/json"
    data = first.json()["data"]
    assert [m["id"] for m in data] == [BASE, *sorted(store.adapters)]  # the fixture's ad-1 too
    assert len(data) == 1 + 10_001
    assert {m["parent"] for m in data[1:]} == {BASE} and data[0]["parent"] is None
    assert client.get("/v1/models").content == first.content
    assert store.listings_sent == 1  # the second GET got the tag back, not 10,000 entries
    del store.adapters["customer-00000"]
    assert len(client.get("/v1/models").json()["data"]) == 1 + 10_000
    assert store.listings_sent == 2


def test_an_unknown_model_404_names_it_not_every_adapter(client, store):
    """With thousands of adapters, a 404 that listed them all would be megabytes."""
    for i in range(50):
        store.adapters[f"customer-{i}"] = registered(f"customer-{i}", 1, f"/a/{i}")
    body = {"model": "ghost", "prompt": "x", "max_tokens": 1}
    r = client.post("/v1/completions", json=body)
    message = assert_openai_error(r, 404)["message"]
    assert "'ghost'" in message and "/v1/models" in message and "customer-" not in message
