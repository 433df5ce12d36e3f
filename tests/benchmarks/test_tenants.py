"""`python -m benchmarks tenants`: its windows and targets on made-up traces, and one short run of
each kind on the tiny model (B's requests measured, A and B both served)."""

from __future__ import annotations

import pytest

from benchmarks import harness
from benchmarks import tenants as bench_tenants
from benchmarks.tenants import (
    Bench,
    Request,
    Trace,
    compare,
    joined,
    report,
    summarize,
    windows,
)


def trace(service, duration_s: float = 20.0, ttfts=()) -> Trace:
    t = Trace("t", duration_s, service=list(service))
    t.requests = [Request("B", float(i), first=float(i) + x) for i, x in enumerate(ttfts)]
    t.output_tokens = 100
    return t


def test_windows_split_the_service_per_tenant():
    t = trace([(1.0, "A", 5.0), (9.9, "B", 1.0), (10.0, "A", 2.0), (19.5, "A", 1.0)])
    assert windows(t) == [{"A": 5.0, "B": 1.0}, {"A": 3.0, "B": 0.0}]
    f = summarize(t, {})
    assert f["max_window_service_diff"] == 4.0 and f["service_ratio_a_b"] == 8.0
    assert f["output_tok_per_s"] == 5.0


def test_repeated_runs_join_one_after_the_other():
    one = trace([(1.0, "A", 5.0)], duration_s=10.0, ttfts=[0.5])
    two = trace([(2.0, "B", 3.0)], duration_s=10.0, ttfts=[0.25])
    both = joined([one, two])
    assert both.duration_s == 20.0 and both.output_tokens == 200
    assert windows(both) == [{"A": 5.0, "B": 0.0}, {"A": 0.0, "B": 3.0}]
    assert [(r.arrival, r.first) for r in both.requests] == [(0.0, 0.5), (10.0, 10.25)]


def test_targets_read_the_ratios():
    def fig(p50, tok_s, ratio=None):
        return {"b_ttft_p50_s": p50, "output_tok_per_s": tok_s, "service_ratio_a_b": ratio}

    good = {"alone": fig(0.1, 10), "fcfs": fig(2.0, 100), "vtc": fig(0.15, 98),
            "weights": fig(None, 90, 2.1)}  # fmt: skip
    v = compare(good)
    met = {k: c["met"] for k, c in v["targets"].items()}
    assert met == dict.fromkeys(harness.targets("tenants"), True)
    assert v["fcfs_ttft_p50_vs_alone"] == 20.0
    bad = {**good, "vtc": fig(0.3, 90), "weights": fig(None, 90, 1.7)}
    assert {k: c["met"] for k, c in compare(bad)["targets"].items()} == dict.fromkeys(met, False)


@pytest.mark.slow
def test_a_short_run_of_each_kind_on_the_tiny_model(tiny):
    """Wall-clock runs on a shared CPU: what they serve depends on the machine's load, so
    this checks what a run records, not how much."""
    args = harness.parser(bench_tenants).parse_args(
        ["--duration", "1", "--warmup", "0.2", "--flood", "6",
         "--rate", "8", "--max-num-seqs", "4", "--prompt-len", "8", "--output-len", "4"]
    )  # fmt: skip
    bench = Bench(args, str(tiny.model_dir), tiny.adapters)
    names = list(tiny.adapters)
    flood = bench.run("vtc", "vtc", 1.0, 6, names[:2], names[2:])
    both = bench.run("weights", "vtc", 1.0, 6, names[:2], names[2:], b_flood=6,
                     weights={"A": 2.0, "B": 1.0})  # fmt: skip
    assert len(flood.requests) >= 7  # B arrives on its clock, 8/s, however slow the steps
    assert all(r.first is None or r.first >= r.arrival for r in flood.requests)
    assert {"A", "B"} <= set(flood.counters) and {"A", "B"} <= set(both.counters)
    assert {tenant for _, tenant, _ in flood.service + both.service} <= {"A", "B"}
    assert flood.output_tokens == sum(
        1 for _, tenant, amount in flood.service if amount > 0
    )  # one service entry per token drawn
    figures = {n: summarize(flood, {}) for n in ("alone", "fcfs", "vtc")}
    figures["weights"] = summarize(both, {"A": 2.0, "B": 1.0})
    assert "weights 2:1" in report(figures, compare(figures))
