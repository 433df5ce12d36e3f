"""`lorafleet generate` end to end: text in, the engine's tokens out."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from cluster.cli import main
from replica.config import EngineConfig
from replica.engine.engine import LLMEngine
from replica.wire import SamplingParams


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_generate_json_mixed_batch_matches_engine(tiny, capsys):
    loras = [f"--lora={n}={p}" for n, p in tiny.adapters.items()]
    code, out, _ = run_cli(
        capsys, "generate", "--model", str(tiny.model_dir), *loras,
        "--prompt", "hello world", "--adapter", "base",
        "--prompt", "the cat sat", "--adapter", "adapter-02",
        "--max-tokens", "8", "--json",
    )  # fmt: skip
    assert code == 0
    rows = [json.loads(line) for line in out.splitlines()]
    assert [r["adapter"] for r in rows] == [None, "adapter-02"]
    eng = LLMEngine(EngineConfig(model=str(tiny.model_dir), device="cpu", num_slots=2))
    eng.load_adapter("adapter-02", tiny.adapters["adapter-02"])
    for r in rows:
        assert set(r) >= {"prompt_token_ids", "output_token_ids", "text"}
        seq = eng.generate(
            [(r["prompt_token_ids"], SamplingParams(temperature=0, max_tokens=8), r["adapter"])]
        )[0]
        assert r["output_token_ids"] == seq.output_ids
        assert r["finish_reason"] in ("stop", "length")


@pytest.mark.slow
def test_generate_with_tp_2_prints_what_tp_1_prints(tiny, capsys):
    """--tp 2: rank 0 in the command's process, rank 1 an actor of the local Ray it starts
    (run as its own process, so that Ray and its rank leave with it)."""
    args = [
        "generate", "--model", str(tiny.model_dir), "--device", "cpu",
        f"--lora=a1={tiny.adapters['adapter-01']}", f"--lora=a3={tiny.adapters['adapter-03']}",
        "--prompt", "hello world", "--adapter", "base",
        "--prompt", "the cat sat", "--adapter", "a1",
        "--prompt", "the cat sat", "--adapter", "a3",
        "--max-tokens", "8", "--json",
    ]  # fmt: skip
    code, single, _ = run_cli(capsys, *args)
    assert code == 0
    proc = subprocess.run(
        [sys.executable, "-m", "cluster.cli", *args, "--tp", "2"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert rows == [json.loads(line) for line in single.splitlines()]
    assert len({tuple(r["output_token_ids"]) for r in rows[1:]}) == 2


def test_generate_plain_text(tiny, capsys):
    code, out, _ = run_cli(
        capsys, "generate", "--model", str(tiny.model_dir), "--prompt", "hi", "--max-tokens", "4"
    )
    assert code == 0 and out.startswith("[base] hi")


def test_generate_unknown_adapter_is_a_clear_error(tiny, capsys):
    code, _, err = run_cli(
        capsys, "generate", "--model", str(tiny.model_dir), "--prompt", "hi", "--adapter", "nope"
    )
    assert code == 2
    assert "unknown adapter 'nope'" in err


def test_demo_assets_command(tmp_path, capsys):
    code, out, _ = run_cli(capsys, "demo-assets", "--out", str(tmp_path), "--adapters", "2")
    assert code == 0
    assert (tmp_path / "model" / "config.json").is_file()
    assert out.count("adapter:") == 2
