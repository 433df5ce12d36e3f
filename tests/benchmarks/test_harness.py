"""The harness every bench runs on: its command line, the one targets file and how a figure
is checked against it, sizes, and where a bench writes its JSON and plot."""

from __future__ import annotations

import argparse
import ast
import runpy
import sys
from pathlib import Path

import pytest

from benchmarks import harness
from benchmarks.__main__ import BENCHES, bench, main
from benchmarks.harness import Sizes, Target, check, output_paths, targets

ROOT = Path(__file__).resolve().parents[2]
DEFAULTS = (Path("r/x.json"), Path("r/x.png"))


def args(**kw) -> argparse.Namespace:
    return argparse.Namespace(**({"json": None, "plot": None, "quick": False,
                                  "command": "python -m benchmarks x"} | kw))  # fmt: skip


def test_flags_then_defaults_and_nothing_for_quick(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", object())  # present, whatever is installed
    assert output_paths(args(), *DEFAULTS) == DEFAULTS
    assert output_paths(args(quick=True), *DEFAULTS) == (None, None)
    chosen = args(quick=True, json=Path("a.json"), plot=Path("a.png"))
    assert output_paths(chosen, *DEFAULTS) == (Path("a.json"), Path("a.png"))


def test_a_plot_without_matplotlib_stops_before_any_run(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import raises ImportError
    with pytest.raises(SystemExit, match="many-adapters: the plot needs matplotlib"):
        output_paths(args(command="python -m benchmarks many-adapters"), *DEFAULTS)
    # no plot wanted: no need for it
    assert output_paths(args(quick=True, json=Path("a.json")), *DEFAULTS) == (
        Path("a.json"),
        None,
    )


def test_a_target_is_a_bound_and_a_missing_figure_is_unknown():
    assert Target("x", min=6.0).met(6.0) and not Target("x", min=6.0).met(5.9)
    assert Target("x", max=0.05).met(0.05) and not Target("x", max=0.05).met(0.06)
    near = Target("x", near=2.0, tolerance=0.1)
    assert near.met(2.2) and near.met(1.8) and not near.met(2.21)
    assert near.describe() == "2 within 10%" and Target("x", max=1.3).describe() == "<= 1.3"
    assert Target("x", min=1.0).met(None) is None
    checked = check("tenants", {"vtc_ttft_p50_vs_alone": 1.5, "vtc_tok_s_vs_fcfs": 0.9})
    assert {k: c["met"] for k, c in checked.items()} == {
        "vtc_ttft_p50_vs_alone": True,
        "vtc_tok_s_vs_fcfs": False,
        "weights_service_ratio": None,  # not measured: unknown, not a failure
    }
    assert harness.verdict(checked["vtc_tok_s_vs_fcfs"]) == "0.90 (target >= 0.95: NOT met)"


def test_the_targets_file_holds_every_target_of_every_bench():
    """One file: each table is a bench's (or the MoE figure's), each entry one bound with
    what it measures; no bench module keeps a target of its own."""
    groups = {"engine", "engine_moe", "gpu", "overhead", "prefix", "many_adapters", "tenants"}
    for group in groups:
        for name, target in targets(group).items():
            bounds = [target.min, target.max, target.near]
            assert sum(b is not None for b in bounds) >= 1 and target.what, (group, name)
    assert targets("gpu")["lora_over_base_step_b32"].max == 1.15
    assert targets("gpu")["base_step_over_hbm_limit_b32"].max == 1.3
    assert targets("gpu")["ttft_32k_lora_over_base"].max == 2.0
    for path in (ROOT / "benchmarks").glob("*.py"):
        tree = ast.parse(path.read_text())
        names = {t.id for n in ast.walk(tree) if isinstance(n, ast.Assign) for t in n.targets
                 if isinstance(t, ast.Name)}  # fmt: skip
        assert not {n for n in names if "TARGET" in n} - {"TARGETS_FILE"}, path.name
        assert not [
            n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == "Targets"
        ]


def test_sizes_are_one_class_written_whole():
    quick = Sizes(requests=8, rates=(4.0, 16.0))
    assert quick.to_json()["rates"] == [4.0, 16.0] and quick.to_json()["requests"] == 8
    assert set(quick.to_json()) == set(Sizes.__dataclass_fields__)


def test_subset_of_keeps_the_choices_order():
    parse = harness.subset_of(("a", "b", "c"))
    assert parse("c, a") == ("a", "c") and parse("b,b") == ("b",)
    for bad in ("", "a,z"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse(bad)


def test_every_bench_has_a_command_line(capsys):
    """`python -m benchmarks NAME --help` for each bench answers (argparse exits 0)."""
    for name in BENCHES:
        module = bench(name)
        assert harness.bench_name(module) == name
        with pytest.raises(SystemExit) as exit_:
            main([name, "--help"])
        assert exit_.value.code == 0, name
        assert f"python -m benchmarks {name}" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="no bench 'nope'"):
        main(["nope"])
    assert main([]) == 2 and "many-adapters" in capsys.readouterr().out


def test_a_bench_runs_as_its_own_module_too(monkeypatch, capsys):
    """`python -m benchmarks.fused --help`, in this process (runpy, as -m runs it)."""
    monkeypatch.setattr(sys, "argv", ["fused", "--help"])
    monkeypatch.delitem(sys.modules, "benchmarks.fused", raising=False)
    with pytest.raises(SystemExit) as exit_:
        runpy.run_module("benchmarks.fused", run_name="__main__", alter_sys=True)
    assert exit_.value.code == 0 and "python -m benchmarks fused" in capsys.readouterr().out


def test_the_package_imports_no_benchmark():
    """benchmarks/ is not shipped: nothing installed may import it."""
    for package in ("cluster", "router", "replica", "kernels"):
        for path in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    mods = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom):
                    mods = [node.module or ""]
                else:
                    continue
                assert not [m for m in mods if m.split(".")[0] == "benchmarks"], path
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert 'include = ["cluster*", "replica*", "kernels*", "router*"]' in pyproject
