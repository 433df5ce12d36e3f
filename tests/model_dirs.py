"""Model directories the tests write or read without building a model: the published
configs, a weightless copy, an edited config.json, a checkpoint labelled with a quant method
we do not serve."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

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


def write_gguf_labelled_qwen3(out) -> None:
    """Writes into `out` the tiny Qwen3 whose config.json declares a quant_method this
    server does not serve (gguf): whatever its tensors, it must be refused by name, never
    read as plain."""
    from cluster.demo.families import family_model_dir

    shutil.copytree(family_model_dir("qwen3"), out)
    edit_config(out, quantization_config={"quant_method": "gguf"})
