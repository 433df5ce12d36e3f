"""Tenants at the ingress: who a key belongs to, what it may see, its quotas, its usage.

The Ingress asks `Tenancy.identify` once per request and gets a `Caller`; everything
after that (scope checks, admission, metering) goes through the caller. Without tenants
configured every caller is `OPEN` or the admin, with every right, and nothing is
charged or metered: the ingress behaves as it did before tenants.

Keys are never kept: the config lists SHA-256 digests (or names an environment variable,
whose key is digested at start), and a bearer token is digested and compared with every
known digest in constant time. A name outside a tenant's patterns answers exactly as a
name that does not exist (`unknown_model`), so no tenant learns another's adapter names.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import math
import os
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import Any

from router.errors import ForbiddenError, NotFoundError, TooManyRequestsError, UnauthorizedError
from router.ledger import Admission, Limit, TenantLedger
from router.metrics import TenantMetrics
from router.options import IngressOptions, TenantConfig


def key_digest(key: str) -> str:
    """The hex SHA-256 of a key, as `key_sha256` lists it (`printf %s KEY | sha256sum`)."""
    return hashlib.sha256(key.encode()).hexdigest()


def unknown_model(model: str) -> NotFoundError:
    """OpenAI's answer for a model that does not exist or that the tenant may not use: the
    same bytes either way."""
    error = NotFoundError(f"The model `{model}` does not exist or you do not have access to it.")
    error.type, error.code = "invalid_request_error", "model_not_found"
    return error


class RateLimitError(TooManyRequestsError):
    """OpenAI's 429: type 'requests' or 'tokens', code 'rate_limit_exceeded'."""

    code = "rate_limit_exceeded"


@dataclass(frozen=True)
class Caller:
    """Who sent a request. `tenant` None: the admin key, or no tenants configured."""

    tenant: TenantConfig | None = None
    admin: bool = False

    @property
    def name(self) -> str | None:
        return None if self.tenant is None else self.tenant.name

    def may_use(self, model: str, base_model: str) -> bool:
        """May call, see or resolve `model` (the base model's name or an adapter's)."""
        if self.tenant is None:
            return True
        if model == base_model:
            return self.tenant.base_model
        return any(fnmatchcase(model, pattern) for pattern in self.tenant.adapters)


OPEN = Caller()  # no tenants, and no key required


@dataclass(frozen=True)
class Lease:
    """An admitted request: what it was charged, and the headers its response carries."""

    caller: Caller
    charged: int = 0
    headers: Mapping[str, str] = field(default_factory=dict)


class Tenancy:
    """Identity, scope, quotas and metering for one Ingress replica. `ledger` is the
    shared TenantLedger's handle (None: a ledger of this process, for a single ingress
    and tests)."""

    def __init__(
        self,
        options: IngressOptions,
        admin_key: str | None,
        ledger: Any = None,
        environ: Mapping[str, str] = os.environ,
    ) -> None:
        self.options = options
        self.tenants = options.tenants
        self._admin_key = None if admin_key is None else admin_key.encode()
        self._digests = [(bytes.fromhex(d), t) for t in self.tenants for d in _digests(t, environ)]
        if self.tenants and ledger is None:
            ledger = LocalHandle(TenantLedger(*ledger_args(options)))
        self.ledger = ledger
        self.metrics = (
            TenantMetrics([t.name for t in self.tenants], options.tenant_metric_labels)
            if self.tenants
            else None
        )

    @property
    def enabled(self) -> bool:
        return bool(self.tenants)

    def identify(self, authorization: str | None, admin: bool = False) -> Caller:
        """The caller of a request with this Authorization header; 401 without a valid key
        where one is needed (tenants: everywhere; else: admin endpoints, and inference
        with api_key_for_inference); 403 for a tenant on an `admin` endpoint."""
        if not self.enabled:
            if self._admin_key is None or not (admin or self.options.api_key_for_inference):
                return OPEN
            if self._is_admin(_bearer(authorization)):
                return Caller(admin=True)
            raise _unauthorized()
        token = _bearer(authorization)
        if self._is_admin(token):
            return Caller(admin=True)
        if not token:
            raise _unauthorized()
        digest = hashlib.sha256(token).digest()
        found = None
        for known, tenant in self._digests:  # every one: the time says nothing of which
            if hmac.compare_digest(digest, known):
                found = tenant
        if found is None:
            raise _unauthorized()
        if admin:
            raise ForbiddenError(f"tenant {found.name!r}: this endpoint needs the admin key")
        return Caller(found)

    def _is_admin(self, token: bytes) -> bool:
        return self._admin_key is not None and hmac.compare_digest(token, self._admin_key)

    def manager(self, authorization: str | None) -> Caller:
        """The caller of a load or unload: the admin (no tenants: as the admin endpoints
        always were), or a tenant with manage_adapters (403 for other tenants; the
        route confines it to its patterns)."""
        if not self.enabled:
            return self.identify(authorization, admin=True)
        caller = self.identify(authorization)
        if caller.tenant is not None and not caller.tenant.manage_adapters:
            raise ForbiddenError(f"tenant {caller.name!r} may not load or unload adapters")
        return caller

    # -- quotas and metering -------------------------------------------------------------------

    async def admit(self, caller: Caller, tokens: int) -> Lease:
        """Charge one request and `tokens` to the caller's buckets, or RateLimitError."""
        tenant = caller.tenant
        if tenant is None or not tenant.limited:
            return Lease(caller, 0, {})
        answer = await self.ledger.admit.remote(tenant.name, tokens)
        headers = _limit_headers(answer)
        if answer.refused is None:
            return Lease(caller, tokens, headers)
        self.metrics.refused(tenant.name, answer.refused)
        raise _rate_limited(tenant, answer, headers)

    def finish(self, lease: Lease, adapter: str, usage: Any) -> Awaitable[Any] | None:
        """A request of `lease` ended with `usage` (a UsageInfo): refund what it was
        charged beyond it, add it to the totals and metrics. The ledger's answer, to await
        or not (None: nothing to tell)."""
        tenant = lease.caller.tenant
        if tenant is None:
            return None
        counts = {
            "requests": 1,
            "prompt_tokens": usage.prompt_tokens,
            "cached_tokens": usage.prompt_tokens_details.cached_tokens,
            "completion_tokens": usage.completion_tokens,
        }
        self.metrics.record(tenant.name, adapter, counts)
        refund = lease.charged - usage.prompt_tokens - usage.completion_tokens
        return self.ledger.finish.remote(tenant.name, max(0, refund), adapter, counts)

    async def usage(self, caller: Caller) -> dict[str, Any]:
        """The totals since start the caller may read: the admin every tenant's, a tenant
        its own."""
        if not self.enabled:
            raise NotFoundError("usage is metered per tenant, and no tenants are configured")
        return await self.ledger.usage.remote(caller.name)


