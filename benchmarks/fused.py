"""`python -m benchmarks fused`: a fused projection's LoRA held split or fused.

Phi-3 / Phi-4-mini checkpoints fuse q/k/v into `qkv_proj` and gate/up into
`gate_up_proj`, and their adapters target the fused modules: one A [r, hidden], one
B [q+k+v, r]. The engine holds such an adapter split (replica/model/adapter_weights.py):
each part gets the whole A and its rows of B, so it batches in the same projection
groups as every other family's adapters. Kept fused instead, A would be stored and read
once. This measures what splitting costs, per fused projection at the real model's
shapes: the multi-LoRA ops (kernels.lora_shrink + lora_expand, the dispatch point) on
a decode batch, with A as the parts' copies (split) or once (fused), the adapters'
weights rotating through --footprint-mib of copies so they come from memory, both
variants interleaved, medians; and the bytes an adapter holds either way.

    python -m benchmarks fused          # Phi-3-mini and Phi-4-mini, ~30 s on 2 CPU cores
    python -m benchmarks fused --quick  # a smoke run: two rounds per shape, 64 MiB of copies
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

import kernels
from benchmarks import harness
from benchmarks.harness import Clock
from benchmarks.kernels import add_device_arguments, device_and_dtype, print_device

ADAPTERS, TOKENS_EACH = 16, 2  # a decode batch of 32 tokens over 16 adapters


@dataclass(frozen=True)
class FusedShape:
    model: str
    module: str
    hidden: int
    parts: tuple[int, ...]  # output rows of each part of the fused projection


def fused_shapes() -> list[FusedShape]:
    """The fused projections of Phi-3-mini (32 KV heads) and Phi-4-mini (8 KV heads)."""
    return [
        FusedShape("phi3-mini", "qkv_proj", 3072, (3072, 3072, 3072)),
        FusedShape("phi3-mini", "gate_up_proj", 3072, (8192, 8192)),
        FusedShape("phi4-mini", "qkv_proj", 3072, (3072, 1024, 1024)),
        FusedShape("phi4-mini", "gate_up_proj", 3072, (8192, 8192)),
    ]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="A smoke run: 64 MiB, 2 rounds.")
    add_device_arguments(parser)


def run(args: argparse.Namespace) -> int:
    device, dtype = device_and_dtype(args)
    if args.quick:
        args.footprint_mib, args.min_time = min(args.footprint_mib, 64), 0.0
    head = print_device(args, device, dtype, args.quick)
    rows = run_fused(args, device, dtype, Clock(device).time)
    harness.write_json(args.json, {**head, "fused": rows})
    return 0


def run_fused(
    args: argparse.Namespace,
    device: torch.device,
    dtype: torch.dtype,
    clock_time: Callable[[Callable[[], object]], float],
) -> list[dict]:
    """Time split against fused for every fused_shapes() entry; print a row each."""
    print(
        f"fused projections, decode {ADAPTERS * TOKENS_EACH} tokens over {ADAPTERS} adapters "
        f"of rank {args.rank}: split (A per part) vs fused (A once)"
    )
    print(
        f"{'model':<10} {'module':<13} {'split ms':>9} {'fused ms':>9} {'split/fused':>12} "
        f"{'adapter KiB split':>18} {'fused':>7}"
    )
    rows = []
    for shape in fused_shapes():
        rows.append(_run_shape(shape, args, device, dtype, clock_time))
        r = rows[-1]
        print(
            f"{r['model']:<10} {r['module']:<13} {r['split_ms']:>9.3f} {r['fused_ms']:>9.3f} "
            f"{r['split_over_fused']:>12.3f} {r['split_bytes'] / 1024:>18.0f} "
            f"{r['fused_bytes'] / 1024:>7.0f}",
            flush=True,
        )
    return rows


def _run_shape(
    shape: FusedShape,
    args: argparse.Namespace,
    device: torch.device,
    dtype: torch.dtype,
    clock_time: Callable[[Callable[[], object]], float],
) -> dict:
    h, r, n = shape.hidden, args.rank, len(shape.parts)
    out = sum(shape.parts)
    split_offsets = [0]
    for p in shape.parts:
        split_offsets.append(split_offsets[-1] + p)
    rows = ADAPTERS * r
    gen = torch.Generator().manual_seed(args.seed)
    a_one = (torch.randn(1, rows, h, generator=gen) / h**0.5).to(device, dtype)
    b = kernels.lora_b_buffer(out, rows, device, dtype)
    b.copy_((torch.randn(out, rows, generator=gen) / r**0.5).to(dtype))
    a_split = a_one.expand(n, rows, h).contiguous()  # every part holds the whole A
    set_bytes = (a_split.numel() + a_one.numel() + b.numel()) * b.element_size()
    copies = max(1, min(64, -(-(args.footprint_mib << 20) // set_bytes)))
    sets = [(a_one, a_split, b)] + [
        (a_one.clone(), a_split.clone(), b.clone()) for _ in range(copies - 1)
    ]
    slots = list(range(1, ADAPTERS + 1))
    random.Random(args.seed).shuffle(slots)
    seg = kernels.make_segment_info(
        [TOKENS_EACH] * ADAPTERS,
        slots,
        [0] + [r] * ADAPTERS,
        [0.0] + [0.5] * ADAPTERS,
        [0] + [(s - 1) * r for s in range(1, ADAPTERS + 1)],
        device,
    )
    x = torch.randn(ADAPTERS * TOKENS_EACH, h, generator=gen).to(device, dtype)
    y = torch.zeros(x.shape[0], out, dtype=dtype, device=device)

    def split(i: int) -> None:
        _, a, bb = sets[i % len(sets)]
        kernels.lora_expand(y, kernels.lora_shrink(x, a, seg, r), bb, seg, split_offsets)

    def fused(i: int) -> None:
        a, _, bb = sets[i % len(sets)]
        kernels.lora_expand(y, kernels.lora_shrink(x, a, seg, r), bb, seg, [0, out])

    # the same function of x before either time means anything
    results = []
    for fn in (split, fused):
        y.zero_()
        fn(0)
        results.append(y.float().clone())
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    if not torch.allclose(results[0], results[1], rtol=tol, atol=tol):
        raise AssertionError(f"{shape.model} {shape.module}: split and fused disagree")

    times: dict[str, list[float]] = {"split": [], "fused": []}
    variants = {"split": split, "fused": fused}
    for fn in variants.values():  # warm-up
        fn(1)
    order, rnd = list(variants), random.Random(args.seed)
    deadline = time.perf_counter() + 2 * args.min_time
    i = 0
    least = 2 if args.quick else 5
    while i < least or (time.perf_counter() < deadline and i < 2000):
        rnd.shuffle(order)
        for k in order:
            times[k].append(clock_time(lambda fn=variants[k], i=i: fn(i)))
        i += 1
    med = {k: statistics.median(v) for k, v in times.items()}
    elem = b.element_size()
    return {
        "model": shape.model,
        "module": shape.module,
        "hidden": h,
        "parts": list(shape.parts),
        "rank": r,
        "rounds": i,
        "split_ms": med["split"] * 1e3,
        "fused_ms": med["fused"] * 1e3,
        "split_over_fused": med["split"] / med["fused"],
        # one adapter's bytes for this projection in one layer
        "split_bytes": (n * r * h + out * r) * elem,
        "fused_bytes": (r * h + out * r) * elem,
    }


if __name__ == "__main__":
    sys.exit(harness.main(sys.modules[__name__], sys.argv[1:]))
