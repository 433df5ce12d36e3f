"""`lorafleet bench prefix`: its setups, its arithmetic against the targets, its report, and
one --quick run end to end (a real Ray and the demo app, deployed three times)."""

from __future__ import annotations

import argparse
import json
import socket

import pytest

from cluster.bench import prefix as bench_prefix
from cluster.bench import suite as bench_suite
from cluster.bench.prefix import (
    QUICK,
    SCENARIOS,
    SETUPS,
    RunResult,
    Sizes,
    compare,
    hit_rate,
    load_options,
    report,
    serve_config,
)
from cluster.cli import build_parser

SETUP = {s.name: s for s in SETUPS}


def _summary(ttft: float | None, tok_s: float, client: float | None, server: float | None):
    figures = dict(requests=8, ok=8, ttft_p50_s=ttft, ttft_p95_s=ttft and 2 * ttft,
                   output_tok_per_s=tok_s, prefix_hit_rate=client)  # fmt: skip
    return {"all": figures, "server": {"prefix_hit_rate": server}, "errors": []}


def _results(on: dict, off: dict, two: dict, scenario: str = "shared-prefix") -> list[RunResult]:
    return [
        RunResult(SETUP["cache-on"], scenario, on),
        RunResult(SETUP["cache-off"], scenario, off),
        RunResult(SETUP["cache-on-2r"], scenario, two),
    ]


def test_setups_are_cache_on_off_and_two_replicas():
    assert [(s.replicas, s.cache) for s in SETUPS] == [(1, True), (1, False), (2, True)]
    for setup in SETUPS:
        config = serve_config(setup, Sizes(), port=8123)
        app = config["applications"][0]
        engine = app["args"]["engine"]
        assert engine["enable_prefix_caching"] is setup.cache
        assert engine["model"] == "demo" and app["args"]["adapters"] == "demo"
        assert engine["num_slots"] == Sizes().adapters + 1  # every adapter resident
        replica = next(d for d in app["deployments"] if d["name"] == "LoRAReplica")
        assert replica["num_replicas"] == setup.replicas and "autoscaling_config" not in replica
        assert config["http_options"] == {"host": "127.0.0.1", "port": 8123}


def test_load_options_per_scenario():
    shared = load_options(Sizes(), "shared-prefix", "http://x", "l")
    turns = load_options(Sizes(), "multi-turn", "http://x", "l")
    assert (shared.prefix_tokens, shared.prompt_tokens) == (1000, 32)
    assert (turns.turns, turns.prompt_tokens, turns.concurrency) == (4, 64, 16)
    assert shared.num_requests == turns.num_requests == 96
    assert shared.warmup_requests == 32
    assert load_options(Sizes(), "shared-prefix", "http://x", "l", 2).warmup_requests == 64
    # the demo model's 2048 positions hold the longest prompt and its answer
    s = Sizes()
    assert s.prefix_tokens + s.suffix_tokens + s.max_tokens + 16 < 2048
    assert s.turns * (s.turn_tokens + 8 + s.max_tokens) < 2048
    assert QUICK.requests < 16 and QUICK.prefix_tokens <= 64


def test_compare_ratios_against_the_targets():
    results = _results(
        on=_summary(0.3, 300.0, 0.9, 0.91),
        off=_summary(1.0, 150.0, 0.0, None),
        two=_summary(0.25, 320.0, 0.85, 0.86),
    )
    c = compare(results)["shared-prefix"]
    assert c["ttft_p50_ratio"] == pytest.approx(0.3)
    assert c["output_tok_s_ratio"] == pytest.approx(2.0)
    assert c["hit_rate"] == {"cache-on": 0.9, "cache-off": 0.0, "cache-on-2r": 0.85}
    assert c["replica_hit_rate_ratio"] == pytest.approx(0.85 / 0.9)
    assert c["met"] == {"ttft_p50_ratio": True, "output_tok_s_ratio": True,
                        "replica_hit_rate_ratio": True}  # fmt: skip
    assert "multi-turn" not in compare(results)  # no runs of it: no comparison

    worse = compare(
        _results(
            on=_summary(0.36, 140.0, 0.5, None),
            off=_summary(1.0, 100.0, 0.0, None),
            two=_summary(0.3, 150.0, 0.44, None),
        )
    )["shared-prefix"]
    assert worse["met"] == {"ttft_p50_ratio": False, "output_tok_s_ratio": False,
                            "replica_hit_rate_ratio": False}  # fmt: skip
    edge = compare(
        _results(
            on=_summary(0.35, 150.0, 0.5, None),
            off=_summary(1.0, 100.0, None, None),
            two=_summary(0.3, 150.0, 0.55, None),
        )
    )["shared-prefix"]
    assert all(edge["met"].values())  # the bounds themselves meet the targets


