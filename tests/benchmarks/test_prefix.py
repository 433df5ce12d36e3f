"""`python -m benchmarks prefix`: its setups, its arithmetic against the targets, its report, and
one --quick run end to end (a real Ray and the demo app, deployed three times)."""

from __future__ import annotations

import json

import pytest

from benchmarks import harness
from benchmarks import prefix as bench_prefix
from benchmarks import suite as bench_suite
from benchmarks.harness import RunResult
from benchmarks.prefix import (
    FULL,
    QUICK,
    SCENARIOS,
    SETUPS,
    Run,
    compare,
    hit_rate,
    load_options,
    report,
    serve_config,
)

SETUP = {s.name: s for s in SETUPS}


def _summary(ttft: float | None, tok_s: float, client: float | None, server: float | None):
    figures = dict(requests=8, ok=8, ttft_p50_s=ttft, ttft_p95_s=ttft and 2 * ttft,
                   output_tok_per_s=tok_s, prefix_hit_rate=client)  # fmt: skip
    return {"all": figures, "server": {"prefix_hit_rate": server}, "errors": []}


def _results(on: dict, off: dict, two: dict, scenario: str = "shared-prefix") -> list[RunResult]:
    return [
        RunResult(Run(SETUP["cache-on"], scenario), on),
        RunResult(Run(SETUP["cache-off"], scenario), off),
        RunResult(Run(SETUP["cache-on-2r"], scenario), two),
    ]


def test_setups_are_cache_on_off_and_two_replicas():
    assert [(s.replicas, s.cache) for s in SETUPS] == [(1, True), (1, False), (2, True)]
    for setup in SETUPS:
        config = serve_config(setup, FULL, port=8123)
        app = config["applications"][0]
        engine = app["args"]["engine"]
        assert engine["enable_prefix_caching"] is setup.cache
        assert engine["model"] == "demo" and app["args"]["store"]["adapters"] == "demo"
        assert engine["adapters"]["num_slots"] == FULL.adapters + 1  # every adapter resident
        replica = next(d for d in app["deployments"] if d["name"] == "LoRAReplica")
        assert replica["num_replicas"] == setup.replicas and "autoscaling_config" not in replica
        assert config["http_options"] == {"host": "127.0.0.1", "port": 8123}


def test_load_options_per_scenario():
    shared = load_options(FULL, "shared-prefix", "http://x", "l")
    turns = load_options(FULL, "multi-turn", "http://x", "l")
    assert (shared.prefix_tokens, shared.prompt_tokens) == (1000, 32)
    assert (turns.turns, turns.prompt_tokens, turns.concurrency) == (4, 64, 16)
    assert shared.num_requests == turns.num_requests == 96
    assert shared.warmup_requests == 32
    assert load_options(FULL, "shared-prefix", "http://x", "l", 2).warmup_requests == 64
    # the demo model's 2048 positions hold the longest prompt and its answer
    s = FULL
    assert s.prefix_tokens + s.prompt_tokens + s.max_tokens + 16 < 2048
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
    assert _met(c) == {"ttft_p50_ratio": True, "output_tok_s_ratio": True,
                       "replica_hit_rate_ratio": True}  # fmt: skip
    assert "multi-turn" not in compare(results)  # no runs of it: no comparison

    worse = compare(
        _results(
            on=_summary(0.36, 140.0, 0.5, None),
            off=_summary(1.0, 100.0, 0.0, None),
            two=_summary(0.3, 150.0, 0.44, None),
        )
    )["shared-prefix"]
    assert _met(worse) == {"ttft_p50_ratio": False, "output_tok_s_ratio": False,
                           "replica_hit_rate_ratio": False}  # fmt: skip
    edge = compare(
        _results(
            on=_summary(0.35, 150.0, 0.5, None),
            off=_summary(1.0, 100.0, None, None),
            two=_summary(0.3, 150.0, 0.55, None),
        )
    )["shared-prefix"]
    assert all(_met(edge).values())  # the bounds themselves meet the targets


