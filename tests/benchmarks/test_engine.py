"""`python -m benchmarks engine --quick`: every scenario runs and every headline figure is
written, its targets checked; churn runs evict, their loads delayed through the engine's
load hook; --family measures the decode step on other model families."""

from __future__ import annotations

import argparse
import json
import math

import pytest

from benchmarks import harness
from benchmarks.__main__ import main
from benchmarks.engine import (
    CHURN_RUNS,
    Workload,
    _ChurnMemory,
    _mixed_sampling,
    run_workload,
)
from replica.config import EngineConfig

HEADLINE = (
    "speedup_vs_hf_peft",
    "speedup_ceiling_estimate",
    "speedup_ceiling_with_lora_decode",
    "load_stall_ratio_overlap_on_vs_off",
    "load_stall_ratio_with_spare_slot",
    "base_ttft_p50_ratio_churn_vs_base_only",
    "decode_step_ratio_16_adapters_vs_base",
    "decode_bytes_ratio_16_adapters_vs_base",
    "decode_step_overhead_vs_bytes",
    "decode_tok_per_s_ratio_mixed_vs_plain_sampling",
)


@pytest.mark.slow
def test_quick_run_writes_every_figure(tmp_path, capsys):
    out = tmp_path / "engine.json"
    assert main(["engine", "--quick", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    for key in HEADLINE:
        assert isinstance(report[key], float) and report[key] > 0, key
    # ours before, between the baseline's halves and after: the speedup is their mean's
    runs = report["all_resident_uniform_tok_per_s_runs"]
    assert len(runs) == 3 and all(r > 0 for r in runs)
    mean = sum(runs) / 3 / report["hf_peft_baseline"]["tok_per_s"]
    assert report["speedup_vs_hf_peft"] == pytest.approx(mean)
    scenarios = report["scenarios"]
    for name in ("uniform", "zipf", "distinct", "mixed", "base_only", "all_resident_uniform",
                 "distinct_spare_slot", "distinct_spare_slot_sync"):  # fmt: skip
        assert scenarios[name]["tok_per_s"] > 0
    assert scenarios["distinct"]["adapter_loads"] >= 4  # more adapters than slots: churn
    # churn that churns: each run's adapter memory holds less than its working set
    for name in CHURN_RUNS:
        s = scenarios[name]
        assert s["evictions"] > 0, name
        assert s["adapter_memory_rows"] < s["working_set_rows"], name
        assert s["load_delay_ms"] == report["churn"]["load_delay_ms"] > 0, name
    assert scenarios["all_resident_uniform"]["evictions"] == 0
    assert "load_delay_how" in report["churn"]
    assert not math.isnan(report["load_stall_ratio_overlap_on_vs_off"])
    mixed = report["mixed_sampling"]
    assert mixed["plain_tok_per_s"] > 0 and mixed["mixed_tok_per_s"] > 0
    printed = capsys.readouterr().out
    assert "speedup_vs_hf_peft" in printed and "decode_step_overhead_vs_bytes" in printed
    assert "decode_tok_per_s_ratio_mixed_vs_plain_sampling" in printed
    assert "evictions" in printed and "every load sleeps" in printed
    assert "families" not in report  # llama alone: the default output
    # every target of [engine] reported, none asserted: met, NOT met, or unknown
    assert set(report["targets"]) == set(harness.targets("engine"))
    for name, checked in report["targets"].items():
        assert checked["value"] == report[name] and checked["met"] in (True, False), name
    assert report["command"] == "python -m benchmarks engine --quick --json " + str(out)


@pytest.mark.slow
def test_quick_family_run_writes_the_decode_step_figures(tmp_path, capsys):
    out = tmp_path / "engine-families.json"
    assert main(["engine", "--quick", "--family", "qwen3,gemma2", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert "scenarios" not in report  # llama not asked for: only the families' decode step
    assert list(report["families"]) == ["qwen3", "gemma2"]
    for family, figures in report["families"].items():
        for key in ("decode_step_overhead_vs_bytes", "decode_step_ratio_16_adapters_vs_base",
                    "decode_bytes_ratio_16_adapters_vs_base"):  # fmt: skip
            assert isinstance(figures[key], float) and figures[key] > 0, (family, key)
        assert figures["decode_bytes_ratio_16_adapters_vs_base"] > 1  # adapters were read
        assert figures["decode_batch"] == 8
        assert figures["targets"]["decode_step_overhead_vs_bytes"]["target"] == "<= 1.15"
    printed = capsys.readouterr().out
    assert "decode_step_overhead_vs_bytes by family" in printed
    assert "  qwen3 " in printed and "  gemma2 " in printed


@pytest.mark.slow
def test_quick_moe_family_run_serves_its_expert_adapters(tmp_path, capsys):
    """A mixture of experts' bench adapters are on its experts: its engines serve them
    (engine.lora_experts), and the decode step reads their expert rows."""
    out = tmp_path / "engine-moe.json"
    assert main(["engine", "--quick", "--family", "qwen3moe", "--json", str(out)]) == 0
    figures = json.loads(out.read_text())["families"]["qwen3moe"]
    assert figures["decode_bytes_ratio_16_adapters_vs_base"] > 1
    assert figures["prefill_tok_s_lora"] > 0 and figures["decode_tok_s_lora"] > 0
    assert "every adapter on the experts" in capsys.readouterr().out


@pytest.mark.slow
def test_churn_without_eviction_fails_the_bench(tmp_path, capsys):
    # a zipf steep enough that every request names the one rank-8 adapter: nothing to evict
    out = tmp_path / "engine-zipf.json"
    argv = ["engine", "--quick", "--scenarios", "zipf", "--zipf-alpha", "60"]
    assert main([*argv, "--json", str(out)]) == 1
    assert json.loads(out.read_text())["scenarios"]["zipf"]["evictions"] == 0  # still written
    err = capsys.readouterr().err
    assert "churn without eviction" in err and "zipf: 0 evictions" in err


@pytest.mark.slow
def test_churn_memory_is_half_the_working_set_and_loads_are_delayed(tiny):
    """tiny's 4 adapters (ranks 8, 16, 32, 64) need 8 + 16 + 32 + 64 rank rows; the churn
    engine gets one 64-row block, so a run over all of them evicts, and with sync loading
    every load sleeps the delay inside the step."""
    names = list(tiny.adapters)
    args = argparse.Namespace(memory_share=0.5, slots=2, load_delay_ms=20.0, tp=1)
    base = dict(model=str(tiny.model_dir), device="auto", max_num_seqs=4,
                kv_cache_bytes=1 << 20, tp_size=1)  # fmt: skip
    pressure = _ChurnMemory(tiny, base, args)
    prompts = [[5 + i, 9, 13 + i, 17] for i in range(8)]
    wl = Workload("distinct", prompts, [names[i % 4] for i in range(8)], 2, 4)
    assert pressure.top == 64 and pressure.working_set(wl) == 120 and pressure.rows(wl) == 64
    small = Workload("small", prompts, [names[i % 2] for i in range(8)], 2, 4)
    assert pressure.working_set(small) == 24 and pressure.rows(small) == 64  # one block least
    config = EngineConfig(**pressure.config(wl, adapter_loading="sync"))
    assert config.adapters.adapter_memory_bytes == pressure.churn(wl).memory_bytes
    assert config.adapters.max_loras_per_batch == 2
    r = run_workload(config, tiny, wl, pressure.churn(wl))
    assert r.evictions > 0 and r.adapter_loads > 4  # loaded again after eviction
    assert r.load_wait_s >= r.adapter_loads * 0.020  # each sync load slept in the step
    summary = r.summary()
    assert summary["adapter_memory_rows"] == 64 and summary["working_set_rows"] == 120
    assert summary["load_delay_ms"] == 20.0


@pytest.mark.slow
@pytest.mark.ray
def test_quick_tp_run_reports_the_communication_of_a_step(tmp_path, capsys):
    # what is asserted here, nothing more: one scenario (adapter churn on 2 ranks) and the
    # communication section; the headline figures are checked on one rank above. The
    # whole --quick run on 2 ranks took ~130 s here (an engine start per run), this ~18 s.
    out = tmp_path / "engine-tp.json"
    argv = ["engine", "--quick", "--tp", "2", "--scenarios", "distinct"]
    assert main([*argv, "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert list(report["scenarios"]) == ["distinct"]  # --scenarios: that row only
    assert not set(HEADLINE) & set(report)
    assert report["scenarios"]["distinct"]["tok_per_s"] > 0
    assert report["scenarios"]["distinct"]["adapter_loads"] >= 4  # churn across the ranks
    c = report["tp_comm"]
    t, h, r = c["decode_tokens"], c["hidden_size"], c["max_lora_rank"]
    assert c["bytes_per_layer_base"] == 2 * t * h * 4  # o and down: all-reduce [T, h] fp32
    assert c["lora_extra_bytes_per_layer"] == 2 * t * r * 4  # LoRA: [T, R] fp32 each
    steps = c["bytes_per_step_by_collective"]
    assert "lora" not in steps["base"] and steps["lora"]["lora"] > 0
    assert "tensor parallelism, tp_size 2" in capsys.readouterr().out


def test_scenarios_option_refuses_unknown_names(capsys):
    with pytest.raises(SystemExit):
        main(["engine", "--scenarios", "distinct,nope"])
    assert "nope" in capsys.readouterr().err


@pytest.mark.slow
def test_mixed_sampling_scenario_reports_both_arms(tiny):
    """The mixed-sampling scenario at the tiniest sizes: 4 rows over 2 adapters, 3 tokens;
    every figure written and positive (no timing assertion: this is a shared machine)."""
    names = list(tiny.adapters)[:2]
    prompts = [[5 + i, 9, 13 + i, 17] for i in range(4)]
    wl = Workload("uniform", prompts, [names[0], None, names[1], names[0]], 3, 4)
    cfg = EngineConfig(model=str(tiny.model_dir), device="auto", max_num_seqs=4,
                       adapters={"num_slots": 3, "max_loras_per_batch": 2},
                       kv_cache_bytes=1 << 20)  # fmt: skip
    section = json.loads(json.dumps(_mixed_sampling(cfg, tiny, wl)))  # what --json writes
    assert section["batch"] == 4 and section["mixed_rows"] == 2 and section["max_tokens"] == 3
    assert section["mixed_row_params"]["logprobs"] == 5
    for arm in ("plain", "mixed"):
        runs = section[f"{arm}_tok_per_s_runs"]
        assert len(runs) == 3 and all(r > 0 for r in runs), arm
        assert section[f"{arm}_tok_per_s"] > 0
    assert section["ratio"] == pytest.approx(
        section["mixed_tok_per_s"] / section["plain_tok_per_s"]
    )


@pytest.mark.slow
def test_quick_quant_run_compares_packed_formats_with_the_dense_model(tmp_path, capsys):
    """--quant: the tiny Llama dense and held packed in each format asked for (dummy
    weights): the bytes a decode step reads shrink as the format says, every step is
    timed, and the table is printed."""
    out = tmp_path / "engine-quant.json"
    assert main(["engine", "--quick", "--quant", "fp8,w4a16", "--json", str(out)]) == 0
    report = json.loads(out.read_text())["quant"]
    assert list(report) == ["dense", "fp8", "w4a16"]
    assert report["dense"]["weight_bytes_vs_dense"] == 1
    # the embedding and head stay dense (fp32 on this CPU): most of the tiny model's bytes
    assert 0.5 < report["fp8"]["weight_bytes_vs_dense"] < 0.85
    assert report["w4a16"]["weight_bytes_vs_dense"] < report["fp8"]["weight_bytes_vs_dense"]
    for figures in report.values():
        for key in ("decode_step_batch1_s", "decode_step_base_s", "decode_step_16_adapters_s"):
            assert figures[key] > 0
    printed = capsys.readouterr().out
    assert "quantized bases" in printed and "\nw4a16 " in printed
    with pytest.raises(SystemExit):
        main(["engine", "--quant", "gguf"])
