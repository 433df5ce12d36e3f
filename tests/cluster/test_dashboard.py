"""The Grafana dashboard (configs/grafana/lorafleet.json): a well-formed dashboard whose
queries name exactly the metrics docs/operations/metrics.md documents. That the app exports
them, with the labels the queries group and filter by, is checked on a live app's /metrics
by `unexported`: tests/cluster/test_serve_app.py (every metric but the tenants') and
tests/reliability/test_redeployed.py (the tenants', on the app with a tenant)."""

from __future__ import annotations

import re

from tests.cluster.dashboard import (
    METRIC,
    base_name,
    dashboard,
    documented,
    labels_used,
    queries,
    unexported,
)


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
    named = {base_name(n) for q in queries() for n in METRIC.findall(q)}
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
