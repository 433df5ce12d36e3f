"""kernels.quant_formats' dequantize against each format's own tooling, and the packers of
kernels.quant_pack against the published layouts.

Oracles: transformers' own dequantization (installed: FP8 block / channel / tensor
through finegrained_fp8, MXFP4 through the gpt-oss converter), and for the formats whose
tooling lorafleet does not depend on, tests/kernels/data/quant_golden.safetensors: the
packed tensors and dequantized weights that compressed-tensors 0.20, AutoAWQ 0.2.9 and
bitsandbytes 0.50.2 themselves produced (tests/kernels/quant_golden.py writes it).
Each comparison casts our float32 result into the tool's dtype: both round the exact
product once, so they agree bit for bit.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from kernels import (
    AwqInt4,
    Fp8Weight,
    GptqInt4,
    Mxfp4Weight,
    Nf4Weight,
    PackQuantizedInt4,
    dequantize,
    stack_experts,
)
from kernels.quant_formats import e4m3_over_256
from kernels.quant_pack import (
    nf4_absmax,
    pack_awq,
    pack_gptq,
    pack_quantized,
    quantize_fp8,
    quantize_int4,
    quantize_mxfp4,
    quantize_nf4,
)

GOLDEN = Path(__file__).parent / "data" / "quant_golden.safetensors"


@pytest.fixture(scope="module")
def golden() -> dict[str, torch.Tensor]:
    return load_file(GOLDEN)


def case(golden: dict[str, torch.Tensor], name: str) -> dict[str, torch.Tensor]:
    return {k.split(".", 1)[1]: v for k, v in golden.items() if k.startswith(name + ".")}


def assert_same(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours.to(theirs.dtype), theirs, rtol=0, atol=0)


@pytest.mark.parametrize("name", ["ct_sym", "ct_asym"])
def test_pack_quantized_matches_compressed_tensors(golden, name):
    t = case(golden, name)
    w = PackQuantizedInt4(
        t["weight_packed"], t["weight_scale"], t.get("weight_zero_point"),
        tuple(t["weight_shape"].tolist()), group_size=64,
    )  # fmt: skip
    assert_same(dequantize(w), t["dequantized"])


@pytest.mark.parametrize("strategy", ["tensor", "channel", "block"])
def test_float_quantized_matches_compressed_tensors(golden, strategy):
    t = case(golden, f"ct_fp8_{strategy}")
    n, k = t["weight"].shape
    block = {"tensor": (n, k), "channel": (1, k), "block": (128, 128)}[strategy]
    scale = t["weight_scale"].float().reshape(-(-n // block[0]), -(-k // block[1]))
    assert_same(dequantize(Fp8Weight(t["weight"], scale, block)), t["dequantized"])


def test_awq_matches_autoawq(golden):
    t = case(golden, "awq")
    assert_same(dequantize(AwqInt4(t["qweight"], t["qzeros"], t["scales"], 64)), t["dequantized"])


def test_gptq_v1_matches_autoawqs_exllama_repack(golden):
    """AutoAWQ's unpack_reorder_pack writes the GPTQ v1 (exllama) layout: codes along K,
    zeros - 1 along N."""
    t = case(golden, "gptq")
    w = GptqInt4(t["qweight"], t["qzeros"], t["scales"], None, 64)
    assert_same(dequantize(w), t["dequantized"])


def test_our_gptq_packer_writes_autoawqs_exllama_words(golden):
    """Quantizing the golden weight and packing it as GPTQ ourselves gives the words
    AutoAWQ's repack wrote, bit for bit (the AWQ words were ours: the AWQ case checks
    how AutoAWQ reads them)."""
    w = golden["weight"]
    groups = torch.arange(w.shape[1]) // 64
    codes, scales, zeros = quantize_int4(w, groups, w.shape[1] // 64, symmetric=False)
    gptq = case(golden, "gptq")
    ours_gptq = pack_gptq(codes, scales, zeros, 64)
    assert torch.equal(ours_gptq.qweight, gptq["qweight"])
    assert torch.equal(ours_gptq.qzeros, gptq["qzeros"])


@pytest.mark.parametrize("name", ["nf4", "nf4_nested"])
def test_nf4_matches_bitsandbytes(golden, name):
    t = case(golden, name)
    n, k = t["dequantized"].shape
    absmax = t["absmax"]
    if name == "nf4_nested":
        absmax = nf4_absmax(
            absmax, t["nested_absmax"], t["nested_quant_map"], float(t["nested_offset"])
        )
    w = Nf4Weight(t["weight"].reshape(-1), absmax, t["quant_map"], (n, k), blocksize=64)
    assert_same(dequantize(w), t["dequantized"])


def test_our_nf4_packer_writes_bitsandbytes_bytes(golden):
    ours = quantize_nf4(golden["weight"], blocksize=64)
    t = case(golden, "nf4")
    assert torch.equal(ours.packed, t["weight"].reshape(-1))
    assert torch.equal(ours.absmax, t["absmax"])


@pytest.mark.parametrize("block", [(128, 128), None, "channel"])
@pytest.mark.parametrize("shape", [(256, 384), (200, 136)])  # whole 128-blocks, and partial
def test_fp8_matches_transformers(block, shape):
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    gen = torch.Generator().manual_seed(0)
    dense = torch.randn(*shape, generator=gen)
    w = quantize_fp8(dense, (1, shape[1]) if block == "channel" else block)
    theirs = _dequantize_fp8_weight(
        w.weight, w.scale if block is not None else w.scale.reshape(()),
        [128, 128] if block == (128, 128) else None, torch.float32,
    )  # fmt: skip
    assert_same(dequantize(w), theirs)


def test_mxfp4_experts_match_transformers_gpt_oss_converter():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    gen = torch.Generator().manual_seed(0)
    w = stack_experts([quantize_mxfp4(torch.randn(48, 96, generator=gen)) for _ in range(3)])
    theirs = convert_moe_packed_tensors(w.blocks, w.scales, dtype=torch.float32)  # [E, K, N]
    assert_same(dequantize(w), theirs.transpose(1, 2))


def test_e4m3_bits_read_as_fp16_are_the_value_over_256():
    every = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
    ours = e4m3_over_256(every).float() * 256
    finite = ~every.float().isnan()
    assert torch.equal(ours[finite], every.float()[finite])


def test_desc_act_g_idx_equals_the_permuted_contiguous_weight():
    """A desc_act checkpoint stores rows in the original order with g_idx naming each
    row's group: dequantizing it gives the contiguous-group weight's columns permuted."""
    gen = torch.Generator().manual_seed(3)
    n, k, group = 24, 96, 32
    dense = torch.randn(n, k, generator=gen)
    groups = torch.arange(k) // group
    codes, scales, zeros = quantize_int4(dense, groups, k // group, symmetric=False)
    plain = pack_gptq(codes, scales, zeros, group)
    perm = torch.randperm(k, generator=gen)
    act = pack_gptq(codes[:, perm], scales, zeros, group, g_idx=groups[perm])
    assert torch.equal(dequantize(act), dequantize(plain)[:, perm])


@pytest.mark.parametrize("symmetric", [True, False])
def test_int4_layouts_agree_and_stay_close_to_the_weight(symmetric):
    gen = torch.Generator().manual_seed(4)
    n, k, group = 40, 192, 64
    dense = torch.randn(n, k, generator=gen)
    groups = torch.arange(k) // group
    codes, scales, zeros = quantize_int4(dense, groups, k // group, symmetric)
    weights = [
        pack_quantized(codes, scales, None if symmetric else zeros, group, torch.float32),
        pack_gptq(codes, scales, zeros, group, scale_dtype=torch.float32),
        pack_awq(codes, scales, zeros, group, scale_dtype=torch.float32),
    ]
    ref = dequantize(weights[0])
    for w in weights[1:]:
        assert torch.equal(dequantize(w), ref)
    step = scales.index_select(1, groups)  # half a step of rounding, a step at a clamp
    assert ((ref - dense).abs() <= step * 1.01).all()


def test_stacked_experts_dequantize_per_expert():
    gen = torch.Generator().manual_seed(5)
    dense = [torch.randn(32, 128, generator=gen) for _ in range(3)]
    single = [quantize_fp8(d) for d in dense]
    stacked = stack_experts(single)
    assert stacked.num_experts == 3 and stacked.shape == (32, 128)
    assert torch.equal(dequantize(stacked), torch.stack([dequantize(w) for w in single]))
    with pytest.raises(ValueError, match="one format"):
        stack_experts([single[0], quantize_fp8(dense[1], None)])


def test_device_bytes_are_the_checkpoint_bytes():
    """Packed bytes = the tensors a checkpoint stores for the weight, no dense copy."""
    n, k, group = 256, 512, 128
    dense = torch.randn(n, k)
    groups = torch.arange(k) // group
    codes, scales, zeros = quantize_int4(dense, groups, k // group, symmetric=True)
    gptq = pack_gptq(codes, scales, zeros, group)
    assert gptq.nbytes == n * k // 2 + (k // group) * n * 2 + (k // group) * n // 2
    fp8 = quantize_fp8(dense)
    assert fp8.nbytes == n * k + (n // 128) * (k // 128) * 4
    mx = quantize_mxfp4(dense)
    assert mx.nbytes == n * k // 2 + n * k // 32
    assert gptq.nbytes / (n * k * 2) < 0.3 and fp8.nbytes / (n * k * 2) < 0.51


I32, U8 = torch.int32, torch.uint8


@pytest.mark.parametrize(
    "make",
    [
        lambda: Fp8Weight(torch.zeros(4, 8), torch.ones(1, 1), (4, 8)),  # not fp8
        lambda: Fp8Weight(torch.zeros(4, 8).to(torch.float8_e4m3fn), torch.ones(2, 1), (4, 8)),
        lambda: GptqInt4(torch.zeros(2, 12, dtype=I32), torch.zeros(1, 1, dtype=I32),
                         torch.ones(1, 12), None, 16),  # N not a multiple of 8
        lambda: AwqInt4(torch.zeros(16, 1, dtype=I32), torch.zeros(1, 1, dtype=I32),
                        torch.ones(1, 8), 12),  # K not a multiple of the group
        lambda: Mxfp4Weight(torch.zeros(4, 2, 16, dtype=U8), torch.zeros(4, 3, dtype=U8)),
        lambda: Nf4Weight(torch.zeros(8, dtype=U8), torch.ones(1), torch.ones(16), (4, 8)),
    ],
)  # fmt: skip
def test_malformed_tensors_are_refused_by_name(make):
    with pytest.raises(ValueError, match=r"Fp8Weight|GptqInt4|AwqInt4|Mxfp4Weight|Nf4Weight"):
        make()
