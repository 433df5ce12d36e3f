"""Bad input gets a 4xx that names the problem: never a 5xx, never a hang.

Hand-written hostile requests, then bodies generated from the server's own OpenAPI
schema (hypothesis-jsonschema) and arbitrary JSON, all against the live application."""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

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
    ({"model": "tiny-base", "prompt": "x", "n": 2}, "n=1"),
    ({"model": "tiny-base", "prompt": "x", "logprobs": 3}, "logprobs"),
    ({"model": "tiny-base", "prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"model": "tiny-base", "prompt": [1, -2, 3]}, "prompt"),
    ({"model": "tiny-base", "prompt": [10**9]}, "out of range"),
    ({"model": "tiny-base", "prompt": "x " * (2 * MAX_MODEL_LEN)}, "maximum model length"),
    ({"model": "tiny-base", "prompt": ["a", "b"]}, "one prompt"),
    ({"model": "nope", "prompt": "x"}, "does not exist"),
    ({"model": "tiny-base", "prompt": "x", "stream_options": {"include_usage": True}}, "stream"),
]


@pytest.mark.parametrize("body, needle", BAD_COMPLETIONS, ids=[n for _, n in BAD_COMPLETIONS])
def test_bad_completion_requests_are_4xx_naming_the_problem(cluster, body, needle):
    r = post(cluster, "/v1/completions", body)
    assert 400 <= r.status_code < 500, r.text
    assert needle in r.json()["error"]["message"], r.text


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
        assert r.json()["error"]["message"]


def test_bad_chat_requests_are_400(cluster):
    for body in [
        {"model": "tiny-base", "messages": []},
        {"model": "tiny-base", "messages": [{"role": "wizard", "content": "hi"}]},
        {"model": "tiny-base", "messages": [{"content": "hi"}]},
        {"model": "tiny-base", "messages": "hi"},
        {"model": "tiny-base", "messages": [{"role": "user", "content": "hi"}], "n": 3},
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


ANY_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=12), c, max_size=4),
    max_leaves=10,
)
_BY_TYPE = {
    "string": st.text(max_size=30),
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


def test_fuzzed_bodies_never_get_a_5xx(cluster):
    schemas, components = _request_schemas(cluster)
    assert {"/v1/completions", "/v1/chat/completions", "/v1/load_lora_adapter"} <= set(schemas)
    cases = st.one_of(
        *(st.tuples(st.just(path), _from_schema(schemas[path], components)) for path in schemas)
    )
    seen = []

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
        # json.dumps writes NaN/Infinity, which Python's parser (the server's) accepts
        r = httpx.post(
            cluster["url"] + path,
            content=json.dumps(body),
            headers={"content-type": "application/json", **ADMIN},
            timeout=60,
        )
        seen.append(r.status_code)
        assert r.status_code < 500, (path, body, r.status_code, r.text)

    check()
    assert len(seen) >= 100 and any(s == 400 for s in seen)
