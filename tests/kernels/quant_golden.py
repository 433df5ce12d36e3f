"""Writes tests/kernels/data/quant_golden.safetensors: packed weights and their
dequantization made by each format's own tooling, the oracle tests/kernels/
test_quant_formats.py checks kernels.quant_formats against without that tooling
installed (none of it is a lorafleet dependency).

    pip install --no-deps --target /tmp/quant_oracles compressed-tensors==0.20.0 \\
        loguru bitsandbytes==0.50.2
    pip download --no-deps --no-binary :all: -d /tmp autoawq==0.2.9  # then untar it
    AUTOAWQ_SRC=/tmp/autoawq-0.2.9 PYTHONPATH=$PWD:/tmp/quant_oracles \
        python -m tests.kernels.quant_golden

(AutoAWQ's package imports datasets and its models at import; its packing_utils.py, pure
torch, is loaded alone from the source tree.)

Per case `<case>.<tensor>`: the packed tensors as the tool wrote or read them, and
`<case>.dequantized`, the tool's own dequantization:
- ct_sym / ct_asym: compressed-tensors' PackedQuantizationCompressor.compress of a
  group-64 int4 scheme, then its decompress.
- ct_fp8_{tensor,channel,block}: its FloatQuantizationCompressor (float-quantized).
- awq: packed by kernels.quant_pack.pack_awq, dequantized by AutoAWQ's
  awq.utils.packing_utils.dequantize_gemm.
- gptq: the AWQ case repacked by AutoAWQ's unpack_reorder_pack (its exllama/GPTQ v1
  layout), dequantized as the AWQ original.
- nf4 / nf4_nested: bitsandbytes.functional.quantize_4bit (nested: double-quantized
  absmax) and dequantize_4bit, on the CPU.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

from kernels.quant_pack import pack_awq, quantize_int4

OUT = Path(__file__).parent / "data" / "quant_golden.safetensors"
N, K, GROUP = 32, 128, 64


def compressed_tensors_cases(w: torch.Tensor) -> dict[str, torch.Tensor]:
    from compressed_tensors.compressors.naive_quantized.base import (
        FloatQuantizationCompressor,
    )
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from compressed_tensors.quantization.utils import calculate_qparams

    out = {}
    for case, sym in (("ct_sym", True), ("ct_asym", False)):
        args = QuantizationArgs(
            num_bits=4, type="int", symmetric=sym, strategy="group", group_size=GROUP
        )
        grouped = w.view(N, K // GROUP, GROUP)
        scale, zp = calculate_qparams(grouped.amin(-1), grouped.amax(-1), args)
        scheme = QuantizationScheme(targets=["Linear"], weights=args)
        sd = {"weight": w, "weight_scale": scale.to(torch.bfloat16), "weight_zero_point": zp}
        packed = PackedQuantizationCompressor.compress(sd, scheme)
        deq = PackedQuantizationCompressor.decompress(packed, scheme)["weight"]
        out.update({f"{case}.{name}": t for name, t in packed.items()})
        out[f"{case}.dequantized"] = deq
    for strategy, scale_shape in (("tensor", (1,)), ("channel", (N, 1)), ("block", (1, 1))):
        args = QuantizationArgs(
            num_bits=8, type="float", symmetric=True, strategy=strategy,
            block_structure=[128, 128] if strategy == "block" else None,
        )  # fmt: skip
        amax = w.abs().amax(dim=1, keepdim=True) if strategy == "channel" else w.abs().amax()
        scale = (amax / 448.0).reshape(scale_shape).to(torch.bfloat16)
        scheme = QuantizationScheme(targets=["Linear"], weights=args)
        packed = FloatQuantizationCompressor.compress({"weight": w, "weight_scale": scale}, scheme)
        deq = FloatQuantizationCompressor.decompress(packed, scheme)["weight"]
        out.update({f"ct_fp8_{strategy}.{name}": t for name, t in packed.items()})
        out[f"ct_fp8_{strategy}.dequantized"] = deq
    return out


def awq_gptq_cases(w: torch.Tensor) -> dict[str, torch.Tensor]:
    path = Path(os.environ["AUTOAWQ_SRC"]) / "awq" / "utils" / "packing_utils.py"
    spec = importlib.util.spec_from_file_location("awq_packing_utils", path)
    awq_utils = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(awq_utils)
    dequantize_gemm, unpack_reorder_pack = awq_utils.dequantize_gemm, awq_utils.unpack_reorder_pack

    groups = torch.arange(K) // GROUP
    codes, scales, zeros = quantize_int4(w, groups, K // GROUP, symmetric=False)
    awq = pack_awq(codes, scales, zeros, GROUP)
    deq = dequantize_gemm(awq.qweight, awq.qzeros, awq.scales, 4, GROUP).t().contiguous()
    qweight, qzeros = unpack_reorder_pack(awq.qweight, awq.qzeros, 4)
    return {
        "awq.qweight": awq.qweight, "awq.qzeros": awq.qzeros, "awq.scales": awq.scales,
        "awq.dequantized": deq,
        "gptq.qweight": qweight, "gptq.qzeros": qzeros, "gptq.scales": awq.scales.clone(),
        "gptq.dequantized": deq.clone(),
    }  # fmt: skip


def bitsandbytes_cases(w: torch.Tensor) -> dict[str, torch.Tensor]:
    import bitsandbytes.functional as bnbf

    out = {}
    for case, nested in (("nf4", False), ("nf4_nested", True)):
        packed, state = bnbf.quantize_4bit(
            w, blocksize=64, quant_type="nf4", compress_statistics=nested
        )
        tensors = {"weight": packed, "dequantized": bnbf.dequantize_4bit(packed, state)}
        for name, t in state.as_dict(packed=True).items():
            if not name.startswith("quant_state."):  # that one is JSON: offset kept apart
                tensors[name] = t
        if nested:
            tensors["nested_offset"] = torch.tensor([float(state.offset)])
        out.update({f"{case}.{name}": t for name, t in tensors.items()})
    return out


def main() -> None:
    gen = torch.Generator().manual_seed(1234)
    w = torch.randn(N, K, generator=gen) * 0.05
    w[3, 5] = 0.4  # an outlier, as real weights have
    tensors = {"weight": w}
    tensors.update(compressed_tensors_cases(w))
    tensors.update(awq_gptq_cases(w))
    tensors.update(bitsandbytes_cases(w))
    OUT.parent.mkdir(exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, OUT)
    print(f"wrote {len(tensors)} tensors to {OUT}")


if __name__ == "__main__":
    main()
