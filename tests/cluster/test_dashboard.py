"""The Grafana dashboard (configs/grafana/lorafleet.json): a well-formed dashboard whose
queries name exactly the metrics docs/operations/metrics.md documents. That the app exports
them, with the labels the queries group and filter by, is checked on a live app's /metrics
by `unexported`: tests/cluster/test_serve_app.py (every metric but the tenants') and
tests/reliability/test_redeployed.py (the tenants', on the app with a tenant)."""

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


def _base_name(sample_name: str) -> str:
    for suffix in HISTOGRAM_SUFFIXES:
        if sample_name.endswith(suffix):
            return sample_name.removesuffix(suffix)
    return sample_name


def test_every_panel_has_queries_on_the_chosen_data_source():
    d = dashboard()
    assert d["uid"] == "lorafleet" and d["title"] == "lorafleet"
    [source] = [v for v in d["templating"]["list"] if v["type"] == "datasource"]
    assert source["query"] == "prometheus"
    panels = [p for p in d["panels"] if p["type"] != "row"]
    assert len({p["id"] for p in d["panels"]}) == len(d["panels"])
    for p in panels:
        assert p["title"] and p["targets"], p
        assert p["datasource"]["uid"] == "${datasource}", p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert len(set(refs)) == len(refs), p["title"]
        assert all(t["expr"] and t["datasource"]["uid"] == "${datasource}" for t in p["targets"])


def test_queries_are_balanced_and_rate_over_the_grafana_interval():
    for query in queries():
        for opening, closing in ("()", "{}", "[]"):
            assert query.count(opening) == query.count(closing), query
        for window in re.findall(r"\[([^\]]*)\]", query):
            assert window == "$__rate_interval", query


def test_the_dashboard_shows_every_documented_metric_and_no_other():
    named = {_base_name(n) for q in queries() for n in METRIC.findall(q)}
    assert named == documented(), (named - documented(), documented() - named)


def test_the_panels_the_operators_asked_for():
    text = "\n".join(queries())
    for histogram in ("time_to_first_token_seconds", "inter_token_latency_seconds"):
        for q in ("0.5", "0.95", "0.99"):
            wanted = f"histogram_quantile({q}, sum by (le, kind) (rate(ray_lorafleet_{histogram}"
            assert wanted in text
    assert "sum by (replica, reason) (rate(ray_lorafleet_routing_decisions_total" in text
    assert "ray_lorafleet_replica_prefix_cache_hit_tokens_total" in text
    assert "sum by (replica, state) (ray_lorafleet_replica_adapter_slots" in text


def test_labels_used_reads_groupings_matchers_and_variables():
    query = (
        'sum by (replica, tier) (rate(x{replica=~"$replica", tier!="miss"}[$__rate_interval]))'
        " / ignoring (tier) group_left sum by (replica) (rate(x[$__rate_interval]))"
    )
    assert labels_used(query) == {"replica", "tier"}
    assert labels_used("label_values(ray_lorafleet_replica_steps_total, replica)") == {"replica"}


def test_unexported_names_what_a_scrape_lacks():
    class Sample:
        def __init__(self, **labels: str) -> None:
            self.labels = labels

    every = {
        name: [Sample(replica="r", reason="home", kind="base", le="1", tier="device", state="free",
                      outcome="stop", tenant="t", limit="requests", model="m")]
        for q in queries() for name in METRIC.findall(q)
    }  # fmt: skip
    assert unexported(every, lambda n: True) == []
    del every["ray_lorafleet_output_tokens_total"]
    assert any("ray_lorafleet_output_tokens_total" in m for m in unexported(every, lambda n: True))
    assert unexported(every, lambda n: "tenant" in n) == []
    every["ray_lorafleet_routing_decisions_total"] = [Sample(reason="home")]  # no replica label
    assert any("label replica" in m for m in unexported(every, lambda n: "routing" in n))
