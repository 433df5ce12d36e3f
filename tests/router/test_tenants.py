"""Tenants at the ingress, in-process (fake store and replicas): keys, scopes, quotas with
OpenAI's rate-limit headers, and usage metering. Tenant A may call the base model and
`a-*`, and manage its adapters; tenant B only `b-*`, its key from the environment."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from dataclasses import dataclass, field

import httpx2
import openai
import pytest

from replica.wire import AdapterInfo, Reply
from router.ledger import TenantLedger
from router.tenancy import LocalHandle, key_digest
from tests.fakes import FakeReplicas, FakeStore, registered
from tests.router.client import BASE, ingress_client, served_app

ADMIN_KEY = "admin-key-0123"
KEY_A, KEY_B = "tenant-a-key", "tenant-b-key"
B_ENV = "LORAFLEET_TEST_TENANT_B_KEY"
A = {"Authorization": f"Bearer {KEY_A}"}
B = {"Authorization": f"Bearer {KEY_B}"}
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
TENANT_A = {
    "name": "a",
    "key_sha256": [key_digest(KEY_A)],
    "adapters": ["a-*"],
    "base_model": True,
    "weight": 2.0,
    "manage_adapters": True,
    "adapter_roots": ["/adapters/a"],
}
TENANT_B = {"name": "b", "key_env": B_ENV, "adapters": ["b-*"]}


@dataclass
class Store(FakeStore):
    """FakeStore with loads and unloads, recording the names it was asked to resolve."""

    asked: list[str] = field(default_factory=list)
    roots: list[list[str] | None] = field(default_factory=list)  # each load's, in order

    def _resolve(self, name: str) -> AdapterInfo:
        self.asked.append(name)
        return super()._resolve(name)

    def _register(
        self, name: str, path: str, inplace: bool = False, roots: list[str] | None = None
    ) -> AdapterInfo:
        self.roots.append(roots)
        self.adapters[name] = registered(name, 1, path)
        return self.adapters[name]

    def _unregister(self, name: str) -> AdapterInfo:
        return self.adapters.pop(name) if name in self.adapters else super()._resolve(name)


def _store() -> Store:
    names = ["a-1", "b-1", "c-1"]
    return Store({n: registered(n, 1, f"/adapters/{n}") for n in names})


@pytest.fixture
def tenants(model_dir, monkeypatch):
    """(client, store, replicas) of an ingress with tenants A and B and an admin key."""
    monkeypatch.setenv(B_ENV, KEY_B)
    store, replicas = _store(), FakeReplicas()
    with ingress_client(
        model_dir, store, replicas, api_key=ADMIN_KEY, tenants=[TENANT_A, TENANT_B]
    ) as (client, _):
        yield client, store, replicas


def _complete(client, model: str, headers: dict | None, **extra):
    body = {"model": model, "prompt": "hello there", "max_tokens": 2, **extra}
    return client.post("/v1/completions", json=body, headers=headers or {})


# -- identity and scope ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "headers", [None, {"Authorization": "Bearer nope"}, {"Authorization": KEY_A}]
)
def test_no_key_or_an_unknown_key_is_401_everywhere_but_health(tenants, headers):
    client, _, _ = tenants
    for method, path, body in [
        ("POST", "/v1/completions", {"model": BASE, "prompt": "x"}),
        ("GET", "/v1/models", None),
        ("POST", "/tokenize", {"prompt": "x"}),
        ("GET", "/v1/lorafleet/usage", None),
    ]:
        r = client.request(method, path, json=body, headers=headers or {})
        assert r.status_code == 401, (path, r.text)
        assert r.headers["www-authenticate"] == "Bearer"
    assert client.get("/health").status_code == 200
    for key in (A, B, ADMIN):
        assert client.post("/tokenize", json={"prompt": "x"}, headers=key).status_code == 200


def test_another_tenants_adapter_is_byte_for_byte_the_unknown_name_404(tenants):
    """B's adapter, asked for by A, answers what A would get if it did not exist; the
    store is not even asked (no resolver runs for a name out of scope)."""
    client, store, _ = tenants
    taken = _complete(client, "b-1", A)
    store.adapters.pop("b-1")
    gone = _complete(client, "b-1", A)
    assert taken.status_code == gone.status_code == 404
    assert taken.content == gone.content
    assert taken.headers == gone.headers
    assert json.loads(taken.content) == {
        "error": {
            "message": "The model `b-1` does not exist or you do not have access to it.",
            "type": "invalid_request_error",
            "param": None,
            "code": "model_not_found",
        }
    }
    assert "b-1" not in store.asked
    # an in-scope name that does not exist: the same answer, after asking the store
    missing = _complete(client, "a-missing", A)
    assert missing.content == gone.content.replace(b"b-1", b"a-missing")
    assert store.asked == ["a-missing"]
    # the base model without base_model, one card, /tokenize: the same answer
    assert _complete(client, BASE, B).content == _complete(client, "nothing", B).content.replace(
        b"nothing", BASE.encode()
    )
    assert client.get("/v1/models/a-1", headers=B).content == _complete(client, "a-1", B).content
    r = client.post("/tokenize", json={"model": "a-1", "prompt": "x"}, headers=B)
    assert r.content == _complete(client, "a-1", B).content


def test_each_tenant_lists_and_calls_only_its_scope(tenants):
    client, _, replicas = tenants

    def names(headers):
        r = client.get("/v1/models", headers=headers)
        assert r.status_code == 200
        return [m["id"] for m in r.json()["data"]]

    assert names(A) == [BASE, "a-1"]
    assert names(B) == ["b-1"]
    assert names(ADMIN) == [BASE, "a-1", "b-1", "c-1"]
    assert names(A) == [BASE, "a-1"]  # the cached body is per scope
    assert client.get("/v1/models/a-1", headers=A).json()["id"] == "a-1"
    for model, key in [(BASE, A), ("a-1", A), ("b-1", B), ("c-1", ADMIN)]:
        assert _complete(client, model, key).status_code == 200, model
    assert [r.tenant for r in replicas.requests] == ["a", "a", "b", None]


def test_the_tenant_weight_and_cache_salt_travel_to_the_replica(tenants):
    client, _, replicas = tenants
    assert _complete(client, "a-1", A, cache_salt="s1").status_code == 200
    chat = {"model": "b-1", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert client.post("/v1/chat/completions", json=chat, headers=B).status_code == 200
    sent = [(r.tenant, r.tenant_weight, r.cache_salt) for r in replicas.requests]
    assert sent == [("a", 2.0, "s1"), ("b", 1.0, None)]


def test_without_tenants_the_salt_still_travels_and_nothing_is_metered(client, replicas):
    assert _complete(client, BASE, None, cache_salt="z").status_code == 200
    assert (replicas.requests[-1].tenant, replicas.requests[-1].cache_salt) == (None, "z")
    r = _complete(client, BASE, None, cache_salt="")
    assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt"
    assert "x-ratelimit-limit-requests" not in _complete(client, BASE, None).headers
    assert client.get("/v1/lorafleet/usage").status_code == 404


def test_managing_adapters_is_confined_to_the_tenants_patterns(tenants):
    client, store, _ = tenants

    def load(name, headers):
        body = {"lora_name": name, "lora_path": "/adapters/x"}
        return client.post("/v1/load_lora_adapter", json=body, headers=headers)

    def unload(name, headers):
        return client.post("/v1/unload_lora_adapter", json={"lora_name": name}, headers=headers)

    assert load("a-new", A).status_code == 200 and "a-new" in store.adapters
    assert store.roots == [["/adapters/a"]]  # the store confines A's loads to its own roots
    r = load("b-new", A)
    assert r.status_code == 403 and "a-*" in r.json()["error"]["message"]
    assert "b-new" not in store.adapters
    # B's adapter: the unknown-name 404, and still there
    assert unload("b-1", A).content == _complete(client, "b-1", A).content
    assert "b-1" in store.adapters
    assert unload("a-gone", A).content == _complete(client, "a-gone", A).content
    assert unload("a-new", A).status_code == 200 and "a-new" not in store.adapters
    # B may not manage at all; the admin may manage anything
    assert load("b-new", B).status_code == 403 and unload("b-1", B).status_code == 403
    assert unload("b-1", ADMIN).status_code == 200 and "b-1" not in store.adapters
    assert load("b-2", ADMIN).status_code == 200 and store.roots[-1] is None  # the app's roots
    assert load("b-1", {}).status_code == 401
    # the admin-only endpoints refuse a tenant
    assert client.get("/v1/lorafleet/stats", headers=A).status_code == 403
    assert client.get("/v1/lorafleet/stats", headers=ADMIN).status_code == 200


# -- quotas ------------------------------------------------------------------------------------


def _limited(model_dir, ledger=None, window_s: float = 60.0, **limits):
    tenant = {**TENANT_A, **limits}
    return ingress_client(
        model_dir, _store(), None, ledger, tenants=[tenant], rate_limit_window_s=window_s
    )


def test_requests_over_the_limit_get_openai_429s_and_every_answer_the_headers(model_dir):
    with _limited(model_dir, requests_per_minute=2) as (client, _):
        first = _complete(client, "a-1", A)
        streamed = _complete(client, "a-1", A, stream=True)
        refused = _complete(client, "a-1", A)
    for r, remaining in ((first, "1"), (streamed, "0")):
        assert r.status_code == 200
        assert r.headers["x-ratelimit-limit-requests"] == "2"
        assert r.headers["x-ratelimit-remaining-requests"] == remaining
        assert r.headers["x-ratelimit-reset-requests"].endswith("s")
        assert "x-ratelimit-limit-tokens" not in r.headers  # no token limit set
    assert refused.status_code == 429
    error = refused.json()["error"]
    assert error["type"] == "requests" and error["code"] == "rate_limit_exceeded"
    assert error["param"] is None and "Please try again in" in error["message"]
    wait_ms = int(refused.headers["retry-after-ms"])
    assert 20_000 < wait_ms <= 30_000  # a request refills in 30 s at 2 per minute
    assert refused.headers["retry-after"] == str(-(-wait_ms // 1000))
    assert refused.headers["x-ratelimit-remaining-requests"] == "0"


def test_tokens_are_charged_at_admission_and_refunded_to_actual_use(model_dir, tokenizer):
    prompt = len(tokenizer("hello there")["input_ids"])
    limit = 2 * (prompt + 10) + 1
    with _limited(model_dir, tokens_per_minute=limit) as (client, _):
        first = _complete(client, "a-1", A, max_tokens=10)  # the fake replica makes 2
        second = _complete(client, "a-1", A, max_tokens=10)
        third = _complete(client, "a-1", A, max_tokens=10)
        too_large = _complete(client, "a-1", A, max_tokens=limit)
    assert first.headers["x-ratelimit-limit-tokens"] == str(limit)
    assert first.headers["x-ratelimit-remaining-tokens"] == str(limit - prompt - 10)
    # the first request's 8 unused tokens came back before the second was charged
    assert second.headers["x-ratelimit-remaining-tokens"] == str(limit - 2 * prompt - 12)
    assert third.status_code == 200  # it fits only thanks to the refunds
    assert first.json()["usage"]["completion_tokens"] == 2
    assert too_large.status_code == 429
    assert too_large.json()["error"]["type"] == "tokens"
    assert too_large.headers["x-should-retry"] == "false"  # waiting would not help
    assert "retry-after" not in too_large.headers


def test_the_openai_sdk_retries_after_the_reset_and_succeeds(model_dir):
    """One request per 0.5 s window: the SDK's second call gets a 429, waits what
    retry-after-ms says, and succeeds."""
    with _limited(model_dir, window_s=0.5, requests_per_minute=1) as (_, __):

        async def two_calls() -> tuple[float, int]:
            transport = httpx2.ASGITransport(app=served_app())
            async with httpx2.AsyncClient(transport=transport) as http:
                sdk = openai.AsyncOpenAI(
                    base_url="http://ingress/v1", api_key=KEY_A, http_client=http, max_retries=2
                )
                await sdk.completions.create(model="a-1", prompt="hi", max_tokens=2)
                started = time.monotonic()
                raw = await sdk.completions.with_raw_response.create(
                    model="a-1", prompt="hi", max_tokens=2
                )
                assert raw.parse().usage.completion_tokens == 2
                return time.monotonic() - started, raw.retries_taken

        waited, retries = asyncio.run(two_calls())
    assert retries == 1
    assert 0.3 < waited < 2.0


def test_limits_hold_across_ingress_replicas_sharing_the_ledger(model_dir):
    """Two Ingress objects (as two Serve replicas) with one TenantLedger: the second
    refuses what the first used up; a ledger per replica would have admitted it."""
    shared = LocalHandle(TenantLedger({"a": (2, None)}, 60.0))
    with _limited(model_dir, shared, requests_per_minute=2) as (client, _):
        assert [_complete(client, "a-1", A).status_code for _ in range(2)] == [200, 200]
    with _limited(model_dir, shared, requests_per_minute=2) as (client, _):
        assert _complete(client, "a-1", A).status_code == 429
    with _limited(model_dir, None, requests_per_minute=2) as (client, _):  # its own ledger
        assert _complete(client, "a-1", A).status_code == 200


# -- metering ----------------------------------------------------------------------------------


def test_usage_totals_equal_the_usage_the_clients_received(tenants):
    tenant_client, _, replicas = tenants

    def script(r):  # per choice: a token, then two more and the end
        ends = [
            Reply((6, 7), "length", num_prompt_tokens=len(r.prompt_ids), index=i)
            for i in range(r.sampling.n)
        ]
        ends[-1] = dataclasses.replace(ends[-1], num_cached_tokens=1)
        return [*(Reply((5,), index=i) for i in range(r.sampling.n)), *ends]

    replicas.script = script
    received: dict[str, dict[str, dict[str, int]]] = {"a": {}, "b": {}}

    def add(tenant: str, model: str, usage: dict) -> None:
        totals = received[tenant].setdefault(model, dict.fromkeys(USAGE, 0))
        totals["requests"] += 1
        totals["prompt_tokens"] += usage["prompt_tokens"]
        totals["cached_tokens"] += usage["prompt_tokens_details"]["cached_tokens"]
        totals["completion_tokens"] += usage["completion_tokens"]

    for tenant, key, model, extra in [
        ("a", A, BASE, {}),
        ("a", A, "a-1", {"prompt": ["one", "two three"], "n": 2, "max_tokens": 3}),
        ("a", A, "a-1", {}),
        ("b", B, "b-1", {"prompt": "a longer prompt for b"}),
    ]:
        r = _complete(tenant_client, model, key, **extra)
        assert r.status_code == 200
        add(tenant, model, r.json()["usage"])
    stream = {"stream": True, "stream_options": {"include_usage": True}}
    r = _complete(tenant_client, "b-1", B, **stream)
    last = json.loads(r.text.split("data: ")[-2])
    add("b", "b-1", last["usage"])

    everyone = tenant_client.get("/v1/lorafleet/usage", headers=ADMIN).json()["tenants"]
    assert set(everyone) == {"a", "b"}
    for tenant, per_model in received.items():
        got = everyone[tenant]
        assert got["adapters"] == per_model
        for key in USAGE:
            assert got[key] == sum(m[key] for m in per_model.values())
    own = tenant_client.get("/v1/lorafleet/usage", headers=B).json()["tenants"]
    assert own == {"b": everyone["b"]}


USAGE = ("requests", "prompt_tokens", "cached_tokens", "completion_tokens")
