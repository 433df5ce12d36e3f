"""`python -m benchmarks engine --quant fp8,w4a16`: the demo model's decode step with its
projections held packed in each format, against the same model dense.

Every model is the demo Llama's config.json (the tests' tiny Llama with --quick) with
seeded random weights made on the device (engine.load_format dummy), dense or with a
quantization_config naming the format, so each format runs at the same shapes with the
same adapters (the demo's, at their ranks).
Per format: the bytes of every tensor a decode step reads (its weights; the packed ones
as the checkpoint stores them), the base decode step at batch 1 and at the adapter batch,
the same batch with every sequence on its own adapter, and the ratios to the dense model.
On a CPU the packed layers dequantize tile by tile (kernels.quant_torch): they trade time
for memory; the GPU targets of issue 42 are for the Triton path.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

from benchmarks.gpu import QUANT_FORMATS
from cluster.demo.assets import DemoAssets, DemoSpec, cached_demo_assets, tiny_spec

# quantization_config of each format, as the Hub and llm-compressor write them
QUANT_CONFIGS = {
    "fp8": QUANT_FORMATS["fp8"],
    "fp8-channel": {"quant_method": "compressed-tensors", "format": "float-quantized",
                    "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                        "num_bits": 8, "type": "float", "strategy": "channel"}}},
                    "ignore": ["lm_head"]},
    "w4a16": QUANT_FORMATS["w4a16"],
    "gptq": {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False},
    "awq": {"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm",
            "zero_point": True},
    "nf4": {"quant_method": "bitsandbytes", "load_in_4bit": True,
            "bnb_4bit_quant_type": "nf4"},
}  # fmt: skip
FORMATS = tuple(QUANT_CONFIGS)


def run(args: argparse.Namespace, decode_step, base_step) -> dict:
    """{"dense" and each of args.quant: figures}, printed as a table. `decode_step(assets,
    n, args, **engine)` and `base_step(assets, args, **engine)` are benchmarks.engine's."""
    spec = DemoSpec(num_adapters=args.adapters)
    if args.quick:  # the tiny Llama of the unit tests: a smoke run of seconds
        spec = tiny_spec(
            "llama",
            num_adapters=args.adapters,
            vocab_size=2048,  # ids < 2000
            hidden_size=128,
            intermediate_size=256,
        )  # whole groups of 128
    demo = cached_demo_assets(spec)
    n = min(16, args.adapters)
    out = {}
    with tempfile.TemporaryDirectory(prefix="lorafleet-bench-quant-") as tmp:
        for fmt in ("dense", *args.quant):
            model_dir = _config_only(demo.model_dir, Path(tmp) / fmt, QUANT_CONFIGS.get(fmt))
            assets = DemoAssets(Path(tmp), model_dir, demo.adapters)
            figures = decode_step(assets, n, args, load_format="dummy")
            one = argparse.Namespace(**{**vars(args), "concurrency": 1})
            figures["decode_step_batch1_s"] = base_step(assets, one, load_format="dummy")
            out[fmt] = figures
    dense = out["dense"]
    for figures in out.values():
        figures["weight_bytes_vs_dense"] = (
            figures["decode_weight_bytes"] / dense["decode_weight_bytes"]
        )
        figures["batch1_speedup_vs_dense"] = (
            dense["decode_step_batch1_s"] / figures["decode_step_batch1_s"]
        )
        figures["lora_overhead"] = figures["decode_step_ratio_16_adapters_vs_base"]
    _print(out, "the tests' tiny Llama" if args.quick else "demo Llama")
    return out


def _config_only(src: Path, out: Path, quant: dict | None) -> Path:
    out.mkdir(parents=True)
    for f in src.iterdir():
        if f.suffix in (".json", ".jinja") and "safetensors" not in f.name:
            shutil.copy(f, out / f.name)
    if quant is not None:
        cfg = json.loads((out / "config.json").read_text())
        (out / "config.json").write_text(json.dumps(cfg | {"quantization_config": quant}))
    return out


def _print(out: dict, model: str) -> None:
    batch = next(iter(out.values()))["decode_batch"]
    print(f"\nquantized bases ({model}, dummy weights): decode step, base and {batch} "
          "adapters")  # fmt: skip
    columns = ("weights MiB", "vs dense", "batch 1 ms", "speed", f"base x{batch} ms",
               f"{batch} LoRA ms", "LoRA/base")  # fmt: skip
    widths = (11, 8, 10, 6, 13, 11, 9)
    print(f"{'format':<12} " + " ".join(f"{c:>{w}}" for c, w in zip(columns, widths)))
    for fmt, f in out.items():
        print(
            f"{fmt:<12} {f['decode_weight_bytes'] / 2**20:>11.1f} "
            f"{f['weight_bytes_vs_dense']:>8.2f} {f['decode_step_batch1_s'] * 1e3:>10.2f} "
            f"{f['batch1_speedup_vs_dense']:>5.2f}x {f['decode_step_base_s'] * 1e3:>13.2f} "
            f"{f['decode_step_16_adapters_s'] * 1e3:>11.2f} {f['lora_overhead']:>8.2f}x"
        )