def test_hit_rate_falls_back_to_the_server_then_unknown():
    assert hit_rate(_summary(0.1, 1.0, 0.7, 0.6)) == 0.7
    assert hit_rate(_summary(0.1, 1.0, None, 0.6)) == 0.6
    assert hit_rate(_summary(0.1, 1.0, None, None)) is None
    unknown = compare(
        _results(
            on=_summary(0.3, 300.0, None, None),
            off=_summary(None, 150.0, None, None),  # no TTFT: every request failed
            two=_summary(0.2, 300.0, None, None),
        )
    )["shared-prefix"]
    assert unknown["ttft_p50_ratio"] is None and unknown["replica_hit_rate_ratio"] is None
    assert unknown["met"] == {"ttft_p50_ratio": None, "output_tok_s_ratio": True,
                              "replica_hit_rate_ratio": None}  # fmt: skip


def test_report_has_a_row_per_run_and_a_line_per_scenario():
    results = _results(
        _summary(0.3, 300.0, 0.9, 0.91), _summary(1.0, 150.0, 0.0, None),
        _summary(0.25, 320.0, None, None),
    ) + _results(
        _summary(0.5, 200.0, 0.5, 0.5), _summary(0.6, 190.0, 0.0, None),
        _summary(0.4, 210.0, 0.52, 0.5), scenario="multi-turn",
    )  # fmt: skip
    meta = bench_prefix._meta(QUICK, quick=True)
    text = report(results, compare(results), meta)
    rows = [line for line in text.splitlines() if line.startswith("| shared-prefix")]
    assert rows == [
        "| shared-prefix | cache-on | 8/8 | 300 / 600 | 300.0 | 90.0% / 91.0% |",
        "| shared-prefix | cache-off | 8/8 | 1000 / 2000 | 150.0 | 0.0% / - |",
        "| shared-prefix | cache-on-2r | 8/8 | 250 / 500 | 320.0 | - / - |",
    ]
    lines = [line for line in text.splitlines() if line.startswith("- ")]
    assert lines[0].startswith("- shared-prefix: TTFT p50 on/off 0.30 (target <= 0.35: met)")
    assert "hit rate 2 replicas / 1 - (within 10%: unknown)" in lines[0]
    assert lines[1].startswith("- multi-turn: TTFT p50 on/off 0.83 (target <= 0.35: NOT met)")
    assert "hit rate unknown where '-'" in lines[2]
    assert "bench prefix --quick" in text and meta["date"] in text


def test_the_command_is_registered():
    args = build_parser().parse_args(["bench", "prefix", "--quick", "--json", "x.json"])
    assert args.func is bench_prefix.run and args.quick and str(args.json) == "x.json"
    assert args.scenarios == SCENARIOS
    one = build_parser().parse_args(["bench", "prefix", "--scenarios", "multi-turn"])
    assert one.scenarios == ("multi-turn",)
    assert (
        "--scenarios multi-turn"
        in bench_prefix._meta(QUICK, False, scenarios=one.scenarios)["command"]
    )
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "prefix", "--scenarios", "zipf"])


def test_shared_cdf_plot_draws_the_suites_and_ours(tmp_path):
    """plot_ttft_cdfs, which `bench suite` now draws its CDFs with too."""
    pytest.importorskip("matplotlib")
    suite_results = [
        bench_suite.RunResult(bench_suite.Run(v, s), {}, [0.1, 0.2, 0.3])
        for v in bench_suite.VARIANTS[:2]
        for s in bench_suite.CDF_SCENARIOS
    ]
    bench_suite._plot_ttft_cdf(suite_results, tmp_path / "suite.png")
    panels = {s: {"cache-on": [0.1, 0.2], "cache-off": [0.5, 0.9]} for s in SCENARIOS}
    bench_suite.plot_ttft_cdfs(panels, tmp_path / "prefix.png")
    for name in ("suite.png", "prefix.png"):
        assert (tmp_path / name).read_bytes().startswith(b"\x89PNG")


@pytest.mark.slow
@pytest.mark.serve
def test_quick_prefix_bench_runs_end_to_end(tmp_path, capsys):
    """One setup (each deployment takes 20-30 s to start here; all three, ~2 minutes),
    against today's server too: cached tokens it does not report read as unknown."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    parser = argparse.ArgumentParser()
    bench_prefix.add_arguments(parser)
    out, plot = tmp_path / "prefix.json", tmp_path / "prefix.png"
    args = parser.parse_args(["--quick", "--setups", "cache-on", "--port", str(port),
                              "--json", str(out), "--plot", str(plot)])  # fmt: skip
    assert bench_prefix.run(args) == 0
    printed = capsys.readouterr().out
    data = json.loads(out.read_text())
    assert [(r["setup"], r["scenario"]) for r in data["runs"]] == [
        ("cache-on", scenario) for scenario in SCENARIOS
    ]
    for run in data["runs"]:
        figures = run["summary"]["all"]
        assert figures["ok"] == figures["requests"] == QUICK.requests, run["summary"]["errors"]
        assert len(run["ttfts_s"]) == QUICK.requests
        assert figures["prompt_tokens"] > 0  # the usage of every request was read
        if figures["prefix_hit_rate"] is not None:  # once the server reports cached tokens
            assert figures["prefix_hit_rate"] > 0
    assert data["comparisons"] == {}  # they need all three setups
    assert data["command"] == "lorafleet bench prefix --quick --setups cache-on"
    assert plot.read_bytes().startswith(b"\x89PNG")
    assert printed.count("| shared-prefix |") == printed.count("| multi-turn |") == 1
    assert f"wrote {out}" in printed
