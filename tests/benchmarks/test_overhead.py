"""`python -m benchmarks overhead --quick`: both arms run the workload, the ratio is theirs."""

from __future__ import annotations

import asyncio
import json

import pytest

from benchmarks import overhead
from benchmarks.__main__ import main


@pytest.mark.slow
@pytest.mark.serve
def test_quick_run_measures_both_arms(tmp_path, capsys):
    """--replicas 1: one replica process fewer to start than the default 2 (the HTTP arm's
    deployment is most of this test's time), and the flag is checked too."""
    out = tmp_path / "overhead.json"
    argv = ["overhead", "--quick", "--num-cpus", "2", "--replicas", "1"]
    assert main([*argv, "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["engine_tok_per_s"] > 0 and report["http_tok_per_s"] > 0
    assert report["http_over_engine"] == pytest.approx(
        report["http_tok_per_s"] / report["engine_tok_per_s"]
    )
    assert report["sizes"] == {**overhead.QUICK.to_json(), "replicas": 1}
    assert report["num_cpus"] == 2
    assert report["targets"]["http_over_engine"]["met"] in (True, False)
    assert "http_over_engine" in capsys.readouterr().out


def test_every_request_must_succeed():
    """A failed request is an error, not a lower tok/s (nothing listens on port 9)."""
    with pytest.raises(RuntimeError, match="requests failed"):
        asyncio.run(overhead._drive("http://127.0.0.1:9", [[5, 6]], ["a"], overhead.QUICK))
