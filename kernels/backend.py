"""Which implementation runs the kernels, decided once rather than per op.

CUDA tensors go to Triton, CPU tensors to the torch path. LORAFLEET_KERNELS=triton|torch
forces either; it is read when this module is imported (a step issues a hundred ops:
no environment read or import per op). `force_backend` changes it at run time (tests,
the kernel bench). Triton modules are imported lazily, on the first Triton op, so a
CPU-only install never needs triton.
"""

from __future__ import annotations

import contextlib
import importlib
import os
from collections.abc import Iterator
from types import ModuleType

import torch

ENV = "LORAFLEET_KERNELS"
BACKENDS = ("triton", "torch")


def parse_forced(value: str | None) -> str | None:
    """The backend LORAFLEET_KERNELS names, None when unset or empty."""
    forced = (value or "").strip().lower()
    if forced and forced not in BACKENDS:
        raise ValueError(f"{ENV}={forced!r}: expected 'triton' or 'torch'")
    return forced or None


_forced: str | None = parse_forced(os.environ.get(ENV))
_modules: dict[tuple[str, str], ModuleType] = {}


def force_backend(name: str | None) -> None:
    """Run every op on `name` ('triton' or 'torch'), or by device again with None."""
    global _forced
    _forced = parse_forced(name)


@contextlib.contextmanager
def forced_backend(name: str | None) -> Iterator[None]:
    """force_backend for the duration of a block, then what was forced before."""
    before = _forced
    force_backend(name)
    try:
        yield
    finally:
        force_backend(before)


def backend_for(x: torch.Tensor) -> str:
    """Which implementation runs for tensors on x's device."""
    return _forced or ("triton" if x.is_cuda else "torch")


def implementation(x: torch.Tensor, family: str) -> ModuleType:
    """The module implementing op `family` for x's device: `kernels.<family>_<backend>`,
    imported once (e.g. family 'sgmv': kernels.sgmv_triton or kernels.sgmv_torch)."""
    key = (family, backend_for(x))
    module = _modules.get(key)
    if module is None:
        module = _modules[key] = importlib.import_module(f"kernels.{family}_{key[1]}")
    return module