def ledger_args(options: IngressOptions) -> tuple[dict[str, tuple[int | None, int | None]], float]:
    """TenantLedger's arguments for `options`' tenants (cluster/app.py deploys one)."""
    limits = {t.name: (t.requests_per_minute, t.tokens_per_minute) for t in options.tenants}
    return limits, options.rate_limit_window_s


def _digests(tenant: TenantConfig, environ: Mapping[str, str]) -> list[str]:
    digests = list(tenant.key_sha256)
    if tenant.key_env is not None:
        key = environ.get(tenant.key_env)
        if not key:
            raise ValueError(
                f"tenant {tenant.name!r}: key_env {tenant.key_env} is not set in the "
                "Ingress's environment (export it where Ray starts, or set it in the Serve "
                "config's runtime_env)"
            )
        digests.append(key_digest(key))
    return digests


def _bearer(authorization: str | None) -> bytes:
    scheme, _, token = (authorization or "").partition(" ")
    return token.encode() if scheme.lower() == "bearer" else b""


def _unauthorized() -> UnauthorizedError:
    return UnauthorizedError("a valid API key is required (Authorization: Bearer KEY)")


def _duration(seconds: float) -> str:
    """OpenAI's reset format: '20ms', '1.5s', '6m0s'."""
    if seconds < 1:
        return f"{math.ceil(seconds * 1000)}ms"
    minutes, rest = divmod(seconds, 60)
    text = f"{rest:.3f}".rstrip("0").rstrip(".") + "s"
    return f"{int(minutes)}m{text}" if minutes else text


def _limit_headers(answer: Admission) -> dict[str, str]:
    headers = {}
    for kind, limit in (("requests", answer.requests), ("tokens", answer.tokens)):
        if limit is not None:
            headers[f"x-ratelimit-limit-{kind}"] = str(limit.limit)
            headers[f"x-ratelimit-remaining-{kind}"] = str(limit.remaining)
            headers[f"x-ratelimit-reset-{kind}"] = _duration(limit.reset_s)
    return headers


def _rate_limited(
    tenant: TenantConfig, answer: Admission, headers: dict[str, str]
) -> RateLimitError:
    kind = answer.refused or "requests"
    limit: Limit = getattr(answer, kind)
    what = f"{kind} per minute"
    if math.isinf(answer.retry_after_s):  # waiting would not help: say so, the SDK stops
        error = RateLimitError(
            f"Request too large for tenant {tenant.name!r} on {what}: limit {limit.limit}, "
            f"requested {answer.requested} (prompt + max_tokens for every choice). Lower "
            "max_tokens or the prompt."
        )
        error.headers = {**headers, "x-should-retry": "false"}
    else:
        wait = answer.retry_after_s
        error = RateLimitError(
            f"Rate limit reached for tenant {tenant.name!r} on {what}: limit {limit.limit}, "
            f"remaining {limit.remaining}, requested {answer.requested}. Please try again "
            f"in {_duration(wait)}."
        )
        error.headers = {
            **headers,
            "retry-after": str(max(1, math.ceil(wait))),
            "retry-after-ms": str(max(1, math.ceil(wait * 1000))),
        }
    error.type = kind
    return error


class LocalHandle:
    """A TenantLedger of this process behind a handle's interface (`.method.remote()`):
    each call runs as a task, awaited or not, as a handle's call does."""

    def __init__(self, ledger: TenantLedger) -> None:
        self.ledger = ledger

    def __getattr__(self, name: str) -> _LocalMethod:
        return _LocalMethod(getattr(self.ledger, name))


@dataclass(frozen=True)
class _LocalMethod:
    method: Callable[..., Coroutine[Any, Any, Any]]

    def remote(self, *args: Any) -> asyncio.Future[Any]:
        return asyncio.ensure_future(self.method(*args))
