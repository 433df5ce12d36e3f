"""`python -m benchmarks gpu` without a GPU: the Llama-3.1-8B plan (its arithmetic, the
config the engine accepts), the whole measurement on a tiny model on the CPU, and graphs
counted by the engine or the run refused; and `.ci/gpu --dry-run`, which the suite runs so
that the GPU check cannot rot: every step imports as a bare GPU machine would, and plans."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import gpu, gpu_kit, harness
from replica.engine.engine import LLMEngine
from replica.model.spec import load_model_spec

ROOT = Path(__file__).resolve().parents[2]


def test_the_shape_is_llama_3_1_8b():
    s = gpu.LLAMA_3_1_8B
    assert (s.vocab_size, s.num_layers, s.hidden_size) == (128256, 32, 4096)
    assert (s.num_heads, s.num_kv_heads, s.intermediate_size, s.head_dim) == (32, 8, 14336, 128)
    # Llama-3.1-8B has 8,030,261,248 parameters; a decode step reads all but the embedding
    assert s.weight_bytes(1) + s.vocab_size * s.hidden_size == 8_030_261_248
    assert s.kv_bytes_per_token(2) == 131072  # 32 layers x 8 heads x 128 x (K, V) x bf16
    plan = gpu.Plan(s)
    # a rank-16 adapter on all seven projections: 16 x 32 x (8192 + 5120 + 5120 + 8192 + 3 x 18432)
    assert plan.adapter_bytes() == 16 * 32 * 81920 * 2
    assert plan.kv_cache_bytes() >= plan.max_model_len * s.kv_bytes_per_token(2)  # 32k alone
    assert plan.batches == (1, 8, 32, 64) and plan.ttft_prompts == (2048, 8192, 32768)


def test_the_model_directory_reads_as_its_shape(tmp_path):
    model = gpu.write_model_dir(gpu.LLAMA_3_1_8B, tmp_path / "m")
    spec = load_model_spec(model)
    assert (spec.vocab_size, spec.num_layers, spec.num_kv_heads) == (128256, 32, 8)
    assert (model / "tokenizer.json").is_file() and not list(model.glob("*.safetensors"))
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    assert tok.decode(tok("héllo world").input_ids) == "héllo world"


def test_a_dry_run_plans_and_writes_its_summary_last(tmp_path, capsys):
    out = tmp_path / "gpu.json"
    assert harness.main(gpu, ["--dry-run", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "memory plan of an 80 GB GPU: weights 15." in printed  # the engine's own plan
    last = json.loads(printed.strip().splitlines()[-1])
    assert last["dry_run"] and last["shape"] == "llama-3.1-8b" and last["device"] == "cuda"
    assert last["targets"] == dict.fromkeys(harness.targets("gpu"))  # nothing ran: unknown
    report = json.loads(out.read_text())
    assert report["memory"]["weights"] == 8_030_261_248 * 2
    assert report["plan"]["shape"]["name"] == "llama-3.1-8b" and report["figures"] is None


def test_a_plan_that_does_not_fit_the_gpu_is_refused_before_it_starts(monkeypatch):
    monkeypatch.setattr(gpu, "SMALLEST_GPU_BYTES", 20 * 10**9)  # under the 16 GB of weights
    with pytest.raises(SystemExit, match="does not fit an 80 GB GPU"):
        harness.main(gpu, ["--dry-run"])


def _fake_graph_stats(monkeypatch) -> None:
    """Until the engine counts its graphs, a counter of steps stands in on the CPU (where
    every decode step is eager anyway)."""
    if callable(getattr(LLMEngine, "graph_stats", None)):
        return
    steps = {"n": 0}
    step = LLMEngine.step

    def counted(self):
        steps["n"] += 1
        return step(self)

    monkeypatch.setattr(LLMEngine, "step", counted)
    monkeypatch.setattr(LLMEngine, "graph_stats", lambda self: {"graphs_captured": 0,
                        "graph_replays": 0, "eager_decode_steps": steps["n"]},
                        raising=False)  # fmt: skip


@pytest.mark.slow
def test_a_tiny_run_measures_every_figure_on_the_cpu(tmp_path, capsys, monkeypatch):
    _fake_graph_stats(monkeypatch)
    out = tmp_path / "gpu.json"
    assert harness.main(gpu, ["--shape", "tiny", "--device", "cpu", "--json", str(out)]) == 0
    figures = json.loads(out.read_text())["figures"]
    plan = gpu.Plan(gpu.TINY, **gpu.TINY_PLAN)
    for b in plan.batches:
        for key in ("base_step_ms", "lora_step_ms", "lora_over_base_step", "hbm_limit_ms",
                    "base_step_over_hbm_limit", "lora_step_over_hbm_limit"):  # fmt: skip
            assert figures["decode"][f"{key}_b{b}"] > 0, (key, b)
    for n in (32, 64):
        assert figures["ttft"][f"ttft_{n}_lora_over_base"] > 0
    assert set(figures["graphs"]) == set(gpu.GRAPH_KEYS)
    assert figures["graphs"]["eager_decode_steps"] > 0  # CPU: every decode step eager
    assert figures["copy_gbps"] > 0
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert not last["dry_run"] and set(last["targets"]) == set(harness.targets("gpu"))


@pytest.mark.slow
def test_a_tiny_run_measures_each_packed_base_against_bf16(tmp_path, capsys, monkeypatch):
    """--quant: an engine per format on the base held packed (dummy weights), its batch-1
    step's speedup over the bf16 run and LoRA's overhead at the largest batch, reported
    against their targets."""
    _fake_graph_stats(monkeypatch)
    out = tmp_path / "gpu.json"
    argv = ["--shape", "tiny", "--device", "cpu", "--quant", "fp8,w4a16", "--json", str(out)]
    assert harness.main(gpu, argv) == 0
    quant = json.loads(out.read_text())["figures"]["quant"]
    for fmt in ("fp8", "w4a16"):
        for key in ("base_step_ms_b1", "speedup_b1", "lora_over_base_step_b4"):
            assert quant[f"{fmt}_{key}"] > 0, (fmt, key)
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last["targets"]["fp8_speedup_b1"] is not None  # checked, met or not
    with pytest.raises(SystemExit, match="--quant 'nf8'"):
        harness.main(gpu, ["--shape", "tiny", "--device", "cpu", "--quant", "nf8"])


def test_a_run_without_counted_graphs_is_refused(monkeypatch):
    monkeypatch.delattr(LLMEngine, "graph_stats", raising=False)
    with pytest.raises(SystemExit, match="graph_stats"):
        harness.main(gpu, ["--shape", "tiny", "--device", "cpu"])


@pytest.mark.slow
def test_ci_gpu_dry_run_imports_as_a_bare_machine_and_plans(tmp_path):
    # the script's python3 is this test's Python (a GPU machine's own python3 there)
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    env = {**os.environ, "OUT": str(tmp_path), "PATH": path}
    r = subprocess.run([str(ROOT / ".ci/gpu"), "--dry-run"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    lines = r.stdout.strip().splitlines()
    summary = json.loads(lines[-1])
    assert summary["dry_run"] and summary["bench"] == "ran"
    assert summary["targets"] == dict.fromkeys(harness.targets("gpu"))
    assert summary["tests"]["collected"] > 100  # the CUDA tests import without Ray & co.
    kit = json.loads(next(line for line in lines if line.startswith("kit: "))[5:])
    assert "ray" in kit["refused"] and "pydantic" not in kit["refused"]
    assert "No module named" not in r.stdout + r.stderr


def test_bare_refuses_what_a_gpu_machine_lacks(tmp_path):
    script = "import ray"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-m", "benchmarks.gpu_kit", "bare", "-m", "this"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert r.returncode == 0  # a module that needs none of them runs
    (tmp_path / "needs_ray.py").write_text(script)
    env["PYTHONPATH"] += os.pathsep + str(tmp_path)
    r = subprocess.run([sys.executable, "-m", "benchmarks.gpu_kit", "bare", "-m", "needs_ray"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert r.returncode != 0 and "ModuleNotFoundError" in r.stderr
    assert set(gpu_kit.KIT.values()).isdisjoint(gpu_kit.ABSENT)


def test_the_summary_counts_the_tests():
    assert gpu_kit.test_counts("...\n3 passed, 1 failed, 2 skipped in 9.1s") == {
        "passed": 3, "failed": 1, "skipped": 2}  # fmt: skip
    assert gpu_kit.test_counts("1 failed, 4 passed, 1 error in 2s")["errors"] == 1
    assert gpu_kit.test_counts("429 tests collected in 3.96s") == {"collected": 429}
    assert gpu_kit.test_counts("") == {"unknown": 1}
    interrupted = "!!! KeyboardInterrupt !!!\n(a traceback...)\n120 passed, 2 failed in 300.1s\n"
    assert gpu_kit.test_counts(interrupted + "Interrupted\n") == {"passed": 120, "failed": 2}
