"""Per-tenant quotas and usage totals: the state every Ingress replica shares.

`TenantLedger` is plain Python (tests build it with a fake clock); `cluster/app.py` runs
it as a one-replica Serve deployment beside the AdapterStore, and every Ingress replica
asks it once per request. One shared ledger rather than per-replica shares of each limit
(limit / N replicas): Serve's proxies do not spread a tenant's requests evenly over the
Ingress replicas, and autoscaling changes N, so shares would refuse a tenant under its
limit on one replica while another replica's share sits unused. The price is one small
actor call at admission and one at the end of a request (about a millisecond); if the
ledger restarts, buckets start full again and the usage totals restart from zero.

Buckets: a limit L per window W (a minute) is a bucket of L that refills at L/W per
second. A request takes 1 from the requests bucket and prompt + max_tokens (every
prompt and choice) from the tokens bucket, both or neither; when it ends the tokens it
did not use go back.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

USAGE_FIELDS = ("requests", "prompt_tokens", "cached_tokens", "completion_tokens")


class TokenBucket:
    """`capacity` units, refilled at `rate` per second, never above capacity."""

    def __init__(self, capacity: int, rate: float, now: float) -> None:
        self.capacity, self.rate = capacity, rate
        self.level, self.stamp = float(capacity), now

    def _refill(self, now: float) -> None:
        self.level = min(self.capacity, self.level + (now - self.stamp) * self.rate)
        self.stamp = now

    def wait_s(self, amount: int, now: float) -> float:
        """Seconds until `amount` can be taken (0: now; inf: never, over the capacity)."""
        self._refill(now)
        if amount > self.capacity:
            return math.inf
        return max(0.0, (amount - self.level) / self.rate)

    def take(self, amount: int, now: float) -> None:
        self._refill(now)
        self.level -= amount

    def give(self, amount: int, now: float) -> None:
        self._refill(now)
        self.level = min(self.capacity, self.level + amount)

    def state(self, now: float) -> Limit:
        self._refill(now)
        full_in = (self.capacity - self.level) / self.rate
        return Limit(self.capacity, max(0, math.floor(self.level)), full_in)


@dataclass(frozen=True)
class Limit:
    """One limit as the x-ratelimit-* headers report it."""

    limit: int
    remaining: int
    reset_s: float  # until the bucket is full again


@dataclass(frozen=True)
class Admission:
    """The ledger's answer: admitted (`refused` None) or refused by the `refused` limit
    ('requests' or 'tokens'), retryable after `retry_after_s` (inf: the request alone is
    over the limit). The limits' states after the decision, for the headers."""

    refused: str | None = None
    retry_after_s: float = 0.0
    requests: Limit | None = None
    tokens: Limit | None = None
    requested: int = 0  # of the refused limit


@dataclass
class _Totals:
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(USAGE_FIELDS, 0))
    adapters: dict[str, dict[str, int]] = field(default_factory=dict)

    def add(self, adapter: str, usage: Mapping[str, int]) -> None:
        per_adapter = self.adapters.setdefault(adapter, dict.fromkeys(USAGE_FIELDS, 0))
        for key in USAGE_FIELDS:
            self.counts[key] += usage.get(key, 0)
            per_adapter[key] += usage.get(key, 0)

    def to_dict(self) -> dict[str, Any]:
        return {**self.counts, "adapters": {a: dict(c) for a, c in sorted(self.adapters.items())}}


class TenantLedger:
    """Token buckets and usage totals per tenant. Async methods with no await inside: on
    a Serve replica's event loop each runs whole, so concurrent callers never interleave."""

    def __init__(
        self,
        limits: Mapping[str, tuple[int | None, int | None]],
        window_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`limits`: tenant -> (requests per window, tokens per window), None = no limit."""
        self.clock = clock
        self.since = time.time()
        now = clock()
        self.buckets = {
            tenant: tuple(
                None if limit is None else TokenBucket(limit, limit / window_s, now)
                for limit in pair
            )
            for tenant, pair in limits.items()
        }
        self.totals = {tenant: _Totals() for tenant in limits}

    async def admit(self, tenant: str, tokens: int) -> Admission:
        """Take one request and `tokens` tokens from `tenant`'s buckets, or neither."""
        now = self.clock()
        requests, token_bucket = self.buckets.get(tenant, (None, None))
        for kind, bucket, amount in (("requests", requests, 1), ("tokens", token_bucket, tokens)):
            if bucket is not None and (wait := bucket.wait_s(amount, now)) > 0:
                return self._answer(now, requests, token_bucket, kind, wait, amount)
        for bucket, amount in ((requests, 1), (token_bucket, tokens)):
            if bucket is not None:
                bucket.take(amount, now)
        return self._answer(now, requests, token_bucket)

    async def finish(
        self, tenant: str, refund: int, adapter: str, usage: Mapping[str, int]
    ) -> None:
        """A request ended: `refund` tokens back to the bucket, `usage` to the totals."""
        _, token_bucket = self.buckets.get(tenant, (None, None))
        if token_bucket is not None and refund > 0:
            token_bucket.give(refund, self.clock())
        if tenant in self.totals:
            self.totals[tenant].add(adapter, usage)

    async def usage(self, tenant: str | None = None) -> dict[str, Any]:
        """Totals since start: every tenant's, or `tenant`'s only."""
        names = sorted(self.totals) if tenant is None else [tenant]
        return {
            "object": "usage",
            "since": int(self.since),
            "tenants": {n: self.totals[n].to_dict() for n in names if n in self.totals},
        }

    def _answer(
        self,
        now: float,
        requests: TokenBucket | None,
        tokens: TokenBucket | None,
        refused: str | None = None,
        wait_s: float = 0.0,
        requested: int = 0,
    ) -> Admission:
        return Admission(
            refused,
            wait_s,
            None if requests is None else requests.state(now),
            None if tokens is None else tokens.state(now),
            requested,
        )
