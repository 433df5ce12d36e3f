"""The checks every Triton op makes before its launch, beyond kernels' shared ones."""

from __future__ import annotations

import torch
from triton.runtime.interpreter import InterpretedFunction


def check_launch(op: str, kernel: object, *tensors: torch.Tensor) -> None:
    """Raise unless `kernel` can run on the tensors' device (a CPU tensor needs the
    interpreter: its jitted functions are then InterpretedFunction) and every tensor has
    unit stride along its last dim where that dim has more than one element (the kernels
    take the other strides as arguments). `op` names the ops in the message."""
    if tensors[0].device.type == "cpu" and not isinstance(kernel, InterpretedFunction):
        raise RuntimeError(
            "the triton backend got CPU tensors: set TRITON_INTERPRET=1 before triton is "
            "imported, or use LORAFLEET_KERNELS=torch"
        )
    for t in tensors:
        if t.shape[-1] > 1 and t.stride(-1) != 1:
            raise ValueError(f"triton {op} need unit stride on the last dim, got {t.stride()}")
