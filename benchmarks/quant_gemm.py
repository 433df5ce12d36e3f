"""Quantized GEMMs against the dense matmul at Llama-3.1-8B layer shapes.

    python -m benchmarks.quant_gemm [--m 1 32 512] [--formats ...] [--repeats 3]
                                    [--threads N] [--json PATH]

For each layer (q/k/v fused, o, gate/up fused, down), batch size M and packed format,
times kernels.quant_linear (the torch path on a CPU, the Triton kernel on CUDA: the
device's own dispatch) beside the dense bf16 matmul (F.linear against a bf16 W) on the
same inputs, and reports the packed weight's device bytes against bf16's. Weights are
random packed tensors of the right layout (codes, scales, zeros drawn at random): the
time of a dequantizing GEMM does not depend on the values. Dense and quantized calls
alternate, each figure the median of --repeats after one warm-up (a shared machine's
drift hits both alike; the JSON records the load average before and after); CUDA calls
are timed with events after a synchronize. The W4A16 (GPTQ, batch 1) and FP8 targets
of issue 42 are GPU figures: run this on a GPU to measure them.

Prints a table and writes JSON (default benchmarks/results/quant_gemm.json).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

import kernels
from kernels import AwqInt4, Fp8Weight, GptqInt4, Mxfp4Weight, Nf4Weight, PackQuantizedInt4

RESULTS = Path(__file__).resolve().parent / "results" / "quant_gemm.json"

# Llama-3.1-8B: hidden 4096, 32 heads / 8 KV heads of 128, intermediate 14336
LAYERS = {
    "qkv": (6144, 4096),
    "o": (4096, 4096),
    "gate_up": (28672, 4096),
    "down": (4096, 14336),
}
GROUP = 128


def random_packed(fmt: str, n: int, k: int, device: torch.device) -> kernels.QuantizedWeight:
    """A weight of format `fmt` for W [n, k] with random codes and plausible scales."""
    gen = torch.Generator().manual_seed(n * 7 + k)

    def words(*shape):
        return torch.randint(-(2**31), 2**31 - 1, shape, generator=gen, dtype=torch.int32)

    def scales(*shape, dtype=torch.float16):
        return (torch.rand(*shape, generator=gen) * 0.01 + 0.001).to(dtype)

    g = k // GROUP
    if fmt == "fp8_block":
        codes = (torch.randn(n, k, generator=gen) * 50).to(torch.float8_e4m3fn)
        w = Fp8Weight(codes, scales(-(-n // 128), -(-k // 128), dtype=torch.float32), (128, 128))
    elif fmt == "fp8_channel":
        codes = (torch.randn(n, k, generator=gen) * 50).to(torch.float8_e4m3fn)
        w = Fp8Weight(codes, scales(n, 1, dtype=torch.float32), (1, k))
    elif fmt == "gptq_int4":
        w = GptqInt4(words(k // 8, n), words(g, n // 8), scales(g, n), None, GROUP)
    elif fmt == "awq_int4":
        w = AwqInt4(words(k, n // 8), words(g, n // 8), scales(g, n), GROUP)
    elif fmt == "ct_int4":
        w = PackQuantizedInt4(
            words(n, k // 8), scales(n, g, dtype=torch.bfloat16), None, (n, k), GROUP
        )
    elif fmt == "mxfp4":
        blocks = torch.randint(0, 256, (n, k // 32, 16), generator=gen, dtype=torch.uint8)
        exps = torch.randint(118, 124, (n, k // 32), generator=gen, dtype=torch.uint8)
        w = Mxfp4Weight(blocks, exps)
    elif fmt == "nf4":
        packed = torch.randint(0, 256, (n * k // 2,), generator=gen, dtype=torch.uint8)
        code = torch.linspace(-1, 1, 16)
        w = Nf4Weight(packed, scales(n * k // 64, dtype=torch.float32), code, (n, k))
    else:
        raise ValueError(f"unknown format {fmt!r}")
    fields = {f: getattr(w, f) for f in w.__dataclass_fields__}
    return type(w)(
        **{f: v.to(device) if isinstance(v, torch.Tensor) else v for f, v in fields.items()}
    )


FORMATS = ("fp8_block", "fp8_channel", "gptq_int4", "awq_int4", "ct_int4", "mxfp4", "nf4")


def timed_ms(fn: Callable[[], object], device: torch.device) -> float:
    """Milliseconds of one call (CUDA: events after a synchronize)."""
    if device.type != "cuda":
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize(device)
    return start.elapsed_time(end)


def paired_ms(
    dense: Callable[[], object], quant: Callable[[], object], repeats: int, device: torch.device
) -> tuple[float, float]:
    """Median milliseconds of dense and quant, timed alternately after one warm-up each, so
    a shared machine's drift hits both alike."""
    dense(), quant()
    pairs = [(timed_ms(dense, device), timed_ms(quant, device)) for _ in range(repeats)]
    return statistics.median(p[0] for p in pairs), statistics.median(p[1] for p in pairs)


def run(ms: list[int], formats: list[str], layers: list[str], repeats: int) -> dict:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    load_before = os.getloadavg()[0]
    rows = []
    for layer in layers:
        n, k = LAYERS[layer]
        dense = (torch.randn(n, k, device=device) * 0.02).to(torch.bfloat16)
        packed = {fmt: random_packed(fmt, n, k, device) for fmt in formats}
        for m in ms:
            x = torch.randn(m, k, device=device).to(torch.bfloat16)
            for fmt, w in packed.items():
                dense_ms, quant_ms = paired_ms(
                    lambda x=x, d=dense: F.linear(x, d),
                    lambda x=x, w=w: kernels.quant_linear(x, w),
                    repeats, device,
                )  # fmt: skip
                row = {
                    "layer": layer, "n": n, "k": k, "m": m, "format": fmt,
                    "backend": kernels.backend_for(x), "quant_ms": round(quant_ms, 3),
                    "dense_bf16_ms": round(dense_ms, 3),
                    "speedup_vs_bf16": round(dense_ms / quant_ms, 3),
                    "packed_bytes": w.nbytes, "bf16_bytes": n * k * 2,
                    "bytes_ratio": round(w.nbytes / (n * k * 2), 4),
                }  # fmt: skip
                rows.append(row)
                print(
                    f"{layer:8s} {n:6d}x{k:<6d} M={m:<4d} {fmt:12s} {row['backend']:6s} "
                    f"{quant_ms:9.3f} ms  dense bf16 {dense_ms:8.3f} ms  "
                    f"x{row['speedup_vs_bf16']:.3f}  bytes {row['bytes_ratio']:.3f} of bf16",
                    flush=True,
                )
        del dense, packed
    return {
        "device": _device_name(device),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "repeats": repeats,
        "load_average_1min": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "rows": rows,
    }


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()} ({os.cpu_count()} cores)"
    return platform.machine()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--m", type=int, nargs="+", default=[1, 32, 512])
    parser.add_argument("--formats", nargs="+", default=list(FORMATS), choices=FORMATS)
    parser.add_argument("--layers", nargs="+", default=list(LAYERS), choices=list(LAYERS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--json", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    with torch.inference_mode():
        result = run(args.m, args.formats, args.layers, args.repeats)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
