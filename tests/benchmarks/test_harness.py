"""Where the benches write their JSON and plot, and the bench extra checked up front."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

from cluster.bench.stats import output_paths

DEFAULTS = (Path("r/x.json"), Path("r/x.png"))


def args(**kw) -> argparse.Namespace:
    return argparse.Namespace(**({"json": None, "plot": None, "quick": False} | kw))


def test_flags_then_defaults_and_nothing_for_quick(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", object())  # present, whatever is installed
    assert output_paths(args(), *DEFAULTS, "x") == DEFAULTS
    assert output_paths(args(quick=True), *DEFAULTS, "x") == (None, None)
    chosen = args(quick=True, json=Path("a.json"), plot=Path("a.png"))
    assert output_paths(chosen, *DEFAULTS, "x") == (Path("a.json"), Path("a.png"))


def test_a_plot_without_matplotlib_stops_before_any_run(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import raises ImportError
    with pytest.raises(SystemExit, match="bench many-adapters: the plot needs matplotlib"):
        output_paths(args(), *DEFAULTS, "many-adapters")
    # no plot wanted: no need for it
    assert output_paths(args(quick=True, json=Path("a.json")), *DEFAULTS, "x") == (
        Path("a.json"),
        None,
    )
