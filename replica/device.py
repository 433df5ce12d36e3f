"""What differs between CUDA and CPU: pinned memory, host->device copies, synchronization.

Everything above this module is the same code on both.
"""

from __future__ import annotations

import torch


def resolve_device(name: str) -> torch.device:
    """'auto' picks CUDA when present, else CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def pinned(t: torch.Tensor) -> torch.Tensor:
    """Page-locked host copy when CUDA exists (so non_blocking copies are truly async)."""
    return t.pin_memory() if torch.cuda.is_available() else t


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host tensor -> device without waiting; a no-op on CPU."""
    if host.device == device:
        return host
    return pinned(host).to(device, non_blocking=True)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """'auto': bfloat16 on CUDA, float32 on CPU (exact against the reference)."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype {name!r}: expected one of auto, {', '.join(DTYPES)}") from None
