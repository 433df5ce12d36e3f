"""Bad input gets a 4xx that names the problem, with an OpenAI error body: never a 5xx,
never a hang, never a plain-text error.

Hand-written hostile requests, then bodies generated from the server's own OpenAPI
schema and arbitrary JSON, their strings holding what JSON can carry and text handling
trips on (lone surrogates, NULs, mixed normalization forms), all against the live
application."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.net import assert_openai_error
from tests.reliability.conftest import ADMIN, MAX_MODEL_LEN, complete, post

pytestmark = pytest.mark.serve

BAD_COMPLETIONS = [
    ({"prompt": "no model"}, "model"),
    ({"model": "tiny-base"}, "prompt"),
    ({"model": "tiny-base", "prompt": ""}, "empty"),
    ({"model": "tiny-base", "prompt": []}, "empty"),
    ({"model": "tiny-base", "prompt": "x", "max_tokens": -1}, "max_tokens"),
    ({"model": "tiny-base", "prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"model": "tiny-base", "prompt": "x", "max_tokens": 10**12}, "maximum model length"),
    ({"model": "tiny-base", "prompt": "x", "max_tokens": "many"}, "max_tokens"),
    ({"model": "tiny-base", "prompt": "x", "temperature": -0.5}, "temperature"),
    ({"model": "tiny-base", "prompt": "x", "temperature": 1e9}, "temperature"),
    ({"model": "tiny-base", "prompt": "x", "top_p": 0}, "top_p"),
    ({"model": "tiny-base", "prompt": "x", "top_p": 1.5}, "top_p"),
    ({"model": "tiny-base", "prompt": "x", "top_k": -7}, "top_k"),
    ({"model": "tiny-base", "prompt": "x", "seed": 2**64}, "seed"),
    ({"model": "tiny-base", "prompt": "x", "n": 17}, "n"),
    ({"model": "tiny-base", "prompt": "x", "logprobs": 21}, "logprobs"),
    ({"model": "tiny-base", "prompt": "x", "logit_bias": {"999999": 1}}, "logit_bias"),
    ({"model": "tiny-base", "prompt": "x", "presence_penalty": 2.5}, "presence_penalty"),
    ({"model": "tiny-base", "prompt": "x", "max_tokens": 0}, "echo"),
    ({"model": "tiny-base", "prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"model": "tiny-base", "prompt": [1, -2, 3]}, "prompt"),
    ({"model": "tiny-base", "prompt": [10**9]}, "out of range"),
    ({"model": "tiny-base", "prompt": "x " * (2 * MAX_MODEL_LEN)}, "maximum model length"),
    ({"model": "tiny-base", "prompt": ["a", ""]}, "empty"),
    ({"model": "nope", "prompt": "x"}, "does not exist"),
    ({"model": "tiny-base", "prompt": "x", "stream_options": {"include_usage": True}}, "stream"),
]


@pytest.mark.parametrize("body, needle", BAD_COMPLETIONS, ids=[n for _, n in BAD_COMPLETIONS])
def test_bad_completion_requests_are_4xx_naming_the_problem(cluster, body, needle):
    r = post(cluster, "/v1/completions", body)
    assert 400 <= r.status_code < 500, r.text
    assert needle in assert_openai_error(r)["message"], r.text


def _post_raw(cluster, path: str, body: object) -> httpx.Response:
    # json.dumps writes a lone surrogate as its \ud800 escape: valid JSON
    return httpx.post(
        cluster["url"] + path,
        content=json.dumps(body),
        headers={"content-type": "application/json", **ADMIN},
        timeout=60,
    )


CHAT = {"model": "tiny-base", "max_tokens": 2}
SURROGATES = [
    ("/v1/completions", {"model": "tiny-base", "prompt": "hi \ud800"}, "prompt"),
    ("/v1/completions", {"model": "tiny-base", "prompt": ["\udfff x"]}, "prompt.0"),
    ("/v1/completions", {"model": "tiny-base", "prompt": "x", "stop": "\udc00"}, "stop"),
    ("/v1/completions", {"model": "adapter-00\ud800", "prompt": "x"}, "model"),
    (
        "/v1/chat/completions",
        {**CHAT, "messages": [{"role": "user", "content": "a\ud83db"}]},
        "messages.0.content",
    ),
    (
        "/v1/chat/completions",
        {**CHAT, "messages": [{"role": "user", "content": "x", "name": "\udfff"}]},
        "messages.0.name",
    ),
    ("/tokenize", {"prompt": "\ud800"}, "prompt"),
    ("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/tmp/\ud800"}, "lora_path"),
]


@pytest.mark.parametrize("path, body, param", SURROGATES, ids=[p for _, _, p in SURROGATES])
def test_lone_surrogates_are_400_naming_the_field(cluster, path, body, param):
    """Valid JSON, not valid Unicode: once a plain-text 500 from the tokenizer."""
    r = _post_raw(cluster, path, body)
    assert r.status_code == 400, r.text
    error = assert_openai_error(r)
    assert error["param"] == param and "lone surrogate" in error["message"], error


@pytest.mark.parametrize(
    "text",
    ["nul\x00inside", "\x00", "e\u0301 \u00e9 \u212b \u00c5 \ufb01 \u1100\u1161 \uac00"],
    ids=["nul", "only-nul", "mixed-normalization"],
)
def test_nuls_and_mixed_normalization_forms_are_served(cluster, text):
    r = _post_raw(
        cluster, "/v1/completions", {"model": "adapter-01", "prompt": text, "max_tokens": 2}
    )
    assert r.status_code == 200, r.text
    chat = {**CHAT, "messages": [{"role": "user", "content": text}], "stream": True}
    r = _post_raw(cluster, "/v1/chat/completions", chat)
    assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n"), r.text
    assert '"error"' not in r.text


@pytest.mark.parametrize(
    "raw",
    [b"{", b"null", b"[]", b'"text"', b"\xff\xfe", b'{"model": "tiny-base", "prompt": "x"'],
)
def test_malformed_json_is_400(cluster, raw):
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/load_lora_adapter"):
        r = httpx.post(
            cluster["url"] + path,
            content=raw,
            headers={"content-type": "application/json", **ADMIN},
            timeout=30,
        )
        assert r.status_code == 400, (path, raw, r.text)
        assert_openai_error(r)


def test_malformed_json_says_where_and_names_no_param(cluster):
    """The parser's message and its line and column: not FastAPI's "JSON decode error"
    with the character offset posing as the param."""
    raw = b'{"model": "tiny-base",\n "prompt": "x",}'
    r = httpx.post(
        cluster["url"] + "/v1/completions",
        content=raw,
        headers={"content-type": "application/json"},
        timeout=30,
    )
    assert r.status_code == 400, r.text
    error = assert_openai_error(r)
    assert error["message"] == (
        "Invalid JSON body: Expecting property name enclosed in double quotes (line 2 column 16)"
    )
    assert error["param"] is None


@pytest.mark.parametrize("content_type", [None, "application/x-www-form-urlencoded", "text/plain"])
def test_a_json_body_without_a_json_content_type_is_read_as_json(cluster, content_type):
    """What `curl -d` sends without -H (form-urlencoded), or a client that sends none."""
    body = json.dumps({"model": "tiny-base", "prompt": "hi", "max_tokens": 2}).encode()
    request = httpx.Request("POST", cluster["url"] + "/v1/completions", content=body)
    request.headers.pop("content-type", None)  # httpx sends none for bytes: make sure
    if content_type is not None:
        request.headers["content-type"] = content_type
    with httpx.Client(timeout=60) as client:
        r = client.send(request)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] in ("length", "stop")


def test_bad_chat_requests_are_400(cluster):
    for body in [
        {"model": "tiny-base", "messages": []},
        {"model": "tiny-base", "messages": [{"role": "wizard", "content": "hi"}]},
        {"model": "tiny-base", "messages": [{"content": "hi"}]},
        {"model": "tiny-base", "messages": "hi"},
        {"model": "tiny-base", "messages": [{"role": "user", "content": "hi"}], "n": 17},
        {"model": "tiny-base", "messages": [{"role": "user", "content": "hi"}], "tools": [{}]},
        {"model": "tiny-base", "messages": [{"role": "user", "content": "hi"}], "echo": True},
        {
            "model": "tiny-base",
            "messages": [{"role": "user", "content": "hi"}],
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "nonsense"}},
            },
        },
    ]:
        r = post(cluster, "/v1/chat/completions", body)
        assert r.status_code == 400, (body, r.text)


def test_bad_adapter_requests_are_4xx(cluster, assets):
    for body, status in [
        ({"lora_name": "x", "lora_path": "/etc\x00/passwd"}, 400),
        ({"lora_name": "x", "lora_path": "/nonexistent/dir"}, 400),
        ({"lora_name": "../x", "lora_path": str(assets.adapters["adapter-03"])}, 400),
        ({"lora_name": "", "lora_path": str(assets.adapters["adapter-03"])}, 400),
        ({"lora_name": "x"}, 400),
    ]:
        r = post(cluster, "/v1/load_lora_adapter", body, ADMIN)
        assert r.status_code == status, (body, r.text)
    r = post(cluster, "/v1/unload_lora_adapter", {"lora_name": "ghost"}, ADMIN)
    assert r.status_code == 404, r.text


def test_hostile_sampling_values_still_answer(cluster):
    """Values validation lets through but that once broke the sampler (and the batch)."""
    for extra in [
        {"temperature": 1e-300},
        {"temperature": 2.0, "top_p": 1e-300},
        {"temperature": 1.0, "seed": 2**63 - 1},
        {"temperature": 1.0, "seed": -(2**63)},
        {"temperature": 1.0, "top_k": 10**9},
    ]:
        r = complete(cluster, "adapter-00", **extra)
        assert r.status_code == 200, (extra, r.text)


def _request_schemas(cluster) -> tuple[dict[str, dict], dict]:
    """POST path -> its JSON request body schema, from the server's /openapi.json; and
    the spec's component schemas (what $refs point at)."""
    spec = httpx.get(cluster["url"] + "/openapi.json", timeout=30).json()
    out = {}
    for path, ops in spec["paths"].items():
        body = ops.get("post", {}).get("requestBody")
        if body:
            out[path] = body["content"]["application/json"]["schema"]
    return out, spec["components"]["schemas"]


