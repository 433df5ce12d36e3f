"""The Grafana dashboard (configs/grafana/lorafleet.json) read as the tests check it: its
queries, the labels they use, the metrics docs/operations/metrics.md documents, and what a
live app's scrape lacks for them."""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "configs" / "grafana" / "lorafleet.json"
METRICS_PAGE = ROOT / "docs" / "operations" / "metrics.md"
METRIC = re.compile(r"\bray_lorafleet_[a-z0-9_]+")
HISTOGRAM_SUFFIXES = ("_bucket", "_count", "_sum")


def dashboard() -> dict[str, Any]:
    """Return the dashboard's JSON model."""
    return json.loads(DASHBOARD.read_text())


def queries() -> list[str]:
    """Every PromQL query of the dashboard: its panels' and its variables'."""
    d = dashboard()
    found = [t["expr"] for p in d["panels"] for t in p.get("targets", [])]
    return found + [v["definition"] for v in d["templating"]["list"] if v["type"] == "query"]


def labels_used(query: str) -> set[str]:
    """The labels a query groups by, matches on or filters by."""
    used = set()
    for group in re.findall(r"\b(?:by|without|on|ignoring)\s*\(([^)]*)\)", query):
        used |= {label.strip() for label in group.split(",") if label.strip()}
    for matchers in re.findall(r"\{([^}]*)\}", query):
        used |= set(re.findall(r"(\w+)\s*(?:=~|!~|!=|=)", matchers))
    used |= set(re.findall(r"label_values\(\s*\w+\s*,\s*(\w+)\s*\)", query))
    return used


def documented() -> set[str]:
    """The metric names of the docs' table, as exported (`ray_` prefix), braces expanded."""
    table = METRICS_PAGE.read_text().split("| metric | labels | what |", 1)[1].split("\n\n")[0]
    names = set()
    for spelled in re.findall(r"`(lorafleet_[a-z0-9_{},]+)`", table):
        parts = [p.split(",") for p in re.split(r"[{}]", spelled)]  # a{b,c}d -> a, [b, c], d
        names |= {"ray_" + "".join(p) for p in itertools.product(*parts)}
    return names


def unexported(samples: Mapping[str, Sequence[Any]], select: Callable[[str], bool]) -> list[str]:
    """What the queries naming only `select`ed metrics need that a scrape lacks: `samples`
    maps each sample name of the scraped page to its samples (prometheus_client's, with
    .labels). A metric not on the page, or a label none of a query's metrics carries."""
    missing = []
    for query in queries():
        names = set(METRIC.findall(query))
        if not names or not all(select(n) for n in names):
            continue
        missing += [f"{n} (in {query})" for n in sorted(names - samples.keys())]
        carried = {label for n in names & samples.keys() for s in samples[n] for label in s.labels}
        if names <= samples.keys():
            missing += [f"label {x} (in {query})" for x in sorted(labels_used(query) - carried)]
    return missing


def base_name(sample_name: str) -> str:
    """Return the metric name of a sample's name (a histogram's without its suffix)."""
    for suffix in HISTOGRAM_SUFFIXES:
        if sample_name.endswith(suffix):
            return sample_name.removesuffix(suffix)
    return sample_name
