"""Model directories the tests write or read without building a model: the published
configs, a weightless copy, an edited config.json, a checkpoint in a quantized layout."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

PUBLISHED = Path(__file__).resolve().parent / "published_configs"


def config_only(model_dir: Path, out: Path, **changes) -> Path:
    """Return `out`, a copy of `model_dir` without its weights: config.json (edited by
    `changes`) and the tokenizer's files."""
    out.mkdir()
    for f in model_dir.iterdir():
        if f.suffix in (".json", ".jinja") and "safetensors" not in f.name:
            shutil.copy(f, out / f.name)
    cfg = json.loads((out / "config.json").read_text()) | changes
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def edit_config(model_dir, **changes) -> None:
    """Changes the keys `changes` names in `model_dir`'s config.json."""
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg.update(changes)
    (model_dir / "config.json").write_text(json.dumps(cfg))


FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
              "weight_block_size": [128, 128]}  # fmt: skip


def write_block_fp8_qwen3(out) -> None:
    """Writes into `out` the tiny Qwen3 in Qwen's block-FP8 layout (Qwen3-*-FP8): every
    projection stored as float8_e4m3fn with a float32 weight_scale_inv per 128x128 block,
    the embedding, head and norms kept, quantization_config saying so."""
    from cluster.demo.families import family_model_dir

    src = family_model_dir("qwen3")
    shutil.copytree(src, out)
    tensors = load_file(out / "model.safetensors")
    for name in [n for n in tensors if n.endswith("_proj.weight")]:
        w = tensors[name].float()
        blocks = [-(-d // 128) for d in w.shape]
        scale = w.abs().amax().clamp(min=1e-12) / 448.0  # e4m3's largest value
        tensors[name] = (w / scale).to(torch.float8_e4m3fn)
        tensors[name.replace(".weight", ".weight_scale_inv")] = torch.full(blocks, scale.item())
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    edit_config(out, quantization_config=FP8_CONFIG)
