"""Multi-LoRA kernels: the only public names, one dispatch point.

CUDA tensors go to Triton, CPU tensors to the torch path;
LORAFLEET_KERNELS=triton|torch forces either (Triton runs on CPU under
TRITON_INTERPRET=1, for tests).
"""

from __future__ import annotations

import os

import torch

from kernels.reference import lora_expand_reference, lora_shrink_reference
from kernels.segments import SegmentInfo, make_segment_info

__all__ = [
    "SegmentInfo",
    "make_segment_info",
    "lora_shrink",
    "lora_expand",
    "backend_for",
]


def backend_for(x: torch.Tensor) -> str:
    """Which implementation runs for tensors on x's device."""
    forced = os.environ.get("LORAFLEET_KERNELS", "").strip().lower()
    if forced in ("triton", "torch"):
        return forced
    if forced:
        raise ValueError(f"LORAFLEET_KERNELS={forced!r}: expected 'triton' or 'torch'")
    return "triton" if x.is_cuda else "torch"


def lora_shrink(
    x: torch.Tensor, a: torch.Tensor, seg: SegmentInfo, num_slices: int = 1
) -> torch.Tensor:
    """x: [T, in], a: [S, num_slices*R, in] -> [T, num_slices*R] float32.
    See kernels.reference.lora_shrink_reference for the exact semantics."""
    return lora_shrink_reference(x, a, seg, num_slices)


def lora_expand(
    y: torch.Tensor,
    inter: torch.Tensor,
    b: torch.Tensor,
    seg: SegmentInfo,
    slice_offsets: list[int],
) -> torch.Tensor:
    """y: [T, out_total] += per-slot scaled inter @ bᵀ, in place.
    See kernels.reference.lora_expand_reference for the exact semantics."""
    return lora_expand_reference(y, inter, b, seg, slice_offsets)