# Pieces of text that are valid JSON but trip text handling: lone surrogates (valid JSON
# escapes, not Unicode), NULs, and one letter in several normalization forms (NFC and NFD
# é, the Angstrom sign and Å, a ligature, Hangul as jamo and as a syllable).
TRICKY = [
    "\ud800", "\udfff", "\udbff\udc00\udbff", "\x00", "a\x00b",
    "e\u0301", "\u00e9", "\u212b", "\u00c5", "\ufb01", "\u1100\u1161", "\uac00", "\u0301",
]  # fmt: skip


def _text(max_size: int) -> st.SearchStrategy[str]:
    """Any code points (st.characters includes surrogates, st.text does not), with the
    tricky pieces mixed in."""
    piece = st.characters() | st.sampled_from(TRICKY)
    return st.lists(piece, max_size=max_size).map("".join)


ANY_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | _text(20),
    lambda c: st.lists(c, max_size=4) | st.dictionaries(_text(12), c, max_size=4),
    max_leaves=10,
)
_BY_TYPE = {
    "string": _text(30),
    "integer": st.integers(-(2**70), 2**70) | st.integers(-3, 40),
    "number": st.floats() | st.floats(-3, 3),
    "boolean": st.booleans(),
    "null": st.none(),
}


def _from_schema(schema: dict, components: dict, depth: int = 0) -> st.SearchStrategy:
    """Values shaped like `schema` (OpenAPI 3.1 subset: $ref, anyOf, type, properties,
    items, enum), with arbitrary JSON mixed in at every level: mostly near-valid bodies."""
    if "$ref" in schema:
        schema = components[schema["$ref"].rsplit("/", 1)[-1]]
    options = [ANY_JSON]
    if "enum" in schema:
        options.append(st.sampled_from(schema["enum"]))
    for sub in schema.get("anyOf", []):
        options.append(_from_schema(sub, components, depth + 1))
    kind = schema.get("type")
    if kind in _BY_TYPE:
        options.append(_BY_TYPE[kind])
    elif kind == "array" and depth < 4:
        item = _from_schema(schema.get("items", {}), components, depth + 1)
        options.append(st.lists(item, max_size=4))
    elif (kind == "object" or "properties" in schema) and depth < 4:
        props = schema.get("properties", {})
        fields = {k: _from_schema(v, components, depth + 1) for k, v in props.items()}
        options.append(st.fixed_dictionaries({}, optional=fields))
    return st.one_of(*reversed(options))  # shrinks toward the schema-shaped choices


