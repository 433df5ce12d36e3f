"""Read a Hugging Face checkpoint (single or sharded safetensors) with clear errors, or make
random weights of the same names and shapes (engine.load_format "dummy").

Both kinds record the tensors read, so that the model's loader can refuse a checkpoint
tensor it neither consumed nor knowingly skipped (model/layout.py) instead of serving
without it.
"""

from __future__ import annotations

import json
import math
import zlib
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

LOAD_FORMATS = ("auto", "dummy")
# Weights are served in the engine's dtype: a stored dtype outside these is a packed or
# quantized format whose values a cast would turn into garbage.
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")
# safetensors' names of the dtypes a quantized checkpoint's packed tensors are stored in
STORED_DTYPES = {torch.float8_e4m3fn: "F8_E4M3", torch.int32: "I32", torch.int64: "I64",
                 torch.uint8: "U8", torch.float32: "F32", torch.float16: "F16",
                 torch.bfloat16: "BF16"}  # fmt: skip


DUMMY_SCALE = 2e-3  # every scale of a dummy quantized checkpoint
DUMMY_E8M0 = 127 - 8  # every MXFP4 scale of one: 2^-8, e2m1 codes (rms 2.9) to std ~0.011


class WeightLoadError(ValueError):
    """A checkpoint is missing a tensor, has one of the wrong shape or dtype, or holds one
    the model does not read."""


