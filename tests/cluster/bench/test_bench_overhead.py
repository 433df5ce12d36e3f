"""`lorafleet bench overhead --quick`: both arms run the workload and the ratio is theirs."""

from __future__ import annotations

import asyncio
import json

import pytest

from cluster.bench import overhead
from cluster.cli import main


@pytest.mark.slow
@pytest.mark.serve
def test_quick_run_measures_both_arms(tmp_path, capsys):
    out = tmp_path / "overhead.json"
    assert main(["bench", "overhead", "--quick", "--num-cpus", "2", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["engine_tok_per_s"] > 0 and report["http_tok_per_s"] > 0
    assert report["http_over_engine"] == pytest.approx(
        report["http_tok_per_s"] / report["engine_tok_per_s"]
    )
    assert report["sizes"] == overhead.QUICK.__dict__ and report["num_cpus"] == 2
    assert "http_over_engine" in capsys.readouterr().out


def test_every_request_must_succeed():
    """A failed request is an error, not a lower tok/s (nothing listens on port 9)."""
    with pytest.raises(RuntimeError, match="requests failed"):
        asyncio.run(overhead._drive("http://127.0.0.1:9", [[5, 6]], ["a"], overhead.QUICK))
