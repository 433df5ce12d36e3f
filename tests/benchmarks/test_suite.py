"""`python -m benchmarks suite`: its plan, its outputs, one reduced run end to end (real Ray)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import yaml
from ray.serve.schema import ServeDeploySchema

from benchmarks import harness
from benchmarks import suite as bench_suite
from benchmarks.harness import STOP_POLL_S, RunResult
from benchmarks.suite import (
    ALL_SCENARIOS,
    CDF_SCENARIOS,
    QUICK,
    RESULTS_BEGIN,
    RESULTS_END,
    VARIANTS,
    Run,
    markdown,
    plan,
    update_readme,
)
from cluster.app import build_app
from cluster.config import AppConfig


def test_plan_covers_every_variant_scenario_and_rate():
    runs = plan(QUICK)
    by_variant = {v.name: {(r.scenario, r.rate) for r in runs if r.variant == v} for v in VARIANTS}
    assert {s for s, rate in by_variant["lorafleet"] if rate is None} == set(ALL_SCENARIOS)
    for name in ("default-routing", "no-prefetch", "unpinned-base"):
        assert {s for s, rate in by_variant[name] if rate is None} == set(CDF_SCENARIOS)
    for name in ("lorafleet", "default-routing"):
        assert {rate for _, rate in by_variant[name] if rate is not None} == set(QUICK.rates)
    # runs are grouped by variant: one deployment each
    order = [r.variant.name for r in runs]
    assert order == sorted(order, key=[v.name for v in VARIANTS].index)


def _summary(loads: int, hit: float | None) -> dict:
    figures = dict(ok=4, requests=4, output_tok_per_s=12.5, ttft_p50_s=0.1, ttft_p95_s=0.2,
                   itl_p50_s=0.01, e2e_p95_s=0.5)  # fmt: skip
    server = None if hit is None else {"device_hit_rate": hit, "load_wait_s": 0.25}
    return {"all": figures, "adapter_loads": {"total": loads}, "server": server}


def test_markdown_has_a_row_per_run_and_the_plots():
    meta = {"date": "2026-11-28", "machine": harness.machine(), "sizes": QUICK.to_json(),
            "command": "python -m benchmarks suite --quick"}  # fmt: skip
    results = [
        RunResult(Run(VARIANTS[0], "zipf"), _summary(3, 0.75)),
        RunResult(Run(VARIANTS[1], "zipf", rate=2.0), _summary(9, None)),
    ]
    text = markdown(results, meta, image_dir="benchmarks/results")
    rows = [line for line in text.splitlines() if line.startswith("| lorafleet") or
            line.startswith("| default-routing")]  # fmt: skip
    assert rows == [
        "| lorafleet | zipf | 4 conc. | 4/4 | 12.5 | 100 / 200 | 10 | 500 | 3 | 75% | 0.250 |",
        "| default-routing | zipf | 2 req/s | 4/4 | 12.5 | 100 / 200 | 10 | 500 | 9 | - | - |",
    ]
    assert "![TTFT CDF per variant](benchmarks/results/ttft_cdf.png)" in text
    assert meta["date"] in text and "`python -m benchmarks suite --quick`" in text


def test_readme_block_is_replaced_and_nothing_else(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(f"# top\n\n{RESULTS_BEGIN}\nold table\n{RESULTS_END}\n\n## after\n")
    update_readme(readme, "new table\n")
    assert (
        readme.read_text() == f"# top\n\n{RESULTS_BEGIN}\nnew table\n\n{RESULTS_END}\n\n## after\n"
    )
    (tmp_path / "plain.md").write_text("# no markers\n")
    with pytest.raises(SystemExit, match="RESULTS"):
        update_readme(tmp_path / "plain.md", "x")


def test_every_variant_config_builds_with_its_settings():
    """Each variant's app as the suite deploys it: a valid Serve config, its settings in
    the validated app config, the application built (the end-to-end run deploys two)."""
    for v in VARIANTS:
        config = bench_suite.serve_config(v, QUICK, 8123)
        ServeDeploySchema.model_validate(config)
        deployments = config["applications"][0]["deployments"]
        assert {d["name"] for d in deployments} == {"LoRAReplica", "AdapterStore", "Ingress"}
        assert all(d["graceful_shutdown_wait_loop_s"] == STOP_POLL_S for d in deployments)
        args = config["applications"][0]["args"]
        app_config = AppConfig.model_validate(args)
        assert app_config.store.demo_adapters == QUICK.adapters
        assert app_config.engine.adapters.num_slots == QUICK.slots
        for setting in v.settings:
            key, _, value = setting.partition("=")
            node = app_config
            for part in key.split("."):
                node = getattr(node, part)
            assert node == yaml.safe_load(value), (v.name, setting)
        build_app(args)


# The end-to-end run made smaller: one of the four deployments (~25 s each on 2 cores),
# every scenario once, one rate, fewer requests; each run still real load on a real
# cluster. The quick plan is checked by test_plan_covers_every_variant_scenario_and_rate,
# every variant's app by test_every_variant_config_builds_with_its_settings. The whole
# quick plan took ~180 s here, two deployments ~80 s, this one ~50 s.
E2E = replace(QUICK, requests=4, warmup=2, rates=(16.0,))
LORAFLEET = VARIANTS[0]
E2E_RUNS = [*(Run(LORAFLEET, s) for s in ALL_SCENARIOS), Run(LORAFLEET, "zipf", 16.0)]


@pytest.mark.serve
def test_quick_suite_runs_end_to_end(tmp_path):
    port = harness.free_port()
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{RESULTS_BEGIN}\n{RESULTS_END}\n")
    out = tmp_path / "results"
    args = harness.parser(bench_suite).parse_args(
        ["--quick", "--out", str(out), "--page", str(readme), "--port", str(port)]
    )
    assert bench_suite.run(args, sizes=E2E, runs=E2E_RUNS) == 0

    report = json.loads((out / "results.json").read_text())
    ran = [(r["variant"], r["scenario"], r["rate"]) for r in report["runs"]]
    assert ran == [(r.variant.name, r.scenario, r.rate) for r in E2E_RUNS]
    for run in report["runs"]:
        figures = run["summary"]["all"]
        assert figures["ok"] == figures["requests"] == E2E.requests, run["summary"]["errors"]
        assert len(run["ttfts_s"]) == E2E.requests
        assert run["summary"]["adapter_loads"]["total"] is not None
    for name in ("ttft_cdf.png", "throughput_vs_rate.png"):
        data = (out / name).read_bytes()
        assert data.startswith(b"\x89PNG") and len(data) > 10_000
    text = readme.read_text()
    assert text.count("| lorafleet |") == len(ALL_SCENARIOS) + len(E2E.rates)
    assert "(results/ttft_cdf.png)" in text
