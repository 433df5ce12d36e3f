"""`python -m benchmarks kernels --quick` and `fused --quick`: every figure written."""

from __future__ import annotations

import json

from benchmarks.__main__ import main


def test_kernels_quick_writes_every_figure(tmp_path):
    out = tmp_path / "kernels.json"
    argv = ["kernels", "--quick", "--hidden", "64", "--footprint-mib", "0", "--min-time", "0.01"]
    assert main([*argv, "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["copy_gbps"] > 0 and len(doc["shapes"]) == 2
    assert doc["command"] == "python -m benchmarks " + " ".join([*argv, "--json", str(out)])
    for shape in doc["shapes"]:
        assert shape["speedup_vs_loop"] > 0 and shape["lora_over_base_time"] > 0
        assert {"lora_gbps", "base_gbps", "lora_over_base_bytes"} <= set(shape)
    decode, prefill = doc["shapes"]  # --quick: decode-32, then a small prefill
    assert set(decode["targets"]) == {"speedup_vs_loop", "time_over_bytes"}
    assert decode["targets"]["speedup_vs_loop"]["value"] == decode["speedup_vs_loop"]
    assert prefill["targets"] is None  # the targets are set for 32 decode tokens


def test_fused_quick_times_split_and_fused_per_projection(tmp_path):
    out = tmp_path / "fused.json"
    assert main(["fused", "--quick", "--footprint-mib", "0", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["fused"]
    assert [(r["model"], r["module"]) for r in rows] == [
        ("phi3-mini", "qkv_proj"), ("phi3-mini", "gate_up_proj"),
        ("phi4-mini", "qkv_proj"), ("phi4-mini", "gate_up_proj"),
    ]  # fmt: skip
    for r in rows:
        assert r["split_ms"] > 0 and r["fused_ms"] > 0 and r["rounds"] >= 2
        assert r["split_bytes"] > r["fused_bytes"]  # each part holds the whole A
