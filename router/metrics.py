"""The ingress's Prometheus metrics and `GET /metrics`.

Metrics are recorded through Ray's metrics API; Ray's metrics agent on each node exports
every process's metrics (ours named `ray_lorafleet_*`: Ray prefixes them) at the node's
metrics export port. `GET /metrics` fetches those pages and keeps the lorafleet families,
so one scrape of the ingress shows the ingress's and every replica's metrics.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterable

import httpx
import ray
from ray.util.metrics import Counter, Histogram

from router.errors import ServiceUnavailableError

PREFIX = "ray_lorafleet_"
PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"
SCRAPE_TIMEOUT_S = 2.0
# Seconds, from a cached short prompt's first token on a GPU to a long generation on a CPU.
LATENCY_BUCKETS_S = [
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
]  # fmt: skip
# Seconds between two tokens: a GPU decode step to a CPU step stalled behind long prefills.
ITL_BUCKETS_S = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0]
FINISH_REASONS = ("stop", "length")

_SAMPLE_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")


class IngressMetrics:
    """Per generation request, recorded once when it ends. `kind` is base, adapter, or
    unknown (the model did not resolve); `outcome` a finish reason, `abort` (the client
    went away) or the HTTP status of the error."""

    def __init__(self) -> None:
        self.requests = Counter(
            "lorafleet_requests",
            "Generation requests by model and outcome (finish reason, abort or HTTP status).",
            tag_keys=("kind", "model", "outcome"),
        )
        self.output_tokens = Counter(
            "lorafleet_output_tokens",
            "Generated tokens, as the responses' usage.completion_tokens counts them.",
            tag_keys=("kind", "model"),
        )
        self.ttft = Histogram(
            "lorafleet_time_to_first_token_seconds",
            "From the request's arrival to its first generated token.",
            boundaries=LATENCY_BUCKETS_S,
            tag_keys=("kind",),
        )
        self.itl = Histogram(
            "lorafleet_inter_token_latency_seconds",
            "Between consecutive generated tokens of a request.",
            boundaries=ITL_BUCKETS_S,
            tag_keys=("kind",),
        )
        self.e2e = Histogram(
            "lorafleet_e2e_latency_seconds",
            "From the request's arrival to its last token, for requests that finished.",
            boundaries=LATENCY_BUCKETS_S,
            tag_keys=("kind",),
        )

    def record(
        self,
        kind: str,
        model: str,
        outcome: str,
        ttft_s: float | None,
        e2e_s: float,
        num_tokens: int,
        itl_s: Iterable[float] = (),
    ) -> None:
        self.requests.inc(tags={"kind": kind, "model": model, "outcome": outcome})
        if num_tokens:
            self.output_tokens.inc(num_tokens, tags={"kind": kind, "model": model})
        if ttft_s is not None:
            self.ttft.observe(ttft_s, tags={"kind": kind})
        for gap in itl_s:
            self.itl.observe(gap, tags={"kind": kind})
        if outcome in FINISH_REASONS:  # errors and aborts would skew the latency
            self.e2e.observe(e2e_s, tags={"kind": kind})


class LabelCap:
    """Bounds a label's values: those in `named` (the first `limit` of them) and, with
    `first_seen`, the first values seen up to `limit` keep their name; the rest are
    `other`, so a label never has more than limit + 1 values."""

    OTHER = "other"

    def __init__(self, named: Iterable[str], limit: int, first_seen: bool = False) -> None:
        self.limit, self.first_seen = limit, first_seen
        self.kept = set(list(named)[:limit])

    def __call__(self, value: str) -> str:
        if value in self.kept:
            return value
        if self.first_seen and len(self.kept) < self.limit:
            self.kept.add(value)
            return value
        return self.OTHER


class TenantMetrics:
    """Per tenant and adapter (the model a request named): requests, prompt, cached and
    completion tokens, and refusals by rate limit. Labels bounded by LabelCap: tenants in
    config order, adapters as first seen by this ingress replica."""

    USAGE = ("requests", "prompt_tokens", "cached_tokens", "completion_tokens")

    def __init__(self, tenants: list[str], labels: int) -> None:
        self.tenant_label = LabelCap(tenants, labels)
        self.adapter_label = LabelCap((), labels, first_seen=True)
        self.counters = {
            name: Counter(
                f"lorafleet_tenant_{name}",
                f"Generation {name.replace('_', ' ')} by tenant and model (as the responses' "
                "usage counts them).",
                tag_keys=("tenant", "model"),
            )
            for name in self.USAGE
        }
        self.rate_limited = Counter(
            "lorafleet_tenant_rate_limited",
            "Requests refused with 429 by a tenant's limit, by which (requests or tokens).",
            tag_keys=("tenant", "limit"),
        )

    def record(self, tenant: str, model: str, counts: dict[str, int]) -> None:
        tags = {"tenant": self.tenant_label(tenant), "model": self.adapter_label(model)}
        for name, counter in self.counters.items():
            if counts.get(name):
                counter.inc(counts[name], tags=tags)

    def refused(self, tenant: str, limit: str) -> None:
        self.rate_limited.inc(tags={"tenant": self.tenant_label(tenant), "limit": limit})


def filter_metrics(pages: Iterable[str], prefix: str = PREFIX) -> str:
    """The metric families of Prometheus text `pages` whose names start with `prefix`, merged
    into one exposition: each family's HELP and TYPE once, then its samples from every page
    (the format wants a family described once and its samples together)."""
    families: dict[str, dict[str, list[str]]] = {}

    def entry(name: str) -> dict[str, list[str]]:
        return families.setdefault(name, {"HELP": [], "TYPE": [], "samples": []})

    for page in pages:
        family = None
        for line in page.splitlines():
            if line.startswith(("# HELP ", "# TYPE ")):
                _, kind, family = line.split(maxsplit=3)[:3]
                if family.startswith(prefix) and not entry(family)[kind]:
                    entry(family)[kind].append(line)
                continue
            match = _SAMPLE_NAME.match(line)
            name = match.group() if match else ""
            if name.startswith(prefix):  # not other metrics, comments, blank lines
                # a histogram's _bucket/_sum/_count samples belong to the family above them
                owner = family if family and name.startswith(family) else name
                entry(owner)["samples"].append(line)
    return "".join(line + "\n" for e in families.values() for part in e.values() for line in part)


def export_urls() -> list[str]:
    """The metrics page of every live node. Blocking (asks the GCS): call it in a thread."""
    urls = []
    for node in ray.nodes():
        host, port = node["NodeManagerAddress"], node.get("MetricsExportPort")
        if node["Alive"] and port:
            host = f"[{host}]" if ":" in host else host
            urls.append(f"http://{host}:{port}/metrics")
    return urls


async def scrape(urls: list[str], timeout_s: float = SCRAPE_TIMEOUT_S) -> str:
    """The lorafleet metrics of `urls`' pages; a page that cannot be read becomes a comment
    line, none readable a 503."""
    async with httpx.AsyncClient(timeout=timeout_s, trust_env=False) as client:
        replies = await asyncio.gather(*(client.get(u) for u in urls), return_exceptions=True)
    pages, problems = [], []
    for url, reply in zip(urls, replies):
        if isinstance(reply, httpx.Response) and reply.status_code == 200:
            pages.append(reply.text)
        else:
            why = f"HTTP {reply.status_code}" if isinstance(reply, httpx.Response) else repr(reply)
            problems.append(f"{url} unreadable: {why}")
    if not pages:
        detail = "; ".join(problems) or "no live node"
        raise ServiceUnavailableError(f"Ray's metrics export cannot be read: {detail}")
    return "".join(f"# lorafleet: {p}\n" for p in problems) + filter_metrics(pages)
