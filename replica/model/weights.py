"""Read a Hugging Face checkpoint (single or sharded safetensors) with clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open


class WeightLoadError(ValueError):
    """A checkpoint is missing a tensor or has one of the wrong shape."""


class Checkpoint:
    """Lazy access to the tensors of an HF model directory by name."""

    def __init__(self, model_dir: str | Path) -> None:
        self.dir = Path(model_dir)
        self._files = _tensor_files(self.dir)  # name -> shard file
        self._handles: dict[Path, object] = {}

    def has(self, name: str) -> bool:
        return name in self._files

    def get(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """The tensor `name`, checked against the shape the model config implies."""
        tensor = self._handle(name, shape).get_tensor(name)
        self._check(name, tuple(tensor.shape), shape)
        return tensor

    def get_part(
        self, name: str, shape: tuple[int, ...], dim: int, start: int, stop: int
    ) -> torch.Tensor:
        """`name`[start:stop] along `dim` (0 or 1), reading only that slice from disk;
        the whole tensor's shape is checked against `shape`."""
        part = self._handle(name, shape).get_slice(name)
        self._check(name, tuple(part.get_shape()), shape)
        return part[start:stop] if dim == 0 else part[:, start:stop]

    def _handle(self, name: str, shape: tuple[int, ...]):
        if name not in self._files:
            raise WeightLoadError(f"{self.dir}: missing weight {name!r} (expected shape {shape})")
        f = self._files[name]
        if f not in self._handles:
            self._handles[f] = safe_open(str(f), framework="pt")
        return self._handles[f]

    def _check(self, name: str, found: tuple[int, ...], shape: tuple[int, ...]) -> None:
        if found != tuple(shape):
            raise WeightLoadError(
                f"{self.dir}: weight {name!r} has shape {found}, "
                f"but config.json implies {tuple(shape)}"
            )


def _tensor_files(model_dir: Path) -> dict[str, Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: model_dir / fname for name, fname in weight_map.items()}
    single = model_dir / "model.safetensors"
    if not single.is_file():
        raise WeightLoadError(
            f"{model_dir}: no model.safetensors or model.safetensors.index.json "
            "(only safetensors checkpoints are supported)"
        )
    with safe_open(str(single), framework="pt") as f:
        return {name: single for name in f.keys()}
