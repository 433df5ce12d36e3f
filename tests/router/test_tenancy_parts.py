"""The tenancy parts with plain data: the tenants' config, token buckets and the ledger on
a fake clock, the metrics' label cap."""

from __future__ import annotations

import asyncio
import math

import pydantic
import pytest

from router.ledger import TenantLedger, TokenBucket
from router.metrics import LabelCap, TenantMetrics
from router.options import IngressOptions, TenantConfig
from router.tenancy import Tenancy, key_digest

DIGEST = key_digest("k")


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_digest_is_sha256_of_the_key_as_sha256sum_prints_it():
    assert DIGEST == "8254c329a92850f6d539dd376f4816ee2764517da5e0235514af433164480d7a"
    assert TenantConfig(name="t", key_sha256=[DIGEST.upper()]).key_sha256 == [DIGEST]


@pytest.mark.parametrize(
    "tenants, message",
    [
        ([{"name": "t"}], "needs key_sha256 or key_env"),
        ([{"name": "t", "key_sha256": ["abc"]}], "64 hex digits"),
        ([{"name": "t", "key_sha256": ["g" * 64]}], "64 hex digits"),
        ([{"name": "t", "key_env": "E"}, {"name": "t", "key_env": "F"}], "unique: t"),
        ([{"name": "t", "key_sha256": [DIGEST]}, {"name": "u", "key_sha256": [DIGEST]}], "two"),
        ([{"name": "t", "key_env": "E", "weight": 0}], "weight"),
        ([{"name": "t", "key_env": "E", "requests_per_minute": 0}], "requests_per_minute"),
        ([{"name": "t", "key_env": "E", "adapter": ["x"]}], "adapter"),
        ([{"name": "t", "key_env": "E", "manage_adapters": True}], "needs adapter_roots"),
    ],
)
def test_invalid_tenants_are_refused_naming_the_problem(tenants, message):
    with pytest.raises(pydantic.ValidationError, match=message):
        IngressOptions(tenants=tenants)


def test_a_key_env_missing_at_start_is_an_error_naming_it():
    options = IngressOptions(tenants=[{"name": "t", "key_env": "LORAFLEET_T_KEY"}])
    with pytest.raises(ValueError, match="tenant 't': key_env LORAFLEET_T_KEY is not set"):
        Tenancy(options, None, environ={})
    tenancy = Tenancy(options, None, environ={"LORAFLEET_T_KEY": "secret"})
    assert tenancy.identify("Bearer secret").name == "t"


def test_a_bucket_refills_at_its_rate_up_to_its_capacity():
    bucket = TokenBucket(10, 2.0, now=0.0)
    assert bucket.wait_s(10, 0.0) == 0 and bucket.wait_s(11, 0.0) == math.inf
    bucket.take(10, 0.0)
    assert bucket.wait_s(4, 0.0) == pytest.approx(2.0)
    assert bucket.state(1.0).remaining == 2
    assert bucket.state(1.0).reset_s == pytest.approx(4.0)
    bucket.give(100, 1.0)  # a refund never fills past the capacity
    assert bucket.state(1.0).remaining == 10 and bucket.state(50.0).remaining == 10


def test_the_ledger_takes_both_limits_or_neither_and_refunds():
    clock = Clock()
    ledger = TenantLedger({"a": (2, 100), "free": (None, None)}, 60.0, clock)

    def admit(tenant, tokens):
        return asyncio.run(ledger.admit(tenant, tokens))

    first = admit("a", 60)
    assert first.refused is None and (first.requests.remaining, first.tokens.remaining) == (1, 40)
    refused = admit("a", 50)  # tokens short: the request is not taken either
    assert refused.refused == "tokens" and refused.requested == 50
    assert refused.retry_after_s == pytest.approx(10 * 60 / 100)
    assert refused.requests.remaining == 1
    asyncio.run(ledger.finish("a", 30, "m", {"requests": 1, "completion_tokens": 5}))
    second = admit("a", 50)  # fits after the refund
    assert second.refused is None and second.tokens.remaining == 20
    third = admit("a", 1)
    assert third.refused == "requests" and third.retry_after_s == pytest.approx(30.0)
    clock.now += 30.0  # one request refilled
    assert admit("a", 1).refused is None
    assert admit("free", 10**9).requests is None  # no limits: always admitted, no headers
    usage = asyncio.run(ledger.usage("a"))["tenants"]
    assert usage == {
        "a": {
            "requests": 1,
            "prompt_tokens": 0,
            "cached_tokens": 0,
            "completion_tokens": 5,
            "adapters": {
                "m": {"requests": 1, "prompt_tokens": 0, "cached_tokens": 0, "completion_tokens": 5}
            },
        }
    }


def test_metric_labels_are_capped():
    tenants = LabelCap(["t1", "t2", "t3"], 2)
    assert [tenants(t) for t in ("t1", "t2", "t3", "zz")] == ["t1", "t2", "other", "other"]
    models = LabelCap((), 2, first_seen=True)
    assert [models(m) for m in ("x", "y", "z", "x")] == ["x", "y", "other", "x"]


def test_tenant_metrics_count_usage_under_capped_labels():
    metrics = TenantMetrics(["t1", "t2"], 1)
    seen = []

    class Recorder:
        def __init__(self, name):
            self.name = name

        def inc(self, value, tags):
            seen.append((self.name, value, tags["tenant"], tags["model"]))

    metrics.counters = {name: Recorder(name) for name in metrics.counters}
    counts = {"requests": 1, "prompt_tokens": 7, "cached_tokens": 0, "completion_tokens": 3}
    metrics.record("t1", "m1", counts)
    metrics.record("t2", "m2", counts)
    assert seen == [
        ("requests", 1, "t1", "m1"),
        ("prompt_tokens", 7, "t1", "m1"),  # nothing cached: no increment of 0
        ("completion_tokens", 3, "t1", "m1"),
        ("requests", 1, "other", "other"),
        ("prompt_tokens", 7, "other", "other"),
        ("completion_tokens", 3, "other", "other"),
    ]
