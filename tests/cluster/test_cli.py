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


@pytest.mark.parametrize(
    "argv, message",
    [
        (["generate", "--model", "/no/such/dir", "--prompt", "hi"], "no config.json"),
        (["generate", "--model", "{tmp}", "--prompt", "hi"], "no config.json"),
        (["generate", "--model", "{model}", "--prompt", "hi", "--lora", "x"], "NAME=PATH"),
        (["generate", "--model", "{model}", "--prompt", "hi", "--lora", "a=/no/such"],
         "is not a directory"),
        (["generate", "--model", "{model}", "--prompt", "a", "--prompt", "b", "--adapter",
          "x", "--adapter", "y", "--adapter", "z"], "3 --adapter values for 2 prompts"),
        (["generate", "--model", "{model}", "--prompt", "hi", "--temperature", "9"],
         "temperature"),
        (["up", "--config", "/no/such.yaml"], "does not exist"),
        (["up", "--address", "auto", "--num-cpus", "2"], "leave it out with --address"),
        (["deploy", "{tmp}/none.yaml"], "does not exist"),
    ],
)  # fmt: skip
def test_user_errors_are_one_line_and_status_2(tiny, tmp_path, capsys, argv, message):
    """What a user can get wrong is one line on stderr and status 2, never a traceback."""
    argv = [a.format(tmp=tmp_path, model=tiny.model_dir) for a in argv]
    code, _, err = run_cli(capsys, *argv)
    assert code == 2, err
    assert message in err and err.startswith("lorafleet: error:"), err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_up_help_names_the_real_default_model(capsys):
    with pytest.raises(SystemExit):
        main(["up", "--help"])
    assert "demo-trained" in capsys.readouterr().out


def test_demo_asset_builds_never_clobber_a_directory(tmp_path, capsys):
    """`--retrain` never replaces the committed trained demo (or any existing --out)
    without --force, and a build never lands in a directory holding something else."""
    code, _, err = run_cli(capsys, "demo-assets", "--trained", "--retrain")
    assert code == 2 and "only with --force" in err and "assets/demo-trained" in err
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    for argv in (["--out", str(other)], ["--trained", "--out", str(other)]):
        code, _, err = run_cli(capsys, "demo-assets", *argv)
        assert code == 2 and len(err.strip().splitlines()) == 1, err
        assert "give a new --out" in err
    assert [p.name for p in other.iterdir()] == ["notes.txt"]
    copy = tmp_path / "copy"
    assert run_cli(capsys, "demo-assets", "--trained", "--out", str(copy))[0] == 0
    assert run_cli(capsys, "demo-assets", "--trained", "--out", str(copy))[0] == 0  # again: fine