def _strings(value: object) -> Iterator[str]:
    """Every string of a JSON value, keys included."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield key
            yield from _strings(item)
    elif isinstance(value, list):
        for item in value:
            yield from _strings(item)


_CORE_FIELDS = {"model", "prompt", "messages", "max_tokens", "lora_name", "lora_path"}


def test_fuzzed_bodies_never_get_a_5xx(cluster):
    schemas, components = _request_schemas(cluster)
    assert {"/v1/completions", "/v1/chat/completions", "/v1/load_lora_adapter"} <= set(schemas)
    cases = st.one_of(
        *(st.tuples(st.just(path), _from_schema(schemas[path], components)) for path in schemas)
    )
    seen = []
    sent = {"surrogate": 0, "nul": 0, "combining": 0}

    @settings(
        max_examples=120,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
    )
    @given(cases)
    def check(case):
        path, body = case
        if isinstance(body, dict) and path != "/v1/load_lora_adapter":
            # keep generations short, and half of them on a real model
            if isinstance(body.get("max_tokens"), int) and body["max_tokens"] > 8:
                body["max_tokens"] = 8
            body.pop("max_completion_tokens", None)
            if "model" in body and len(seen) % 2:
                body["model"] = "tiny-base"
            if len(seen) % 4 == 1:
                # every field is honoured or refused, so a random mix of them is almost
                # always a 400: a quarter keep only the core fields, to reach the model too
                body = {k: v for k, v in body.items() if k in _CORE_FIELDS}
        # json.dumps writes NaN/Infinity, which Python's parser (the server's) accepts, and
        # lone surrogates as \ud800 escapes
        content = json.dumps(body)
        text = "".join(_strings(body))
        sent["surrogate"] += any(0xD800 <= ord(c) < 0xE000 for c in text)
        sent["nul"] += "\x00" in text
        sent["combining"] += "\u0301" in text
        r = httpx.post(
            cluster["url"] + path,
            content=content,
            headers={"content-type": "application/json", **ADMIN},
            timeout=60,
        )
        seen.append(r.status_code)
        assert r.status_code < 500, (path, body, r.status_code, r.text)
        if r.status_code >= 400:
            assert_openai_error(r)

    check()
    assert len(seen) >= 100 and any(s == 400 for s in seen)
    assert any(s == 200 for s in seen), seen
    assert all(sent.values()), sent  # the generator did reach the tricky text
