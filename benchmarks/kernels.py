"""`python -m benchmarks kernels`: the multi-LoRA ops against a naive loop and the base projection.

Each shape runs three things on one square projection (hidden -> hidden):

  lora  kernels.lora_shrink + kernels.lora_expand through the dispatch point
        (the torch path on CPU, Triton on CUDA; --backend forces either)
  loop  what a naive implementation does: for each sequence i,
        y_i += x_i @ A_iᵀ @ B_iᵀ * s_i with the adapter's own unpadded
        A_i [r, in] and B_i [out, r]
  base  the base projection alone, x @ Wᵀ

Shapes: decode (1..64 tokens, each its own adapter; "sparse" puts the adapters
in every other slot, as a fragmented slot pool would) and prefill (ragged
segments of 16..512 tokens, each its own adapter), at hidden 512 and 4096.

Weights rotate through copies spanning --footprint-mib, so every call reads
them from memory as in a real decode step, where the rest of the model evicts
them from cache (--footprint-mib 0 measures warm caches). Variants run
interleaved, in a fresh random order each round, so machine noise and the
cold caches after a base GEMM hit all alike; figures are medians. Buffers
hold R = --max-rank (default: the adapters' rank); with R > r each row of
B [S, out, R] is read strided. Bytes: LoRA = A_i and B_i of the adapters used (their rank r, not
the buffers' R) + x read + y read and written; base = W + x + y. GB/s =
bytes / median time, printed next to the machine's copy bandwidth (a copy
larger than the caches, read + write bytes).

On CUDA each call is timed with events around it, so at these sizes the
figures include the host's launch work whenever the GPU waits for it (our
engine launches eagerly, so this is what a step sees). The "graph" columns
time lora and base again as CUDA graph replays (one replay runs the call on
every weight copy), which removes the launch gaps and leaves device time.

    python -m benchmarks kernels                  # full table, ~40 s on 2 CPU cores
    python -m benchmarks kernels --quick          # a few seconds
    python -m benchmarks kernels --json out.json  # every figure, per shape
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

import kernels
from benchmarks import harness
from benchmarks.harness import Clock

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
_MAX_DECODE = 64


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="Decode-32 and a small prefill only.")
    parser.add_argument("--hidden", type=int, nargs="+", default=[512, 4096])
    parser.add_argument("--decode-tokens", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--max-rank", type=int, default=None, help="Buffers' R (default: --rank).")
    parser.add_argument("--backend", choices=["auto", "torch", "triton"], default="auto")
    add_device_arguments(parser)


def add_device_arguments(parser: argparse.ArgumentParser) -> None:
    """The options the kernel benches share (this one and `fused`)."""
    parser.add_argument("--rank", type=int, default=16, help="Rank of every adapter.")
    parser.add_argument("--dtype", choices=list(DTYPES), default=None,
                        help="Default: fp32 on CPU, bf16 on CUDA.")  # fmt: skip
    parser.add_argument("--device", default=None, help="Default: cuda if available, else cpu.")
    parser.add_argument("--footprint-mib", type=int, default=1024,
                        help="Rotate weight copies over this much memory (0: warm).")  # fmt: skip
    parser.add_argument("--min-time", type=float, default=1.0,
                        help="Seconds of timing per variant and shape.")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None, help="Write every figure here.")


def device_and_dtype(args: argparse.Namespace) -> tuple[torch.device, torch.dtype]:
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    return device, DTYPES[args.dtype or ("bf16" if device.type == "cuda" else "fp32")]


def print_device(args, device: torch.device, dtype: torch.dtype, quick: bool) -> dict:
    """The device line every kernel bench prints first; its figures for the JSON."""
    copy_gbps = harness.copy_bandwidth(device, (128 if quick else 512) << 20) / 1e9
    threads = torch.get_num_threads()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else harness.cpu_name()
    print(
        f"device {device} [{name}] ({threads} threads), {str(dtype).removeprefix('torch.')}, "
        f"rank {args.rank}, footprint {args.footprint_mib} MiB, "
        f"copy bandwidth {copy_gbps:.1f} GB/s (read+write)"
    )
    return {
        **harness.run_meta(args),
        "device": str(device),
        "device_name": name,
        "threads": threads,
        "dtype": str(dtype).removeprefix("torch."),
        "copy_gbps": copy_gbps,
        "footprint_mib": args.footprint_mib,
        "rank": args.rank,
    }


@dataclass(frozen=True)
class Shape:
    kind: str  # "decode" | "prefill"
    hidden: int
    seg_lens: tuple[int, ...]
    slots: tuple[int, ...]  # adapter slot per segment
    layout: str  # "dense": slots 1..n; "sparse": every other slot

    @property
    def name(self) -> str:
        n = sum(self.seg_lens)
        if self.kind == "decode":
            return f"decode-{n}{'-sparse' if self.layout == 'sparse' else ''} h{self.hidden}"
        lens = f"{min(self.seg_lens)}..{max(self.seg_lens)}"
        return f"prefill-{len(self.seg_lens)}x{lens} h{self.hidden}"


@dataclass
class Result:
    name: str
    kind: str
    layout: str
    hidden: int
    tokens: int
    segments: int
    adapters: int
    rank: int
    max_rank: int
    dtype: str
    backend: str
    lora_ms: float
    loop_ms: float
    base_ms: float
    speedup_vs_loop: float
    lora_over_base_time: float
    lora_over_base_bytes: float
    time_over_bytes: float  # lora_over_base_time / lora_over_base_bytes: 1 = as efficient as base
    lora_bytes: int
    base_bytes: int
    lora_gbps: float
    loop_gbps: float
    base_gbps: float
    rounds: int
    # CUDA only: device time per call from CUDA graph replays (no launch gaps)
    lora_graph_ms: float | None = None
    base_graph_ms: float | None = None
    lora_over_base_graph_time: float | None = None


def shapes(args: argparse.Namespace) -> list[Shape]:
    rnd = random.Random(args.seed)
    out = []
    for h in args.hidden:
        decode = [32] if args.quick else args.decode_tokens
        for n in decode:
            out.append(_decode(h, n, "dense", rnd))
        if not args.quick:
            out.append(_decode(h, 32, "sparse", rnd))
        if not args.quick or h == min(args.hidden):
            lens = tuple(rnd.randint(16, 512) for _ in range(2 if args.quick else 4))
            slots = tuple(rnd.sample(range(1, len(lens) + 1), len(lens)))
            out.append(Shape("prefill", h, lens, slots, "dense"))
    return out


def _decode(hidden: int, n: int, layout: str, rnd: random.Random) -> Shape:
    if n > _MAX_DECODE:
        raise ValueError(f"decode tokens {n} > {_MAX_DECODE}")
    step = 2 if layout == "sparse" else 1
    slots = rnd.sample(range(1, 1 + step * n, step), n)  # token order != slot order
    return Shape("decode", hidden, (1,) * n, tuple(slots), layout)


@dataclass
class _Weights:
    w: torch.Tensor  # [hidden, hidden] base weight
    a: torch.Tensor  # [1, P, hidden]: the A arena
    b: torch.Tensor  # [hidden, P]: the B arena
    own: dict[
        int, tuple[torch.Tensor, torch.Tensor]
    ]  # slot -> unpadded (A_i [r, in], B_i [out, r])


def _weight_copies(
    hidden: int, rank: int, max_rank: int, dtype: torch.dtype, device: torch.device, footprint: int
) -> list[_Weights]:
    """Enough copies of every weight to span `footprint` bytes (at least one). The
    adapters sit side by side in arenas at their rank, as the engine packs them
    (slot s at rows (s-1)*rank: _offsets); max_rank sizes only the intermediate."""
    num_slots = 1 + 2 * _MAX_DECODE
    rows = (num_slots - 1) * rank
    gen = torch.Generator(device="cpu").manual_seed(0)
    w = (torch.randn(hidden, hidden, generator=gen) / hidden**0.5).to(device, dtype)
    a = (torch.randn(1, rows, hidden, generator=gen) / hidden**0.5).to(device, dtype)
    b = kernels.lora_b_buffer(hidden, rows, device, dtype)
    b.copy_((torch.randn(hidden, rows, generator=gen) / rank**0.5).to(dtype))
    set_bytes = (w.numel() + a.numel() + b.numel()) * w.element_size()
    copies = max(1, min(256, -(-footprint // set_bytes)))
    out = []
    for i in range(copies):
        if i == 0:
            wi, ai, bi = w, a, b
        else:
            wi, ai, bi = w.clone(), a.clone(), kernels.lora_b_buffer(hidden, rows, device, dtype)
            bi.copy_(b)
        own = {
            s: (ai[0, o : o + rank].contiguous(), bi[:, o : o + rank].contiguous())
            for s, o in enumerate(_offsets(num_slots, rank)) if s
        }  # fmt: skip
        out.append(_Weights(wi, ai, bi, own))
    return out


def _offsets(num_slots: int, rank: int) -> list[int]:
    """First arena row of each slot: slot 0 (the base) none, slot s at (s-1)*rank."""
    return [0] + [(s - 1) * rank for s in range(1, num_slots)]


def run_shape(
    shape: Shape,
    copies: list[_Weights],
    args: argparse.Namespace,
    dtype: torch.dtype,
    device: torch.device,
    clock: Clock,
) -> Result:
    h, rank, max_rank = shape.hidden, args.rank, args.max_rank
    num_slots = 1 + copies[0].a.shape[1] // rank
    scalings = [0.0] + [0.5 + 0.01 * s for s in range(1, num_slots)]
    ranks, offsets = [0] + [rank] * (num_slots - 1), _offsets(num_slots, rank)
    seg = kernels.make_segment_info(
        list(shape.seg_lens), list(shape.slots), ranks, scalings, offsets, device
    )
    bounds = [0]
    for n in shape.seg_lens:
        bounds.append(bounds[-1] + n)
    tokens = bounds[-1]
    gen = torch.Generator(device="cpu").manual_seed(1)
    x = torch.randn(tokens, h, generator=gen).to(device, dtype)
    y = torch.zeros(tokens, h, dtype=dtype, device=device)

    def lora(ws: _Weights) -> None:
        inter = kernels.lora_shrink(x, ws.a, seg, max_rank)
        kernels.lora_expand(y, inter, ws.b, seg, [0, h])

    def loop(ws: _Weights) -> None:
        for g, s in enumerate(shape.slots):
            a_i, b_i = ws.own[s]
            lo, hi = bounds[g], bounds[g + 1]
            y[lo:hi] += x[lo:hi] @ a_i.T @ b_i.T * scalings[s]

    def base(ws: _Weights) -> None:
        F.linear(x, ws.w)

    _check_agree(lora, loop, copies[0], y, dtype)
    variants = {"lora": lora, "loop": loop, "base": base}
    for ws in copies[:2]:  # warm-up: plans, kernel compiles, allocator
        for fn in variants.values():
            fn(ws)
    times: dict[str, list[float]] = {k: [] for k in variants}
    deadline = time.perf_counter() + args.min_time * len(variants)
    rounds = 0
    order = list(variants)
    rnd = random.Random(args.seed)
    while rounds < 5 or (time.perf_counter() < deadline and rounds < 1000):
        ws = copies[rounds % len(copies)]
        rnd.shuffle(order)  # whoever runs right after the base GEMM finds caches cold
        for k in order:
            times[k].append(clock.time(lambda fn=variants[k], ws=ws: fn(ws)))
        rounds += 1
    med = {k: statistics.median(v) for k, v in times.items()}
    graph = _graph_times({"lora": lora, "base": base}, copies, args) if clock.cuda else {}

    elem = torch.empty((), dtype=dtype).element_size()
    used = len(set(shape.slots) - {0})
    lora_bytes = (used * 2 * rank * h + tokens * 3 * h) * elem + tokens * max_rank * 4 * 2
    base_bytes = (h * h + 2 * tokens * h) * elem
    return Result(
        name=shape.name,
        kind=shape.kind,
        layout=shape.layout,
        hidden=h,
        tokens=tokens,
        segments=len(shape.seg_lens),
        adapters=used,
        rank=rank,
        max_rank=max_rank,
        dtype=str(dtype).removeprefix("torch."),
        backend=kernels.backend_for(x),
        lora_ms=med["lora"] * 1e3,
        loop_ms=med["loop"] * 1e3,
        base_ms=med["base"] * 1e3,
        speedup_vs_loop=med["loop"] / med["lora"],
        lora_over_base_time=med["lora"] / med["base"],
        lora_over_base_bytes=lora_bytes / base_bytes,
        time_over_bytes=(med["lora"] / med["base"]) / (lora_bytes / base_bytes),
        lora_bytes=lora_bytes,
        base_bytes=base_bytes,
        lora_gbps=lora_bytes / med["lora"] / 1e9,
        loop_gbps=lora_bytes / med["loop"] / 1e9,
        base_gbps=base_bytes / med["base"] / 1e9,
        rounds=rounds,
        lora_graph_ms=graph["lora"] * 1e3 if graph else None,
        base_graph_ms=graph["base"] * 1e3 if graph else None,
        lora_over_base_graph_time=graph["lora"] / graph["base"] if graph else None,
    )


def _graph_times(
    variants: dict[str, Callable[[_Weights], None]], copies: list[_Weights], args
) -> dict[str, float]:
    """Median seconds per call of each variant, from CUDA graph replays: one graph per
    variant runs it once on each weight copy (up to 64), replays interleave."""
    copies = copies[:64]
    graphs = {}
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture: plans, allocator, compiles
        for fn in variants.values():
            for ws in copies:
                fn(ws)
    torch.cuda.current_stream().wait_stream(side)
    for k, fn in variants.items():
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for ws in copies:
                fn(ws)
        graphs[k] = g
    clock, times = Clock(torch.device("cuda")), {k: [] for k in variants}
    order, rnd = list(variants), random.Random(args.seed)
    deadline = time.perf_counter() + args.min_time * len(variants)
    rounds = 0
    while rounds < 5 or (time.perf_counter() < deadline and rounds < 1000):
        rnd.shuffle(order)
        for k in order:
            times[k].append(clock.time(graphs[k].replay) / len(copies))
        rounds += 1
    return {k: statistics.median(v) for k, v in times.items()}


def _check_agree(lora, loop, ws: _Weights, y: torch.Tensor, dtype: torch.dtype) -> None:
    """The fast path must compute what the loop computes before its time means anything."""
    y.zero_()
    lora(ws)
    fast = y.float().clone()
    y.zero_()
    loop(ws)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    if not torch.allclose(fast, y.float(), rtol=tol, atol=tol):
        raise AssertionError(f"lora and loop disagree: max |diff| {(fast - y.float()).abs().max()}")


def run(args: argparse.Namespace) -> int:
    device, dtype = device_and_dtype(args)
    args.max_rank = args.max_rank or args.rank
    if args.max_rank < args.rank:
        raise SystemExit(f"--max-rank {args.max_rank} < --rank {args.rank}")
    if args.quick:
        args.footprint_mib = min(args.footprint_mib, 256)
        args.min_time = min(args.min_time, 0.1)
    if args.backend == "auto":
        return _run(args, device, dtype)
    with kernels.forced_backend(args.backend):
        return _run(args, device, dtype)


def _run(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> int:
    clock = Clock(device)
    head = print_device(args, device, dtype, args.quick)
    print(f"buffers R={args.max_rank}")
    results = []
    by_hidden: dict[int, list[Shape]] = {}
    for s in shapes(args):
        by_hidden.setdefault(s.hidden, []).append(s)
    _print_header(clock.cuda)
    for h, group in by_hidden.items():
        copies = _weight_copies(
            h, args.rank, args.max_rank, dtype, device, args.footprint_mib << 20
        )
        for shape in group:
            res = run_shape(shape, copies, args, dtype, device, clock)
            _print_row(res, clock.cuda)
            results.append(res)
        del copies
    print(
        "vs loop = loop time / lora time; lora/base t = time ratio, B = bytes ratio; "
        "t/B = their quotient (1.0: LoRA moves its bytes as fast as the base projection)"
        + ("; graph: device time per call from CUDA graph replays" if clock.cuda else "")
    )
    checked = {r.name: harness.check("kernels", asdict(r)) for r in results if _checked(r)}
    for name, targets in checked.items():
        print(f"{name}: " + "; ".join(harness.verdict_lines(targets)))
    rows = [{**asdict(r), "targets": checked.get(r.name)} for r in results]
    harness.write_json(args.json, {**head, "shapes": rows})
    return 0


# (title, width, Result field, format) of each printed column
def _checked(r: Result) -> bool:
    """Whether `r` is a shape the [kernels] targets are set for: 32 decode tokens, each
    its own adapter in consecutive slots."""
    return r.kind == "decode" and r.tokens == 32 and r.layout == "dense"


_COLUMNS = (
    (("shape", 28, "name", "s"), ("backend", 7, "backend", "s"))
    + tuple((f"{v} ms", 9, f"{v}_ms", ".3f") for v in ("lora", "loop", "base"))
    + (("vs loop", 8, "speedup_vs_loop", ".2f"),
       ("lora/base t", 12, "lora_over_base_time", ".3f"),
       ("lora/base B", 12, "lora_over_base_bytes", ".3f"),
       ("t/B", 6, "time_over_bytes", ".2f"))
    + tuple((f"{v} GB/s", 10, f"{v}_gbps", ".1f") for v in ("lora", "loop", "base"))
)  # fmt: skip
_GRAPH_COLUMNS = (
    ("graph lora ms", 13, "lora_graph_ms", ".4f"),
    ("graph base ms", 13, "base_graph_ms", ".4f"),
    ("graph l/b t", 11, "lora_over_base_graph_time", ".3f"),
)


def _columns(cuda: bool) -> tuple:
    return _COLUMNS + _GRAPH_COLUMNS if cuda else _COLUMNS


def _print_header(cuda: bool) -> None:
    cols = _columns(cuda)
    print("  ".join(f"{t:>{w}}" if i else f"{t:<{w}}" for i, (t, w, _, _) in enumerate(cols)))


def _print_row(r: Result, cuda: bool) -> None:
    cells = []
    for i, (_, w, key, fmt) in enumerate(_columns(cuda)):
        text = format(getattr(r, key), fmt)
        cells.append(f"{text:>{w}}" if i else f"{text:<{w}}")
    print("  ".join(cells), flush=True)


if __name__ == "__main__":
    sys.exit(harness.main(sys.modules[__name__], sys.argv[1:]))
