"""Quantized GEMMs (kernels.quant_linear, kernels.quant_moe_gemm) against x @ dequantize(w)ᵀ,
on the torch path and the Triton kernel (its interpreter on CPU: tests/conftest.py sets
TRITON_INTERPRET=1), over every packed format, odd batch sizes and shapes that are not
multiples of the blocks or groups where the format allows.

Tolerances: fp32 runs are exact up to summation order; bf16 runs round W into bf16 (and
the torch path its output), so they get bf16's table entry.
"""

from __future__ import annotations

import pytest
import torch

import kernels
from kernels import dequantize, forced_backend, make_expert_plan, stack_experts
from kernels.moe_reference import moe_grouped_gemm_reference
from kernels.quant_pack import (
    pack_awq,
    pack_gptq,
    pack_quantized,
    quantize_fp8,
    quantize_int4,
    quantize_mxfp4,
    quantize_nf4,
)
from tests.conftest import TEST_DEVICE

try:
    from kernels import quant_triton

    BACKENDS = ["torch", "triton"]
except ImportError:  # a platform without triton still tests the torch path
    BACKENDS = ["torch"]

TOL = {torch.float32: 2e-5, torch.bfloat16: 1.6e-2}


def int4(make, n: int, k: int, group: int, symmetric: bool, gen, act_order=False):
    dense = torch.randn(n, k, generator=gen)
    groups = torch.arange(k) // group
    if act_order:  # desc_act: each row's group from a permutation
        groups = groups[torch.randperm(k, generator=gen)]
    codes, scales, zeros = quantize_int4(dense, groups, -(-k // group), symmetric)
    return make(codes, scales, zeros, group, groups if act_order else None)


# name -> weight builder(gen). Shapes: N, K odd where the layout allows (FP8 and NF4 any,
# compressed-tensors' channel strategy any K, the others K a multiple of the group and
# N of 8); groups of 64 take the scale-after-the-dot path, 32 and g_idx the per-element one.
WEIGHTS = {
    "fp8_block": lambda g: quantize_fp8(torch.randn(136, 200, generator=g), (128, 128)),
    "fp8_channel": lambda g: quantize_fp8(torch.randn(72, 100, generator=g), (1, 100)),
    "fp8_tensor": lambda g: quantize_fp8(torch.randn(40, 96, generator=g), None),
    "ct_sym": lambda g: int4(
        lambda c, s, z, gs, _: pack_quantized(c, s, None, gs), 72, 192, 64, True, g
    ),
    "ct_asym_channel": lambda g: int4(
        lambda c, s, z, gs, _: pack_quantized(c, s, z, gs), 44, 36, 36, False, g
    ),
    "gptq": lambda g: int4(lambda c, s, z, gs, _: pack_gptq(c, s, z, gs), 40, 192, 64, True, g),
    "gptq_desc_act": lambda g: int4(
        lambda c, s, z, gs, gi: pack_gptq(c, s, z, gs, gi), 40, 160, 32, False, g, True
    ),
    "awq": lambda g: int4(lambda c, s, z, gs, _: pack_awq(c, s, z, gs), 48, 128, 32, False, g),
    "mxfp4": lambda g: quantize_mxfp4(torch.randn(24, 96, generator=g)),
    "nf4": lambda g: quantize_nf4(torch.randn(17, 70, generator=g)),
}


def on_device(w):
    fields = {f: getattr(w, f) for f in w.__dataclass_fields__}
    return type(w)(**{f: v.to(TEST_DEVICE) if isinstance(v, torch.Tensor) else v
                      for f, v in fields.items()})  # fmt: skip


def expected(x: torch.Tensor, w, bias: torch.Tensor | None) -> torch.Tensor:
    ref = x.float() @ dequantize(w).T
    return ref if bias is None else ref + bias.float()


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("fmt", list(WEIGHTS))
@pytest.mark.parametrize("m", [1, 3, 17, 64])
def test_quant_linear_fp32_matches_dequantized_matmul(name, fmt, m):
    gen = torch.Generator().manual_seed(m)
    w = on_device(WEIGHTS[fmt](gen))
    x = torch.randn(m, w.shape[1], generator=gen).to(TEST_DEVICE)
    bias = torch.randn(w.shape[0], generator=gen).to(TEST_DEVICE) if m % 2 else None
    with forced_backend(name):
        got = kernels.quant_linear(x, w, bias)
    assert got.dtype == torch.float32 and got.shape == (m, w.shape[0])
    torch.testing.assert_close(got, expected(x, w, bias), rtol=TOL[x.dtype], atol=TOL[x.dtype])


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("fmt", list(WEIGHTS))
def test_quant_linear_bf16_matches_dequantized_matmul(name, fmt):
    gen = torch.Generator().manual_seed(7)
    w = on_device(WEIGHTS[fmt](gen))
    x = torch.randn(17, w.shape[1], generator=gen).to(TEST_DEVICE, torch.bfloat16)
    bias = torch.randn(w.shape[0], generator=gen).to(TEST_DEVICE, torch.bfloat16)
    with forced_backend(name):
        got = kernels.quant_linear(x, w, bias)
    assert got.dtype == torch.bfloat16
    want = expected(x, w, bias)
    scale = want.abs().max()  # relative to the output's size: W's rounding adds up over K
    torch.testing.assert_close(got.float() / scale, want / scale, rtol=0, atol=TOL[x.dtype])


def test_torch_path_never_holds_more_than_a_tile_of_dense_weight():
    """At most one tile of W is dense at a time (counted float allocations), so a layer
    never costs its dense size in memory."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from kernels import quant_torch

    n, k = 640, 1024
    w = quantize_fp8(torch.randn(n, k))
    largest = [0]

    class Largest(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, tuple | list) else (out,):
                if isinstance(t, torch.Tensor) and t.is_floating_point():
                    largest[0] = max(largest[0], t.numel())
            return out

    x = torch.randn(2, k)
    with forced_backend("torch"), Largest():
        kernels.quant_linear(x, w)
    rows = quant_torch.tile_rows(w)
    assert rows < n  # the test needs several tiles
    assert largest[0] <= rows * k


def moe_weights(fmt: str, e: int, gen) -> tuple:
    n, k = 40, 128
    dense = [torch.randn(n, k, generator=gen) for _ in range(e)]
    groups = torch.arange(k) // 64
    packers = {
        "fp8_block": lambda d: quantize_fp8(d, (128, 128)),
        "int4_gptq": lambda d: pack_gptq(*quantize_int4(d, groups, 2, True), 64),
        "int4_ct_asym": lambda d: pack_quantized(*quantize_int4(d, groups, 2, False), 64),
        "int4_awq": lambda d: pack_awq(*quantize_int4(d, groups, 2, False), 64),
        "mxfp4": quantize_mxfp4,
    }
    return stack_experts([packers[fmt](d) for d in dense])


MOE_FORMATS = ["fp8_block", "int4_gptq", "int4_ct_asym", "int4_awq", "mxfp4"]


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("fmt", MOE_FORMATS)
@pytest.mark.parametrize("t", [1, 13])
def test_quant_moe_gemm_matches_reference(name, fmt, t):
    """Experts 4 and 5 get no token: their scales are NaN, so reading them fails."""
    gen = torch.Generator().manual_seed(t)
    e, top = 6, 2
    w = moe_weights(fmt, e, gen)
    ids = torch.stack([torch.randperm(4, generator=gen)[:top] for _ in range(t)])
    plan = make_expert_plan(ids.to(TEST_DEVICE), e)
    x = torch.randn(t * top, w.shape[1], generator=gen)
    want = moe_grouped_gemm_reference(x, dequantize(w), plan.expert_indptr.cpu())
    w = on_device(poison_experts(w, [4, 5]))
    with forced_backend(name):
        got = kernels.quant_moe_gemm(x.to(TEST_DEVICE), w, plan)
    torch.testing.assert_close(got.cpu(), want, rtol=TOL[torch.float32], atol=TOL[torch.float32])


def poison_experts(w, experts: list[int]):
    """NaN scales for the given experts (MXFP4: e8m0 255, the spec's NaN, read as 2**128
    = inf by our decoders, which a read turns into inf or NaN as well)."""
    field = {
        "Fp8Weight": "scale", "GptqInt4": "scales", "AwqInt4": "scales",
        "PackQuantizedInt4": "weight_scale", "Mxfp4Weight": "scales",
    }[type(w).__name__]  # fmt: skip
    t = getattr(w, field).clone()
    t[experts] = 255 if t.dtype == torch.uint8 else float("nan")
    return type(w)(**{**{f: getattr(w, f) for f in w.__dataclass_fields__}, field: t})


@pytest.mark.parametrize("fmt", ["fp8_block", "int4_gptq", "mxfp4"])
def test_graph_safe_torch_moe_equals_eager(fmt):
    gen = torch.Generator().manual_seed(2)
    w = moe_weights(fmt, 4, gen)
    ids = torch.stack([torch.randperm(4, generator=gen)[:2] for _ in range(5)])
    plan = make_expert_plan(ids, 4)
    graph_safe = type(plan)(**{**plan.__dict__, "graph_safe": True})
    x = torch.randn(10, w.shape[1], generator=gen)
    with forced_backend("torch"):
        eager = kernels.quant_moe_gemm(x, w, plan)
        fixed = kernels.quant_moe_gemm(x, w, graph_safe)
    torch.testing.assert_close(fixed, eager, rtol=TOL[x.dtype], atol=TOL[x.dtype])


@pytest.mark.skipif("triton" not in BACKENDS, reason="needs triton")
@pytest.mark.parametrize("block", [(128, 128), (1, 200)])
def test_w8a8_triton_matches_per_token_quantized_reference(block):
    gen = torch.Generator().manual_seed(9)
    w = on_device(quantize_fp8(torch.randn(136, 200, generator=gen), block))
    x = (torch.randn(17, 200, generator=gen) * torch.rand(17, 1, generator=gen) * 4).to(TEST_DEVICE)
    xq, xs = quant_triton.per_token_fp8(x)
    want = (xq.float() * xs[:, None]) @ dequantize(w).T
    with forced_backend("triton"):
        got = kernels.quant_linear(x, w, act_fp8=True)
    torch.testing.assert_close(got, want, rtol=TOL[torch.float32], atol=1e-4)
    with forced_backend("torch"), pytest.raises(ValueError, match="Triton path only"):
        kernels.quant_linear(x.cpu(), quantize_fp8(torch.randn(8, 200)), act_fp8=True)
    odd_blocks = on_device(quantize_fp8(torch.randn(8, 200), (128, 96)))  # a scale per element
    with forced_backend("triton"), pytest.raises(ValueError, match="act_fp8 needs"):
        kernels.quant_linear(x, odd_blocks, act_fp8=True)


def test_bad_calls_are_refused_before_any_backend():
    gen = torch.Generator().manual_seed(0)
    w = WEIGHTS["gptq"](gen)
    with pytest.raises(ValueError, match=r"must be \[M, 192\]"):
        kernels.quant_linear(torch.randn(2, 100), w)
    with pytest.raises(ValueError, match="act_fp8 needs FP8"):
        kernels.quant_linear(torch.randn(2, 192), w, act_fp8=True)
    with pytest.raises(ValueError, match="bias"):
        kernels.quant_linear(torch.randn(2, 192), w, torch.zeros(3))
    with pytest.raises(ValueError, match="stacked experts"):
        kernels.quant_linear(torch.randn(2, 192), stack_experts([w, w]))
    plan = make_expert_plan(torch.tensor([[0], [1]]), 3)
    with pytest.raises(ValueError, match="experts"):
        kernels.quant_moe_gemm(torch.randn(2, 192), stack_experts([w, w]), plan)


@pytest.mark.skipif("triton" not in BACKENDS, reason="needs triton")
@pytest.mark.parametrize("fmt", ["fp8_block", "gptq_desc_act", "nf4"])
@pytest.mark.parametrize("split", [2, 3])
def test_split_k_partial_sums_add_up_with_the_bias_once(fmt, split):
    """Split K (the decode GEMV's fill of the GPU): each split's partial product lands in
    its own slice and torch sums them; a split past K contributes zeros."""
    gen = torch.Generator().manual_seed(11)
    w = on_device(WEIGHTS[fmt](gen))
    x = torch.randn(3, w.shape[1], generator=gen).to(TEST_DEVICE)
    bias = torch.randn(w.shape[0], generator=gen).to(TEST_DEVICE)
    got = quant_triton.quant_linear(x, w, bias, split_k=split)
    torch.testing.assert_close(got, expected(x, w, bias), rtol=TOL[x.dtype], atol=TOL[x.dtype])


@pytest.mark.skipif("triton" not in BACKENDS, reason="needs triton")
def test_split_k_fills_the_sms_of_a_decode_gemv(monkeypatch):
    monkeypatch.setattr(quant_triton, "_sm_count", lambda index: 132)
    cuda = torch.device("cuda", 0)
    split = quant_triton._split_k(64, 4096, 64, cuda)  # M=1, N=4096 in 64-column tiles
    assert split > 1 and 64 * split <= 2 * 132 and 4096 // split >= 4 * 64
    assert quant_triton._split_k(64, 4096, 64, torch.device("cpu")) == 1
    assert quant_triton._split_k(64, 256, 64, cuda) == 1  # 4 K steps in all: nothing to split
    assert quant_triton._split_k(1024, 4096, 64, cuda) == 1  # M=512: the grid fills already


@pytest.mark.skipif("triton" not in BACKENDS, reason="needs triton")
def test_triton_refuses_layouts_it_reads_as_contiguous():
    """The kernel indexes NF4 bytes flat and MXFP4 blocks by byte: a strided view would be
    read wrong, so it is refused (the torch path takes any strides)."""
    gen = torch.Generator().manual_seed(12)
    nf4 = quantize_nf4(torch.randn(8, 64, generator=gen))
    strided = type(nf4)(
        torch.stack([nf4.packed, nf4.packed], 1)[:, 0], nf4.absmax, nf4.code, nf4.shape
    )
    x = torch.randn(2, 64, generator=gen)
    with pytest.raises(ValueError, match="contiguous"):
        quant_triton.quant_linear(x, strided)
    mx = quantize_mxfp4(torch.randn(8, 64, generator=gen))
    strided_blocks = type(mx)(torch.stack([mx.blocks, mx.blocks], -1)[..., 0], mx.scales)
    with pytest.raises(ValueError, match="unit stride"):
        quant_triton.quant_linear(x, strided_blocks)