class Checkpoint:
    """Lazy access to the tensors of an HF model directory by name."""

    def __init__(self, model_dir: str | Path) -> None:
        self.dir = Path(model_dir)
        files = tensor_files(self.dir)  # name -> shard file
        if files is None:
            raise WeightLoadError(
                f"{self.dir}: no model.safetensors or model.safetensors.index.json "
                "(only safetensors checkpoints are supported)"
            )
        self._files = files
        self._handles: dict[Path, Any] = {}
        self._read: set[str] = set()

    def has(self, name: str) -> bool:
        return name in self._files

    def get(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """The tensor `name`, checked against the shape the model config implies."""
        self._slice(name, shape)
        return self._handles[self._files[name]].get_tensor(name)

    def get_part(
        self, name: str, shape: tuple[int, ...], dim: int, start: int, stop: int
    ) -> torch.Tensor:
        """`name`[start:stop] along `dim` (0 or 1), reading only that slice from disk;
        the whole tensor's shape is checked against `shape`."""
        part = self._slice(name, shape)
        return part[start:stop] if dim == 0 else part[:, start:stop]

    def get_packed(
        self, name: str, shape: tuple[int, ...], dtypes: tuple[torch.dtype, ...]
    ) -> torch.Tensor:
        """The tensor `name` of a quantized projection (codes, scales, zero points) as
        stored, checked against `shape` and the `dtypes` its format allows."""
        self._slice(name, shape, tuple(STORED_DTYPES[d] for d in dtypes))
        return self._handles[self._files[name]].get_tensor(name)

    def shape(self, name: str) -> tuple[int, ...]:
        """The stored shape of `name` (nothing read)."""
        if name not in self._files:
            raise WeightLoadError(f"{self.dir}: missing weight {name!r}")
        return tuple(self._open(name).get_slice(name).get_shape())

    def names(self) -> list[str]:
        """Every tensor the checkpoint holds."""
        return sorted(self._files)

    def unread(self) -> list[str]:
        """The tensors nothing has read (yet)."""
        return sorted(set(self._files) - self._read)

    def _open(self, name: str) -> Any:
        f = self._files[name]
        if f not in self._handles:
            self._handles[f] = safe_open(str(f), framework="pt")
        return self._handles[f]

    def _slice(
        self, name: str, shape: tuple[int, ...], dtypes: tuple[str, ...] = FLOAT_DTYPES
    ) -> Any:
        if name not in self._files:
            raise WeightLoadError(f"{self.dir}: missing weight {name!r} (expected shape {shape})")
        part = self._open(name).get_slice(name)
        found = tuple(part.get_shape())
        if found != tuple(shape):
            raise WeightLoadError(
                f"{self.dir}: weight {name!r} has shape {found}, "
                f"but config.json implies {tuple(shape)}"
            )
        if part.get_dtype() not in dtypes and dtypes != FLOAT_DTYPES:
            raise WeightLoadError(
                f"{self.dir}: weight {name!r} is stored as {part.get_dtype()}; its "
                f"quantization format stores it as {' or '.join(dtypes)}"
            )
        if part.get_dtype() not in dtypes:
            raise WeightLoadError(
                f"{self.dir}: weight {name!r} is stored as {part.get_dtype()}, a packed or "
                f"quantized format this server does not dequantize (it serves "
                f"{', '.join(FLOAT_DTYPES)} weights)"
            )
        self._read.add(name)
        return part


class DummyCheckpoint:
    """Random weights under any name the model asks for, made on `device` in `dtype` from
    the shape config.json implies, with no weight file read (vLLM's --load-format dummy):
    to measure speed and memory at a model's real shapes without its checkpoint.

    Each tensor is drawn whole from a generator seeded by `seed` and its name, so every
    run (and every tensor-parallel rank's part) gets the same values. Matrices are normal
    with std 1/sqrt(fan_in), so every projection keeps its activations near unit scale and
    a forward stays finite in bf16 at any depth; norms are identity (1, or 0 where the
    family stores w of x̂·(1+w)) and biases zero."""

    def __init__(
        self,
        model_dir: str | Path,
        device: torch.device,
        dtype: torch.dtype,
        norm_value: float = 1.0,
        seed: int = 0,
    ) -> None:
        self.dir = Path(model_dir)
        self.device, self.dtype, self.norm_value, self.seed = device, dtype, norm_value, seed

    def has(self, name: str) -> bool:
        return True

    def get(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        if len(shape) == 1:
            fill = self.norm_value if "norm" in name else 0.0
            if name.endswith("layer_scalar"):  # Gemma 4's output scalar: identity too
                fill = 1.0
            return torch.full(shape, fill, device=self.device, dtype=self.dtype)
        if self.device.type == "meta":  # shapes only (the memory plan's tests)
            return torch.empty(shape, device=self.device, dtype=self.dtype)
        gen = torch.Generator(self.device).manual_seed(self.seed + zlib.crc32(name.encode()))
        t = torch.randn(shape, generator=gen, device=self.device, dtype=self.dtype)
        return t.mul_(1 / math.sqrt(shape[-1]))

    def get_part(
        self, name: str, shape: tuple[int, ...], dim: int, start: int, stop: int
    ) -> torch.Tensor:
        whole = self.get(name, shape)
        return whole[start:stop] if dim == 0 else whole[:, start:stop]

    def get_packed(
        self, name: str, shape: tuple[int, ...], dtypes: tuple[torch.dtype, ...]
    ) -> torch.Tensor:
        """Random packed tensors of the format's first dtype (empty on the meta device):
        codes of any value (fp8 ones normal of std 10), scales DUMMY_SCALE (MXFP4's
        exponents DUMMY_E8M0): weights of std ~0.01-0.02, enough for a bench's forward to
        stay finite."""
        dtype = dtypes[0]
        if self.device.type == "meta":
            return torch.empty(shape, device=self.device, dtype=dtype)
        gen = torch.Generator(self.device).manual_seed(self.seed + zlib.crc32(name.encode()))
        if dtype == torch.float8_e4m3fn:
            t = torch.randn(shape, generator=gen, device=self.device) * 10
            return t.clamp(-448, 448).to(dtype)
        if name.endswith("_scales") and dtype == torch.uint8:  # MXFP4's e8m0 exponents
            return torch.full(shape, DUMMY_E8M0, device=self.device, dtype=dtype)
        if not dtype.is_floating_point:
            bits = torch.randint(0, 1 << 16, shape, generator=gen, device=self.device)
            return (bits | (bits << 16)).to(dtype)
        return torch.full(shape, DUMMY_SCALE, device=self.device, dtype=dtype)

    def shape(self, name: str) -> None:
        return None  # shapes come from config.json alone

    def names(self) -> list[str]:
        return []

    def unread(self) -> list[str]:
        return []


def open_checkpoint(
    model_dir: str | Path,
    load_format: str = "auto",
    device: torch.device | None = None,
    dtype: torch.dtype = torch.float32,
    norm_value: float = 1.0,
) -> Checkpoint | DummyCheckpoint:
    """The model directory's safetensors ("auto"), or random weights on `device` ("dummy")."""
    if load_format == "dummy":
        return DummyCheckpoint(model_dir, device or torch.device("cpu"), dtype, norm_value)
    if load_format != "auto":
        raise ValueError(f"load_format {load_format!r}: expected one of {', '.join(LOAD_FORMATS)}")
    return Checkpoint(model_dir)


def checkpoint_bytes(model_dir: str | Path) -> int | None:
    """The size of the checkpoint's tensors as its index states (metadata.total_size of
    model.safetensors.index.json), or None without one."""
    index = Path(model_dir) / "model.safetensors.index.json"
    try:
        total = json.loads(index.read_text())["metadata"]["total_size"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return int(total) if isinstance(total, int | float) else None


def tensor_files(model_dir: str | Path) -> dict[str, Path] | None:
    """Each tensor's name -> the file holding it, from model.safetensors.index.json's
    weight_map or model.safetensors' header (no tensor read); None when the directory holds
    neither (a config.json alone)."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            return {name: model_dir / fname for name, fname in weight_map.items()}
        except (ValueError, KeyError, TypeError, AttributeError):
            raise WeightLoadError(f"{index}: no weight_map of tensor names to files") from None
    single = model_dir / "model.safetensors"
    if not single.is_file():
        return None
    with safe_open(str(single), framework="pt") as f:
        return {name: single for name in f.keys()}
