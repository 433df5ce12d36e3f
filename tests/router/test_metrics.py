"""`GET /metrics`' pure part: keeping and merging the lorafleet families of Ray's pages."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client.parser import text_string_to_metric_families

from router.errors import ServiceUnavailableError
from router.metrics import filter_metrics, scrape
from tests.net import free_port


def _page(node: str, requests: float) -> str:
    """A trimmed page as Ray 2.60's metrics agent exports it (labels shortened)."""
    labels = f'Component="core_worker",NodeAddress="{node}"'
    return f"""# HELP python_gc_objects_collected_total Objects collected during gc
# TYPE python_gc_objects_collected_total counter
python_gc_objects_collected_total{{generation="0"}} 2285.0
# HELP ray_lorafleet_time_to_first_token_seconds From arrival to first token.
# TYPE ray_lorafleet_time_to_first_token_seconds histogram
ray_lorafleet_time_to_first_token_seconds_bucket{{{labels},kind="base",le="0.1"}} 1.0
ray_lorafleet_time_to_first_token_seconds_bucket{{{labels},kind="base",le="+Inf"}} 1.0
ray_lorafleet_time_to_first_token_seconds_count{{{labels},kind="base"}} 1.0
ray_lorafleet_time_to_first_token_seconds_sum{{{labels},kind="base"}} 0.055
# HELP ray_node_cpu_utilization Total CPU usage
# TYPE ray_node_cpu_utilization gauge
ray_node_cpu_utilization{{{labels}}} 12.5

# HELP ray_lorafleet_requests_total Generation requests.
# TYPE ray_lorafleet_requests_total counter
ray_lorafleet_requests_total{{{labels},kind="adapter",model="a",outcome="length"}} {requests}
"""


def test_keeps_only_lorafleet_families_with_their_help_and_type():
    text = filter_metrics([_page("10.0.0.1", 3.0)])
    assert "python_gc" not in text and "ray_node_cpu" not in text
    lines = text.splitlines()
    assert lines[0] == (
        "# HELP ray_lorafleet_time_to_first_token_seconds From arrival to first token."
    )
    assert lines[1] == "# TYPE ray_lorafleet_time_to_first_token_seconds histogram"
    assert len(lines) == 2 + 4 + 2 + 1 and text.endswith("\n")
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert families["ray_lorafleet_time_to_first_token_seconds"].type == "histogram"
    [sample] = families["ray_lorafleet_requests"].samples
    assert sample.value == 3.0 and sample.labels["model"] == "a"


def test_merges_nodes_into_one_valid_exposition():
    """Each family described once, its samples from both nodes together: what Prometheus's
    parser (which refuses a second TYPE line for a family) accepts."""
    text = filter_metrics([_page("10.0.0.1", 3.0), _page("10.0.0.2", 5.0)])
    assert text.count("# TYPE ray_lorafleet_requests_total counter") == 1
    assert text.count("# HELP ray_lorafleet_time_to_first_token_seconds") == 1
    families = {f.name: f for f in text_string_to_metric_families(text)}
    requests = families["ray_lorafleet_requests"].samples
    assert sorted(s.value for s in requests) == [3.0, 5.0]
    counts = [
        s for s in families["ray_lorafleet_time_to_first_token_seconds"].samples
        if s.name.endswith("_count")
    ]  # fmt: skip
    assert {s.labels["NodeAddress"] for s in counts} == {"10.0.0.1", "10.0.0.2"}


def test_nothing_to_keep_is_an_empty_page():
    assert filter_metrics(["# HELP up x\n# TYPE up gauge\nup 1\n"]) == ""
    assert filter_metrics([]) == ""


def test_unreachable_export_port_is_503():
    port = free_port()  # nothing listens on it
    with pytest.raises(ServiceUnavailableError, match="cannot be read") as e:
        asyncio.run(scrape([f"http://127.0.0.1:{port}/metrics"], timeout_s=1.0))
    assert e.value.status == 503
    with pytest.raises(ServiceUnavailableError, match="no live node"):
        asyncio.run(scrape([]))