def _met(comparison: dict) -> dict:
    return {name: checked["met"] for name, checked in comparison["targets"].items()}


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
    assert _met(unknown) == {"ttft_p50_ratio": None, "output_tok_s_ratio": True,
                             "replica_hit_rate_ratio": None}  # fmt: skip


def test_report_has_a_row_per_run_and_a_line_per_scenario():
    results = _results(
        _summary(0.3, 300.0, 0.9, 0.91), _summary(1.0, 150.0, 0.0, None),
        _summary(0.25, 320.0, None, None),
    ) + _results(
        _summary(0.5, 200.0, 0.5, 0.5), _summary(0.6, 190.0, 0.0, None),
        _summary(0.4, 210.0, 0.52, 0.5), scenario="multi-turn",
    )  # fmt: skip
    meta = {"date": "2026-11-28", "machine": harness.machine(), "sizes": QUICK.to_json(),
            "command": "python -m benchmarks prefix --quick"}  # fmt: skip
    text = report(results, compare(results), meta)
    rows = [line for line in text.splitlines() if line.startswith("| shared-prefix")]
    assert rows == [
        "| shared-prefix | cache-on | 8/8 | 300 / 600 | 300.0 | 90.0% / 91.0% |",
        "| shared-prefix | cache-off | 8/8 | 1000 / 2000 | 150.0 | 0.0% / - |",
        "| shared-prefix | cache-on-2r | 8/8 | 250 / 500 | 320.0 | - / - |",
    ]
    lines = [line for line in text.splitlines() if line.startswith("- ")]
    assert lines[0].startswith("- shared-prefix: TTFT p50 on/off 0.30 (target <= 0.35: met)")
    assert "hit rate 2 replicas / 1 - (target 1 within 10%: unknown)" in lines[0]
    assert lines[1].startswith("- multi-turn: TTFT p50 on/off 0.83 (target <= 0.35: NOT met)")
    assert "hit rate unknown where '-'" in lines[2]
    assert "benchmarks prefix --quick" in text and meta["date"] in text


def test_the_command_line():
    parse = harness.parser(bench_prefix).parse_args
    args = parse(["--quick", "--json", "x.json"])
    assert args.quick and str(args.json) == "x.json"
    assert args.scenarios == SCENARIOS and args.setups == tuple(s.name for s in SETUPS)
    assert parse(["--scenarios", "multi-turn"]).scenarios == ("multi-turn",)
    with pytest.raises(SystemExit):
        parse(["--scenarios", "zipf"])


def test_shared_cdf_plot_draws_the_suites_and_ours(tmp_path):
    """harness.plot_ttft_cdfs, which the suite draws its CDFs with too."""
    pytest.importorskip("matplotlib")
    suite_results = [
        RunResult(bench_suite.Run(v, s), {}, [0.1, 0.2, 0.3])
        for v in bench_suite.VARIANTS[:2]
        for s in bench_suite.CDF_SCENARIOS
    ]
    bench_suite._plot_ttft_cdf(suite_results, tmp_path / "suite.png")
    panels = {s: {"cache-on": [0.1, 0.2], "cache-off": [0.5, 0.9]} for s in SCENARIOS}
    harness.plot_ttft_cdfs(panels, tmp_path / "prefix.png")
    for name in ("suite.png", "prefix.png"):
        assert (tmp_path / name).read_bytes().startswith(b"\x89PNG")


@pytest.mark.slow
@pytest.mark.serve
def test_quick_prefix_bench_runs_end_to_end(tmp_path, capsys):
    """One setup (each deployment takes 20-30 s to start here; all three, ~2 minutes),
    against today's server too: cached tokens it does not report read as unknown."""
    out, plot = tmp_path / "prefix.json", tmp_path / "prefix.png"
    argv = ["--quick", "--setups", "cache-on", "--port", str(harness.free_port()),
            "--json", str(out), "--plot", str(plot)]  # fmt: skip
    assert harness.main(bench_prefix, argv) == 0
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
    assert data["command"].startswith("python -m benchmarks prefix --quick --setups cache-on")
    assert plot.read_bytes().startswith(b"\x89PNG")
    assert printed.count("| shared-prefix |") == printed.count("| multi-turn |") == 1
    assert f"wrote {out}" in printed
