"""kernels.triton_launch: what every Triton op refuses before it launches."""

from __future__ import annotations

import pytest
import torch

from kernels import sgmv_triton
from kernels.triton_launch import check_launch

INTERPRETED = sgmv_triton._shrink_kernel  # tests/conftest.py sets TRITON_INTERPRET=1


def test_cpu_tensors_without_the_interpreter_are_refused_saying_how_to_run():
    compiled = object()  # what a jitted function is when triton compiles for a GPU
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1 .* LORAFLEET_KERNELS=torch"):
        check_launch("LoRA ops", compiled, torch.zeros(2, 3))


def test_a_strided_last_dim_is_refused_naming_the_ops_and_the_strides():
    strided = torch.zeros(4, 6)[:, ::2]
    with pytest.raises(ValueError, match=r"triton MoE GEMMs need unit stride .*\(6, 2\)"):
        check_launch("MoE GEMMs", INTERPRETED, torch.zeros(4, 3), strided)


def test_a_last_dim_of_one_element_may_have_any_stride():
    column = torch.zeros(6, 4).t()[:, :1]  # [4, 1], strides (1, 4): nothing to walk along
    assert column.stride(-1) != 1
    check_launch("attention ops", INTERPRETED, column)
