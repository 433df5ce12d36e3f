"""Multi-LoRA kernels: the only public names, one dispatch point.

    seg = make_segment_info(seg_lens, seg_slots, slot_ranks, slot_scalings, slot_offsets, device)
    segs = make_segment_infos(seg_lens, seg_slots, {group: ranks}, scalings, {group: offsets},
                              device)
    inter = lora_shrink(x, a, seg, max_rank[, out])  # [T, num_slices*R] float32
    lora_expand(y, inter, b, seg, slice_offsets)     # y += LoRA delta, in place
    inter = lora_embedding_shrink(ids, a, seg, max_rank)  # an embedding LoRA's x·Aᵀ
    a = lora_a_buffer(num_slices, rows, in, device, dtype)  # an A arena, the fastest layout
    b = lora_b_buffer(out, rows, device, dtype)      # a B arena, the fastest layout
    o = paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens,
                               block_size, scale, sliding_window, soft_cap=cap,
                               num_splits=decode_splits(max_len, D, KVH),
                               sinks=sinks)  # [D, H, hd]
    o = prefill_attention(q, k, v, scale, slots, sliding_window, soft_cap,
                          sinks=sinks)  # [n, H, hd]
    plan = make_expert_plan(topk_ids, num_experts, seg)  # MoE pairs sorted by expert
    y = moe_grouped_gemm(x_sorted, w, plan)         # [P, N]: each row times its expert
    inter = expert_lora_shrink(x_sorted, a, plan, seg, max_rank)  # expert LoRA, grouped by
    expert_lora_expand(y, inter, b, plan, seg, slice_offsets)   # (adapter, expert)
    y = quant_linear(x, w, bias)          # [M, N]: x · dequantize(w)ᵀ, w packed (FP8, INT4,
    y = quant_moe_gemm(x_sorted, w, plan)  # MXFP4, NF4; kernels.quant_formats), experts too
    batch = make_state_batch(seq_lens, state_slots, has_initial_state, device)  # Gated
    y = causal_conv1d(x, weight, bias, conv_state, batch)        # DeltaNet: conv + SiLU,
    o = gated_delta_rule(q, k, v, g, beta, recurrent_state, batch)  # then the delta rule
    warm_up(run_batch, max_tokens, max_segments, max_context_len, block_size, windows)

Adapter weights live in arenas of rank rows, not in slots padded to one rank: per
projection an A arena [num_slices, P, in] and a B arena [out, P]. The adapter in slot s
owns rows [slot_offsets[s], slot_offsets[s] + slot_ranks[s]) of both (the same rows in
every layer's arenas of one projection group; each group's SegmentInfo carries its own
ranks and offsets), so a rank-8 adapter holds 8 rows where a rank-64 one holds 64.
The intermediate keeps a fixed [T, num_slices*R] layout, R = max_lora_rank: slice j of
a token's adapter lands in columns [j*R, j*R + rank).

Backends (decided once, below, rather than per op: a step issues a hundred ops): CUDA
tensors go to Triton (`kernels.sgmv_triton`, imported lazily on the first Triton op, so a
CPU-only install never needs triton), CPU tensors to the torch path (`kernels.sgmv_torch`).
LORAFLEET_KERNELS=triton|torch, read at import, or `force_backend` forces either; Triton
on CPU needs TRITON_INTERPRET=1 (the tests). The attention ops have the same two backends
(`kernels.attention_{torch,triton}`; on CUDA the prefill takes SDPA's flash kernel where
it applies and Triton for the rest). Every
op checks shapes, dtypes, devices and metadata sizes here, before any backend runs, and
none reads a device value for that (so offsets past the arena are the caller's bug, not
checked). `kernels.reference` and `kernels.attention_reference` are the slow
oracles they are tested against;
`lorafleet bench kernels` times the LoRA ops.

Gated DeltaNet (Qwen3.5/3.6's linear attention): `causal_conv1d` and `gated_delta_rule`
run over a StateBatch (sequences of a flattened batch and their rows of the per-sequence
conv and recurrent state pools, read and written in place); backends
`kernels.gated_delta_{torch,triton}`, oracle `kernels.gated_delta_reference`.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import math
import os
from collections.abc import Callable, Iterator, Sequence
from types import ModuleType
from typing import NamedTuple

import torch

from kernels.gated_delta_batch import StateBatch, make_state_batch
from kernels.lora_embedding import lora_embedding_shrink as _embedding_shrink
from kernels.moe_plan import ExpertPlan, expert_segments, make_expert_plan
from kernels.quant_formats import (
    AwqInt4,
    Fp8Weight,
    GptqInt4,
    Mxfp4Weight,
    Nf4Weight,
    PackQuantizedInt4,
    QuantizedWeight,
    dequantize,
    stack_experts,
)
from kernels.segments import (
    SMALL_TILE_TOKENS,
    SegmentInfo,
    make_segment_info,
    make_segment_infos,
)

__all__ = [
    "SegmentInfo",
    "make_segment_info",
    "make_segment_infos",
    "lora_shrink",
    "lora_expand",
    "lora_embedding_shrink",
    "backend_for",
    "force_backend",
    "forced_backend",
    "lora_a_buffer",
    "lora_b_buffer",
    "paged_decode_attention",
    "decode_splits",
    "prefill_attention",
    "ExpertPlan",
    "make_expert_plan",
    "expert_segments",
    "moe_grouped_gemm",
    "expert_lora_shrink",
    "expert_lora_expand",
    "Fp8Weight",
    "PackQuantizedInt4",
    "GptqInt4",
    "AwqInt4",
    "Mxfp4Weight",
    "Nf4Weight",
    "QuantizedWeight",
    "dequantize",
    "stack_experts",
    "quant_linear",
    "quant_moe_gemm",
    "StateBatch",
    "make_state_batch",
    "causal_conv1d",
    "gated_delta_rule",
    "WarmBatch",
    "warm_up",
    "warm_up_batches",
]


# -- backends ---------------------------------------------------------------------------------

ENV = "LORAFLEET_KERNELS"
BACKENDS = ("triton", "torch")


def parse_forced(value: str | None) -> str | None:
    """The backend LORAFLEET_KERNELS names, None when unset or empty."""
    forced = (value or "").strip().lower()
    if forced and forced not in BACKENDS:
        raise ValueError(f"{ENV}={forced!r}: expected 'triton' or 'torch'")
    return forced or None


_forced: str | None = parse_forced(os.environ.get(ENV))
_modules: dict[tuple[str, str], ModuleType] = {}


def force_backend(name: str | None) -> None:
    """Run every op on `name` ('triton' or 'torch'), or by device again with None."""
    global _forced
    _forced = parse_forced(name)


@contextlib.contextmanager
def forced_backend(name: str | None) -> Iterator[None]:
    """force_backend for the duration of a block, then what was forced before."""
    before = _forced
    force_backend(name)
    try:
        yield
    finally:
        force_backend(before)


def backend_for(x: torch.Tensor) -> str:
    """Which implementation runs for tensors on x's device."""
    return _forced or ("triton" if x.is_cuda else "torch")


def implementation(x: torch.Tensor, family: str) -> ModuleType:
    """The module implementing op `family` for x's device: `kernels.<family>_<backend>`,
    imported once (e.g. family 'sgmv': kernels.sgmv_triton or kernels.sgmv_torch)."""
    key = (family, backend_for(x))
    module = _modules.get(key)
    if module is None:
        module = _modules[key] = importlib.import_module(f"kernels.{family}_{key[1]}")
    return module


_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class WarmBatch(NamedTuple):
    """One step of a start-up warm-up (kernels.warm_up_batches): `decodes` one-token
    sequences at context 1 whose block tables are `table_width` blocks wide and whose
    attention is split `decode_splits` ways, then prefill segments of (new tokens,
    context) each: a whole prompt when they are equal, else its last tokens."""

    decodes: int
    prefills: tuple[tuple[int, int], ...] = ()
    table_width: int = 1
    decode_splits: int = 1


def warm_up_batches(
    max_tokens: int,
    max_segments: int,
    max_context_len: int,
    block_size: int,
    windows: Sequence[int] = (),
) -> list[WarmBatch]:
    """The steps (at most `max_tokens` tokens in `max_segments` sequences, contexts up to
    `max_context_len`, the model's sliding `windows`) that between them launch every
    specialisation the Triton kernels compile for a step's sizes, so that running each
    once at start leaves nothing to compile while serving.

    A launch compiles for its constexprs, its options and Triton's specialisation of
    every other argument (an int equal to 1 or divisible by 16, a pointer 16-byte
    aligned). What a step's sizes change: the LoRA kernels' tiles, by the longest segment
    (1 token: BGMV; up to SMALL_TILE_TOKENS: 16-row tiles; longer: 64-row tiles); the MoE
    GEMM's, by the step's tokens (up to SMALL_TILE_TOKENS or more); the decode attention's
    block table row stride (1, a multiple of 16, other) and split count (the merge's
    power-of-two tile, the count itself divisible by 16 or not); the prefill attention's
    new tokens and context (1, a multiple of 16, other; read from the cache or not), its
    window (a layer's, once the context is past it, else none). Everything else is fixed
    by the model and the engine: shapes and strides, metadata and workspace addresses
    (the LoRA kernels take them unspecialised; the engine packs metadata 16-byte
    aligned), scales and caps."""
    small = SMALL_TILE_TOKENS
    batches = [
        WarmBatch(small + 1),  # one-token segments, many tokens (few: below)
        WarmBatch(0, ((2, 2),)),  # short segments, few tokens
        WarmBatch(0, ((small, small), (2, 2))),  # short segments, many tokens
        WarmBatch(0, ((small + 1, small + 1),)),  # long segments
    ]
    max_width = -(-max_context_len // block_size)
    widths = [w for w in (1, 2, small) if w <= max_width]
    # an eager step's split count follows its table's width (decode_splits), up to
    longest = min(-(-max_width * block_size // _MIN_SPLIT_LEN), _MAX_SPLITS)
    splits = (1, 2, 3, 4, 5, 8, 9, 16, 17, 32)  # every merge tile (2..32), odd and even
    batches += [WarmBatch(1, (), w, s) for w in widths for s in splits if s <= longest]
    for window in (None, *windows):
        past = 0 if window is None else -(-(window + 1) // small) * small  # 16 | past
        contexts = (2 * small, 2 * small + 1) if window is None else (past, past + 1)
        for n in (1, small, small + 1):
            for ctx in (*contexts, *((n,) if window is None else ())):
                if n <= ctx:
                    batches.append(WarmBatch(0, ((n, ctx),)))
        if window is not None:  # whole prompts past the window
            batches += [WarmBatch(0, ((c, c),)) for c in contexts]
    return [
        b
        for b in batches
        if b.decodes + sum(n for n, _ in b.prefills) <= max_tokens
        and b.decodes + len(b.prefills) <= max_segments
        and all(ctx <= max_context_len for _, ctx in b.prefills)
    ]


def warm_up(
    run_batch: Callable[[WarmBatch], None],
    max_tokens: int,
    max_segments: int,
    max_context_len: int,
    block_size: int,
    windows: Sequence[int] = (),
) -> list[WarmBatch]:
    """Run `run_batch` (a forward of the step a WarmBatch describes, with LoRA on every
    projection) on each of warm_up_batches(...); returns them. Called once at start on
    CUDA, so the first request of a new shape does not stall the serving loop on a Triton
    compile."""
    batches = warm_up_batches(max_tokens, max_segments, max_context_len, block_size, windows)
    for batch in batches:
        run_batch(batch)
    return batches


def lora_a_buffer(
    num_slices: int, rows: int, in_features: int, device: torch.device, dtype: torch.dtype
) -> torch.Tensor:  # [num_slices, rows, in_features], zeros
    """A zeroed A arena in the memory layout the device's backend reads fastest (every
    backend accepts any layout with unit stride along `in`). Triton gets each slice's rows
    contiguous. The torch path gets rank rows first ([rows, num_slices, in] in memory, seen
    permuted): an adapter's rows of every slice are then one [r * num_slices, in] block,
    so a run's shrink is one matmul for all slices instead of one per slice."""
    if backend_for(torch.empty(0, device=device)) == "triton":
        return torch.zeros(num_slices, rows, in_features, device=device, dtype=dtype)
    rank_major = torch.zeros(rows, num_slices, in_features, device=device, dtype=dtype)
    return rank_major.permute(1, 0, 2)


def lora_b_buffer(
    out_features: int, rows: int, device: torch.device, dtype: torch.dtype
) -> torch.Tensor:  # [out_features, rows], zeros
    """A zeroed B arena in the memory layout the device's backend reads fastest (every
    backend accepts any layout). Triton's kernels are tuned for rows contiguous along
    the rank axis. The torch path gets it rank-major ([rows, out] in memory, seen
    transposed): an adapter's r rank rows are then r whole rows of memory, so the
    expand's matmul streams rows instead of r-of-R floats out of each, and a load writes
    rows too (the figures: docs/performance.md)."""
    if backend_for(torch.empty(0, device=device)) == "triton":
        return torch.zeros(out_features, rows, device=device, dtype=dtype)
    return torch.zeros(rows, out_features, device=device, dtype=dtype).t()


def lora_shrink(
    x: torch.Tensor,  # [T, in]
    a: torch.Tensor,  # [num_slices, P, in]: the A arena
    seg: SegmentInfo,
    max_rank: int,  # R: the intermediate's columns per slice
    out: torch.Tensor | None = None,  # [T, num_slices*R] float32 zeros, filled in place
) -> torch.Tensor:  # [T, num_slices*R] float32 (`out` when given)
    """Semantics, per segment g with slot s = seg_slots[g] != 0, r = slot_ranks[s] <= R,
    o = slot_offsets[s]:

        out[rows_g, j*R : j*R+r] = x[rows_g].float() @ a[j, o : o+r].float()ᵀ

    for each slice j, zero everywhere else (slot 0, past the rank). fp32/fp16/bf16
    inputs, fp32 accumulation and output. Arena rows outside the batch's adapters are
    never read into a result. `out`, when given, must hold zeros (a region of the step's
    zeroed workspace: no allocation or zero fill per op); it may be a view with any row
    stride. See kernels.reference.lora_shrink_reference.
    """
    _check_shrink(x, a, seg, max_rank, out)
    return implementation(x, "sgmv").lora_shrink(x, a, seg, max_rank, out)


def lora_expand(
    y: torch.Tensor,  # [T, out_total], updated in place
    inter: torch.Tensor,  # [T, num_slices*R] float32, from lora_shrink
    b: torch.Tensor,  # [out_total, P]: the B arena, any strides (lora_b_buffer allocates
    # the backend's fastest)
    seg: SegmentInfo,
    slice_offsets: list[int],  # host ints, [num_slices+1], non-decreasing
) -> torch.Tensor:  # y
    """Semantics, per segment g with slot s != 0, r = slot_ranks[s], o = slot_offsets[s],
    R = inter's columns / num_slices, per slice j with columns cols_j =
    slice_offsets[j] : slice_offsets[j+1]:

        y[rows_g, cols_j] += slot_scalings[s] * inter[rows_g, j*R : j*R+r] @ b[cols_j, o : o+r]ᵀ

    accumulated in fp32 and rounded once into y.dtype; rows of slot-0 segments are
    left bit-identical. See kernels.reference.lora_expand_reference.
    """
    _check_expand(y, inter, b, seg, slice_offsets)
    return implementation(y, "sgmv").lora_expand(y, inter, b, seg, slice_offsets)


def lora_embedding_shrink(
    ids: torch.Tensor,  # [T] int64 token ids
    a: torch.Tensor,  # [1, P, vocab]: the embedding A arena (lora_a_buffer(1, P, vocab))
    seg: SegmentInfo,
    max_rank: int,  # R: the intermediate's columns
) -> torch.Tensor:  # [T, R] float32
    """Semantics, per segment g with slot s = seg_slots[g] != 0, r = slot_ranks[s] <= R,
    o = slot_offsets[s]:

        out[rows_g, :r] = a[0, o : o+r, ids[rows_g]]ᵀ   (float32)

    zero everywhere else: x·Aᵀ for one-hot x, PEFT's embedding LoRA before its B (then
    lora_expand adds scaling·inter·Bᵀ). One torch implementation on every device (a gather;
    host values only decide shapes, so it replays as a CUDA graph). See
    kernels.reference.lora_embedding_shrink_reference.
    """
    if ids.dim() != 1 or ids.dtype != torch.int64 or a.dim() != 3 or a.shape[0] != 1:
        raise ValueError(
            f"lora_embedding_shrink: ids {tuple(ids.shape)} {ids.dtype} must be [T] int64, "
            f"a {tuple(a.shape)} [1, P, vocab]"
        )
    if not isinstance(max_rank, int) or max_rank < 1 or a.device != ids.device:
        raise ValueError(
            f"lora_embedding_shrink: max_rank {max_rank!r} must be >= 1, ids on {ids.device} "
            f"and a on {a.device} on one device"
        )
    _check_seg(seg, ids.device)
    return _embedding_shrink(ids, a, seg, max_rank)


_SEG_DTYPES = (torch.int32, torch.int32, torch.int32, torch.float32, torch.int32)


@functools.lru_cache(maxsize=16)
def _check_seg(seg: SegmentInfo, device: torch.device) -> None:
    # Memoized per SegmentInfo object (hashed by its tensors' identity): every
    # projection of a step checks the same one, and dtypes/shapes can't change.
    tensors = (seg.seg_indptr, seg.seg_slots, seg.slot_ranks, seg.slot_scalings, seg.slot_offsets)
    if tuple(t.dtype for t in tensors) != _SEG_DTYPES or any(t.device != device for t in tensors):
        raise ValueError(
            "SegmentInfo: seg_indptr, seg_slots, slot_ranks, slot_offsets must be int32 and "
            f"slot_scalings float32, all on {device}; got "
            f"{[(t.dtype, str(t.device)) for t in tensors]}"
        )
    g = seg.seg_slots.shape[0] if seg.seg_slots.dim() == 1 else -1
    if seg.seg_indptr.shape != (g + 1,):
        shapes = f"{tuple(seg.seg_indptr.shape)}, seg_slots {tuple(seg.seg_slots.shape)}"
        raise ValueError(f"seg_indptr must be [G+1] for seg_slots [G]: seg_indptr {shapes}")
    per_slot = (seg.slot_ranks, seg.slot_scalings, seg.slot_offsets)
    if seg.slot_ranks.dim() != 1 or any(t.shape != seg.slot_ranks.shape for t in per_slot):
        raise ValueError(
            f"slot_ranks {tuple(seg.slot_ranks.shape)} / slot_scalings "
            f"{tuple(seg.slot_scalings.shape)} / slot_offsets {tuple(seg.slot_offsets.shape)}: "
            "expected one [S] shape (one entry per slot)"
        )


def _check_shrink(
    x: torch.Tensor,
    a: torch.Tensor,
    seg: SegmentInfo,
    max_rank: int,
    out: torch.Tensor | None = None,
) -> None:
    if x.dim() != 2 or a.dim() != 3 or a.shape[2] != x.shape[1]:
        raise ValueError(
            f"lora_shrink: x {tuple(x.shape)} must be [T, in], a {tuple(a.shape)} "
            "[num_slices, P, in]"
        )
    if not isinstance(max_rank, int) or max_rank < 1 or a.shape[0] < 1:
        raise ValueError(f"lora_shrink: max_rank {max_rank!r} and a's slices must be >= 1")
    if x.dtype not in _DTYPES or a.dtype != x.dtype:
        raise ValueError(f"lora_shrink: x {x.dtype} and a {a.dtype} must share one of {_DTYPES}")
    if a.device != x.device:
        raise ValueError(f"lora_shrink: x on {x.device}, a on {a.device}")
    want = (x.shape[0], a.shape[0] * max_rank)
    if out is not None and (
        out.shape != want or out.dtype != torch.float32 or out.device != x.device
        or out.stride(-1) != 1
    ):  # fmt: skip
        raise ValueError(
            f"lora_shrink: out {tuple(out.shape)} {out.dtype} on {out.device} must be "
            f"{list(want)} float32 on {x.device}, unit stride along a row"
        )
    _check_seg(seg, x.device)


def _check_expand(
    y: torch.Tensor,
    inter: torch.Tensor,
    b: torch.Tensor,
    seg: SegmentInfo,
    slice_offsets: list[int],
) -> None:
    if y.dim() != 2 or inter.dim() != 2 or b.dim() != 2:
        raise ValueError(
            f"lora_expand: y {tuple(y.shape)} [T, out], inter {tuple(inter.shape)} [T, ns*R], "
            f"b {tuple(b.shape)} [out, P]"
        )
    num_slices = len(slice_offsets) - 1
    if (
        num_slices < 1 or inter.shape[0] != y.shape[0] or inter.shape[1] % num_slices
        or inter.shape[1] == 0 or b.shape[0] != y.shape[1]
    ):  # fmt: skip
        raise ValueError(
            f"lora_expand: inter {tuple(inter.shape)} must be [{y.shape[0]}, {num_slices}*R] "
            f"and b {tuple(b.shape)} [{y.shape[1]}, P]"
        )
    offsets_ok = all(0 <= c0 <= c1 for c0, c1 in zip(slice_offsets, slice_offsets[1:]))
    if not offsets_ok or slice_offsets[-1] > y.shape[1]:
        raise ValueError(
            f"lora_expand: slice_offsets {slice_offsets} must rise within [0, {y.shape[1]}]"
        )
    if y.dtype not in _DTYPES or b.dtype != y.dtype or inter.dtype != torch.float32:
        raise ValueError(
            f"lora_expand: y {y.dtype} / b {b.dtype} must match, inter {inter.dtype} fp32"
        )
    if not (y.device == inter.device == b.device):
        raise ValueError(f"lora_expand: y on {y.device}, inter on {inter.device}, b on {b.device}")
    _check_seg(seg, y.device)


def moe_grouped_gemm(
    x: torch.Tensor,  # [P, K]: the plan's pairs' inputs in sorted order
    w: torch.Tensor,  # [E, N, K]: stacked expert weights, unit stride along K
    plan: ExpertPlan,
) -> torch.Tensor:  # [P, N], x.dtype
    """Semantics, for each expert e and sorted row i in
    [plan.expert_indptr[e], plan.expert_indptr[e+1]):

        out[i] = x[i].float() @ w[e].float()ᵀ   rounded once into x.dtype

    The rows arrive sorted by expert (make_expert_plan), so each expert's weights are read
    once for all its rows (a grouped GEMM: vLLM's fused_moe groups the same way). Experts
    with no rows are never read. No backend reads a device value for graph-safe plans
    (the Triton grid is sized from host ints: E, plan.max_rows, N). Expert LoRA rides on
    the same sort: `expert_segments` turns the plan into a SegmentInfo over (adapter,
    expert) groups for lora_shrink / lora_expand on expert arenas. See
    kernels.moe_reference.moe_grouped_gemm_reference.
    """
    if x.dim() != 2 or w.dim() != 3 or w.shape[2] != x.shape[1]:
        raise ValueError(
            f"moe_grouped_gemm: x {tuple(x.shape)} must be [P, K], w {tuple(w.shape)} [E, N, K]"
        )
    if x.shape[0] != plan.num_pairs or w.shape[0] != plan.num_experts:
        raise ValueError(
            f"moe_grouped_gemm: x has {x.shape[0]} rows and w {w.shape[0]} experts; the plan "
            f"{plan.num_pairs} pairs of {plan.num_experts} experts"
        )
    if x.dtype not in _DTYPES or w.dtype != x.dtype or w.device != x.device:
        raise ValueError(
            f"moe_grouped_gemm: x {x.dtype} on {x.device} and w {w.dtype} on {w.device} must "
            f"share one of {_DTYPES} and a device"
        )
    if x.stride(1) != 1 or w.stride(2) != 1:
        raise ValueError("moe_grouped_gemm: x and w need unit stride along K")
    return implementation(x, "moe").moe_grouped_gemm(x, w, plan)


def expert_lora_shrink(
    x: torch.Tensor,  # [P, in]: the plan's pairs' inputs in sorted order
    a: torch.Tensor,  # [num_slices, E * rows, in]: an expert A arena (lora_a_buffer)
    plan: ExpertPlan,
    seg: SegmentInfo,  # the step's segments (one per sequence) and slot table
    max_rank: int,  # R: the intermediate's columns per slice
) -> torch.Tensor:  # [P, num_slices*R] float32
    """Semantics, per sorted pair i with token t = plan.tokens[i] in segment g, slot
    s = seg_slots[g] != 0, expert e = plan.experts[i], r = slot_ranks[s],
    o = slot_offsets[s] + e * rows (rows = a.shape[1] / E: each expert's block):

        out[i, j*R : j*R+r] = x[i].float() @ a[j, o : o+r].float()ᵀ

    zero elsewhere: lora_shrink with each adapter's expert e held at its slot's rows of
    expert block e. Pairs run grouped by (adapter, expert) (kernels.expert_segments);
    arena rows outside those groups' rank rows are never read into a result. See
    kernels.moe_reference.expert_lora_reference.
    """
    _check_expert_lora(x, a.shape[1], plan, seg, "expert_lora_shrink")
    _check_shrink(x, a, seg, max_rank)
    return implementation(x, "moe").expert_lora_shrink(x, a, plan, seg, max_rank)


def expert_lora_expand(
    y: torch.Tensor,  # [P, out_total], updated in place
    inter: torch.Tensor,  # [P, num_slices*R] float32, from expert_lora_shrink
    b: torch.Tensor,  # [out_total, E * rows]: an expert B arena (lora_b_buffer)
    plan: ExpertPlan,
    seg: SegmentInfo,
    slice_offsets: list[int],  # host ints, [num_slices+1]
) -> torch.Tensor:  # y
    """Semantics, per sorted pair i (s, e, r, o as in expert_lora_shrink), per slice j
    with columns cols_j = slice_offsets[j] : slice_offsets[j+1]:

        y[i, cols_j] += slot_scalings[s] * inter[i, j*R : j*R+r] @ b[cols_j, o : o+r]ᵀ

    accumulated in fp32 and rounded once into y.dtype; base (slot 0) rows left
    bit-identical. See kernels.moe_reference.expert_lora_reference.
    """
    _check_expert_lora(y, b.shape[1], plan, seg, "expert_lora_expand")
    _check_expand(y, inter, b, seg, slice_offsets)
    return implementation(y, "moe").expert_lora_expand(y, inter, b, plan, seg, slice_offsets)


def _check_expert_lora(
    x: torch.Tensor, arena_rows: int, plan: ExpertPlan, seg: SegmentInfo, name: str
) -> None:
    if x.dim() != 2 or x.shape[0] != plan.num_pairs or arena_rows % plan.num_experts:
        raise ValueError(
            f"{name}: {tuple(x.shape)} must have the plan's {plan.num_pairs} rows and the "
            f"arena's {arena_rows} rows a block per each of {plan.num_experts} experts"
        )
    if seg.num_segments != plan.num_segments:
        raise ValueError(
            f"{name}: the plan was built over {plan.num_segments} segments, seg has "
            f"{seg.num_segments}"
        )


def paged_decode_attention(
    q: torch.Tensor,  # [D, H, hd]: one query per decode sequence (its newest token)
    k_cache: torch.Tensor,  # [KVH, num_blocks * block_size, hd], head-major;
    # token slot = block * block_size + offset
    v_cache: torch.Tensor,  # same shape and dtype as k_cache
    block_tables: torch.Tensor,  # [D, W] int32: each sequence's block ids, in order
    context_lens: torch.Tensor,  # [D] int32, 1 <= ctx <= W * block_size
    block_size: int,  # host int
    scale: float,  # host float: softmax scale
    sliding_window: int | None = None,  # attend only to positions >= ctx - sliding_window
    soft_cap: float | None = None,  # host float > 0: Gemma 2's attention-logit soft cap
    out: torch.Tensor | None = None,  # [D, H, hd] q.dtype, written in place and returned
    num_splits: int | None = None,  # host int >= 1: programs sharing each sequence's context
    sinks: torch.Tensor | None = None,  # [H] float32: each head's sink logit (gpt-oss)
) -> torch.Tensor:  # [D, H, hd], q.dtype
    """Decode attention straight from the paged KV cache. Per sequence i with
    ctx = context_lens[i] (tokens in cache, the newest included: it is already written),
    for each query head h with kv head k = h // (H // KVH), over positions p in [lo, ctx):

        s[p] = scale * q[i, h] · K[k, p]
        s[p] = soft_cap * tanh(s[p] / soft_cap)      (only when soft_cap is not None)
        out[i, h] = softmax(s) @ V[k, p]

    (with sinks, softmax over [s, sinks[h]] with the sink's probability dropped: gpt-oss's
    attention sinks, which let a head attend to nothing)
    where lo = max(0, ctx - sliding_window) (0 without a window) and position p lives in
    cache slot block_tables[i, p // block_size] * block_size + p % block_size. The cap is
    Gemma 2's attention-logit soft-capping: every scaled score is squashed to at most
    soft_cap in magnitude before the softmax (and its running max) sees it; soft_cap=None
    leaves the scores uncapped (the same code path, bit for bit, as before the option).
    Scores, cap, softmax and accumulation in fp32, rounded once into q.dtype (fp32, fp16
    or bf16; the caches share it). Entries of block_tables past a sequence's
    ceil(ctx / block_size) blocks may be any valid block id: no slot outside [lo, ctx) is
    read, so whatever those slots hold (NaN included) never reaches an output. D may be 0.
    Grids and code paths depend on host values only (shapes, block_size, scale,
    sliding_window, soft_cap, num_splits): nothing here or in a backend reads a device
    value, so a call never syncs and replays as a CUDA graph.

    num_splits (flash-decoding, Triton only; the torch path is one vectorized pass): each
    sequence's attended tiles are dealt out to num_splits programs, whose partial softmaxes
    are merged by their log-sum-exp, so a long context at a small batch is read by many
    programs at once instead of D * KVH. The same output for every value (to fp32
    rounding). A captured graph keeps its grid, so pass a value fixed for the engine's
    lifetime: decode_splits(max_model_len, D, KVH). None: decode_splits over the table's
    width (W * block_size, a shape: the same for every step of one static batch).
    See kernels.attention_reference.paged_decode_attention_reference.
    """
    _check_paged_attention(
        q, k_cache, v_cache, block_tables, context_lens, block_size, sliding_window, soft_cap,
        out,
    )  # fmt: skip
    _check_sinks("paged_decode_attention", q, sinks)
    if num_splits is None:
        num_splits = decode_splits(block_tables.shape[1] * block_size, q.shape[0], k_cache.shape[0])
    elif not isinstance(num_splits, int) or isinstance(num_splits, bool) or num_splits < 1:
        raise ValueError(f"paged_decode_attention: num_splits {num_splits!r} must be an int >= 1")
    return implementation(q, "attention").paged_decode_attention(
        q, k_cache, v_cache, block_tables, context_lens, block_size, scale,
        sliding_window=sliding_window, soft_cap=soft_cap, out=out, num_splits=num_splits,
        sinks=sinks,
    )  # fmt: skip


# flash-decoding's split count: programs to aim for per SM, the shortest share of a
# context worth a program of its own, and the most splits
_PROGRAMS_PER_SM = 2
_MIN_SPLIT_LEN = 256
_MAX_SPLITS = 32


def decode_splits(
    max_context_len: int,  # the longest context a call may see (max_model_len)
    num_seqs: int,  # D: sequences in the call (a static batch's bucket)
    num_kv_heads: int,  # KVH on this rank
    num_sms: int | None = None,  # the device's SMs; None: the current CUDA device's, else 0
) -> int:  # >= 1
    """How many programs share each sequence's context in paged_decode_attention: enough
    for D * KVH * splits to reach _PROGRAMS_PER_SM per SM, but none sharing fewer than
    _MIN_SPLIT_LEN positions of max_context_len, and at most _MAX_SPLITS. Host ints only,
    so a graph captured with it replays with the same grid. 1 when the batch alone fills
    the device, or off CUDA (no SMs to fill)."""
    if num_sms is None:
        num_sms = _cuda_sm_count()
    want = -(-_PROGRAMS_PER_SM * num_sms // max(1, num_seqs * num_kv_heads))
    longest = -(-max(1, max_context_len) // _MIN_SPLIT_LEN)
    return max(1, min(want, longest, _MAX_SPLITS))


@functools.lru_cache(maxsize=1)
def _cuda_sm_count() -> int:
    if not torch.cuda.is_available():
        return 0
    return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count


def prefill_attention(
    q: torch.Tensor,  # [n, H, hd]: the queries of the last n of ctx positions
    k: torch.Tensor,  # [KVH, S, hd]: keys, position p's at k[:, p] or k[:, slots[p]];
    # the fresh K/V of a whole prompt ([T, KVH, hd] rows seen transposed) or the paged cache
    v: torch.Tensor,  # [KVH, S, hd], like k
    scale: float,  # host float: softmax scale
    slots: torch.Tensor | None = None,  # [ctx] int64: cache slot of each position; None:
    # position p is k[:, p] and ctx = S
    sliding_window: int | None = None,  # a row at t sees positions > t - sliding_window
    soft_cap: float | None = None,  # host float > 0: Gemma 2's attention-logit soft cap
    out: torch.Tensor | None = None,  # [n, H, hd] q.dtype (may be rows of a larger
    # batch's output), written in place and returned
    sinks: torch.Tensor | None = None,  # [H] float32: each head's sink logit (gpt-oss)
) -> torch.Tensor:  # [n, H, hd], q.dtype
    """Causal attention of a prefill (a whole prompt, a chunk after earlier ones, or the
    uncached rest of a prompt after a prefix-cache hit): query row i sits at position
    t = ctx - n + i and, for each head h with kv head k = h // (H // KVH), attends to
    positions p in [lo, t], lo = max(0, t - sliding_window + 1) (0 without a window):

        s[p] = scale * q[i, h] · K[k, p]
        s[p] = soft_cap * tanh(s[p] / soft_cap)      (only when soft_cap is not None)
        out[i, h] = softmax(s) @ V[k, p]

    (with sinks, softmax over [s, sinks[h]] with the sink's probability dropped.)
    Scores, cap, softmax and accumulation in fp32, rounded into q.dtype (with half
    inputs a fused kernel may round its partial results too: within the half dtype's
    tolerance of the reference, which rounds once). Lower-right causal
    when ctx > n: every row sees the whole earlier context. Every path is fused or
    chunked: none holds [H, n, ctx] scores at once (SDPA's MATH fallback would, in fp32).
    Slots outside the positions a row sees are never read. The positions' K/V must
    already be in k/v (the step's K/V written into the cache first). Host values pick
    the path; no device value is read.
    See kernels.attention_reference.prefill_attention_reference.
    """
    _check_prefill_attention(q, k, v, slots, sliding_window, soft_cap, out)
    _check_sinks("prefill_attention", q, sinks)
    return implementation(q, "attention").prefill_attention(
        q, k, v, scale, slots, sliding_window=sliding_window, soft_cap=soft_cap, out=out,
        sinks=sinks,
    )  # fmt: skip


def _check_sinks(name: str, q: torch.Tensor, sinks: torch.Tensor | None) -> None:
    if sinks is None:
        return
    if sinks.shape != (q.shape[1],) or sinks.dtype != torch.float32 or sinks.device != q.device:
        raise ValueError(
            f"{name}: sinks {tuple(sinks.shape)} {sinks.dtype} on {sinks.device} must be "
            f"[{q.shape[1]}] float32 on {q.device} (one logit per query head)"
        )


def _check_prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slots: torch.Tensor | None,
    sliding_window: int | None,
    soft_cap: float | None,
    out: torch.Tensor | None,
) -> None:
    name = "prefill_attention"
    _check_qkv(name, q, ("k", k), ("v", v), "n", "S")
    n = q.shape[0]
    if slots is not None and (slots.dim() != 1 or slots.dtype != torch.int64):
        raise ValueError(f"{name}: slots {tuple(slots.shape)} {slots.dtype} must be [ctx] int64")
    ctx = k.shape[1] if slots is None else slots.shape[0]
    if ctx < n:
        raise ValueError(f"{name}: {n} queries but only {ctx} positions (slots or k's S)")
    _check_window_and_cap(name, sliding_window, soft_cap)
    if out is not None and (out.shape != q.shape or out.dtype != q.dtype):
        raise ValueError(
            f"{name}: out {tuple(out.shape)} {out.dtype} must be {tuple(q.shape)} {q.dtype}"
        )
    tensors = (q, k, v) + tuple(t for t in (slots, out) if t is not None)
    if any(t.device != q.device for t in tensors):
        raise ValueError(
            f"{name}: q, k, v, slots, out must share one device; got "
            f"{[str(t.device) for t in tensors]}"
        )


def _check_qkv(
    name: str,
    q: torch.Tensor,
    named_k: tuple[str, torch.Tensor],
    named_v: tuple[str, torch.Tensor],
    rows: str,
    positions: str,
) -> None:
    """Raise unless q is [rows, H, hd] and k, v one [KVH, positions, hd] shape with
    H % KVH == 0, all three of one supported dtype (the attention kernels' shared terms)."""
    (kn, k), (vn, v) = named_k, named_v
    if q.dim() != 3 or k.dim() != 3 or v.shape != k.shape:
        raise ValueError(
            f"{name}: q {tuple(q.shape)} must be [{rows}, H, hd], {kn} {tuple(k.shape)} and "
            f"{vn} {tuple(v.shape)} one [KVH, {positions}, hd] shape"
        )
    h, hd = q.shape[1:]
    kvh = k.shape[0]
    if k.shape[2] != hd or kvh == 0 or h % kvh:
        raise ValueError(
            f"{name}: q {tuple(q.shape)} [{rows}, H, hd] needs {kn} [KVH, {positions}, {hd}] "
            f"with H % KVH == 0; got {kn} {tuple(k.shape)}"
        )
    if q.dtype not in _DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(
            f"{name}: q {q.dtype}, {kn} {k.dtype}, {vn} {v.dtype} must share one of {_DTYPES}"
        )


def _check_window_and_cap(name: str, sliding_window: int | None, soft_cap: float | None) -> None:
    if sliding_window is not None and (not isinstance(sliding_window, int) or sliding_window < 1):
        raise ValueError(f"{name}: sliding_window {sliding_window!r} must be None or an int >= 1")
    if soft_cap is not None and (
        not isinstance(soft_cap, (int, float)) or isinstance(soft_cap, bool)
        or not math.isfinite(soft_cap) or soft_cap <= 0
    ):  # fmt: skip
        raise ValueError(f"{name}: soft_cap {soft_cap!r} must be None or a finite float > 0")


def _check_paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    block_size: int,
    sliding_window: int | None,
    soft_cap: float | None,
    out: torch.Tensor | None,
) -> None:
    name = "paged_decode_attention"
    _check_qkv(name, q, ("k_cache", k_cache), ("v_cache", v_cache), "D", "slots")
    d = q.shape[0]
    if not isinstance(block_size, int) or block_size <= 0 or k_cache.shape[1] % block_size:
        raise ValueError(
            f"{name}: block_size {block_size!r} must be a positive int dividing the cache's "
            f"{k_cache.shape[1]} slots"
        )
    _check_window_and_cap(name, sliding_window, soft_cap)
    if block_tables.dim() != 2 or block_tables.shape[0] != d or context_lens.shape != (d,):
        raise ValueError(
            f"{name}: block_tables {tuple(block_tables.shape)} must be [{d}, W] and "
            f"context_lens {tuple(context_lens.shape)} [{d}]"
        )
    if d and block_tables.shape[1] == 0:
        raise ValueError(f"{name}: block_tables {tuple(block_tables.shape)} has no block column")
    if block_tables.dtype != torch.int32 or context_lens.dtype != torch.int32:
        raise ValueError(
            f"{name}: block_tables {block_tables.dtype} and context_lens {context_lens.dtype} "
            "must be int32"
        )
    if out is not None and (out.shape != q.shape or out.dtype != q.dtype):
        raise ValueError(
            f"{name}: out {tuple(out.shape)} {out.dtype} must be {tuple(q.shape)} {q.dtype}"
        )
    tensors = (q, k_cache, v_cache, block_tables, context_lens) + (() if out is None else (out,))
    if any(t.device != q.device for t in tensors):
        raise ValueError(
            f"{name}: q, k_cache, v_cache, block_tables, context_lens, out must share one device; "
            f"got {[str(t.device) for t in tensors]}"
        )


def quant_linear(
    x: torch.Tensor,  # [M, K]
    w: QuantizedWeight,  # one packed matrix W [N, K] (kernels.quant_formats)
    bias: torch.Tensor | None = None,  # [N], x.dtype
    act_fp8: bool = False,  # W8A8: FP8 weights on CUDA only, dynamic per-token scales
) -> torch.Tensor:  # [M, N], x.dtype
    """Semantics, W = dequantize(w) (float32 [N, K], each format's published layout):

        out = (x.float() @ W.T + bias) rounded once into x.dtype

    with W rounded into x.dtype before the multiply for fp16/bf16 x (fp32 accumulation;
    fp32 x is exact). Weights stay packed: the torch path dequantizes one tile of output
    rows at a time, the Triton kernels decode in registers. Activations are never
    quantized (W8A16 / W4A16) unless act_fp8: then x is first rounded per token to
    e4m3 with scale amax / 448 (kernels.quant_triton.per_token_fp8), the W8A8 path a
    checkpoint with dynamic activation scales allows; the torch path refuses it.
    See kernels.quant_formats.dequantize.
    """
    _check_quant(x, w, "quant_linear")
    if w.num_experts is not None:
        raise ValueError("quant_linear: w holds stacked experts; use quant_moe_gemm")
    if bias is not None and (
        bias.shape != (w.shape[0],) or bias.dtype != x.dtype or bias.device != x.device
    ):
        raise ValueError(
            f"quant_linear: bias {tuple(bias.shape)} {bias.dtype} must be [{w.shape[0]}] "
            f"{x.dtype} on {x.device}"
        )
    if act_fp8 and not isinstance(w, Fp8Weight):
        raise ValueError(f"quant_linear: act_fp8 needs FP8 weights, not {type(w).__name__}")
    return implementation(x, "quant").quant_linear(x, w, bias, act_fp8)


def quant_moe_gemm(
    x: torch.Tensor,  # [P, K]: the plan's pairs' inputs in sorted order
    w: QuantizedWeight,  # packed stacked experts W [E, N, K] (stack_experts)
    plan: ExpertPlan,
) -> torch.Tensor:  # [P, N], x.dtype
    """moe_grouped_gemm on packed experts. Semantics, W = dequantize(w) [E, N, K], for
    each expert e and sorted row i in [plan.expert_indptr[e], plan.expert_indptr[e+1]):

        out[i] = x[i].float() @ W[e].T   rounded once into x.dtype

    (W rounded into x.dtype first for fp16/bf16 x, as quant_linear). Experts with no rows
    are never read; graph-safe plans read no device value. See
    kernels.moe_reference.moe_grouped_gemm_reference over dequantize(w).
    """
    _check_quant(x, w, "quant_moe_gemm")
    if w.num_experts != plan.num_experts or x.shape[0] != plan.num_pairs:
        raise ValueError(
            f"quant_moe_gemm: x has {x.shape[0]} rows and w {w.num_experts} experts; the "
            f"plan {plan.num_pairs} pairs of {plan.num_experts} experts"
        )
    return implementation(x, "quant").quant_moe_gemm(x, w, plan)


def _check_quant(x: torch.Tensor, w: QuantizedWeight, name: str) -> None:
    if x.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"{name}: x {tuple(x.shape)} must be [M, {w.shape[1]}] for W {w.shape}")
    if x.dtype not in _DTYPES or x.device != w.device or x.stride(1) != 1:
        raise ValueError(
            f"{name}: x {x.dtype} on {x.device} must be one of {_DTYPES} on the weight's "
            f"{w.device}, unit stride along K"
        )


def causal_conv1d(
    x: torch.Tensor,  # [T, D]: the batch's tokens (sequences concatenated), unit stride on D
    weight: torch.Tensor,  # [D, K], K >= 2: one K-tap filter per channel
    bias: torch.Tensor | None,  # [D]
    conv_state: torch.Tensor,  # [num_slots, D, K-1], x.dtype, contiguous: updated in place
    batch: StateBatch,
    activation: str | None = "silu",  # "silu" or None
) -> torch.Tensor:  # [T, D], x.dtype
    """The causal depthwise convolution of Gated DeltaNet (and Mamba) with a conv state
    per sequence. Per sequence i with tokens X = x[lo:hi] (L of them) and pool row
    s = state_slots[i], with P = conv_state[s] if has_initial_state[i] else zeros [D, K-1]
    and W = cat(P, Xᵀ, dim=1) [D, K-1+L]:

        out[lo + t] = act(sum_j weight[:, j] * W[:, t + j] + bias)      t in [0, L)
        conv_state[s] = W[:, L:]                     (the last K-1 inputs, in order)

    i.e. transformers' causal_conv1d_fn over cat(P, X) (causal_conv1d_update for L = 1),
    act = SiLU. fp32 arithmetic, out rounded once into x.dtype (fp32, fp16, bf16); the
    state keeps inputs exactly. A row without an initial state is never read (NaN there
    cannot reach an output); pool rows no sequence names are left bit-identical. Slots
    must be distinct within a batch. Nothing reads a device value: a decode batch (one
    token per sequence) is a fixed launch. See
    kernels.gated_delta_reference.causal_conv1d_reference.
    """
    name = "causal_conv1d"
    if x.dim() != 2 or weight.dim() != 2 or weight.shape[0] != x.shape[1] or weight.shape[1] < 2:
        raise ValueError(
            f"{name}: x {tuple(x.shape)} must be [T, D] and weight {tuple(weight.shape)} "
            "[D, K] with K >= 2"
        )
    d, kernel = weight.shape
    if conv_state.dim() != 3 or conv_state.shape[1:] != (d, kernel - 1):
        raise ValueError(
            f"{name}: conv_state {tuple(conv_state.shape)} must be [num_slots, {d}, {kernel - 1}]"
        )
    if bias is not None and bias.shape != (d,):
        raise ValueError(f"{name}: bias {tuple(bias.shape)} must be [{d}]")
    if activation not in ("silu", None):
        raise ValueError(f"{name}: activation {activation!r} must be 'silu' or None")
    if x.dtype not in _DTYPES or conv_state.dtype != x.dtype or weight.dtype not in _DTYPES:
        raise ValueError(
            f"{name}: x {x.dtype} and conv_state {conv_state.dtype} must share one of "
            f"{_DTYPES}; weight {weight.dtype} one of them"
        )
    if x.stride(1) != 1 or not conv_state.is_contiguous():
        raise ValueError(f"{name}: x needs unit stride along D and conv_state contiguity")
    tensors = [x, weight, conv_state] + ([] if bias is None else [bias])
    _check_state_batch(name, batch, x.shape[0], tensors)
    return implementation(x, "gated_delta").causal_conv1d(
        x, weight, bias, conv_state, batch, activation
    )


def gated_delta_rule(
    q: torch.Tensor,  # [T, HK, dk]: queries, unit stride on dk (not yet normalized)
    k: torch.Tensor,  # [T, HK, dk]: keys, likewise
    v: torch.Tensor,  # [T, HV, dv], HV a multiple of HK
    g: torch.Tensor,  # [T, HV]: log decay, <= 0
    beta: torch.Tensor,  # [T, HV]: write strength, in [0, 1]
    recurrent_state: torch.Tensor,  # [num_slots, HV, dk, dv] float32, contiguous: in place
    batch: StateBatch,
    out: torch.Tensor | None = None,  # [T, HV, dv] v.dtype, contiguous: written, returned
) -> torch.Tensor:  # [T, HV, dv], v.dtype
    """The gated delta rule of Gated DeltaNet (Qwen3.5/3.6's linear attention). Per
    sequence i and value head h (key head h // (HV // HK), as transformers'
    repeat_interleave), from S = recurrent_state[s, h] (s = state_slots[i]; zeros
    without an initial state), for each token t in order:

        q̂ = l2norm(q[t]) * dk**-0.5,   k̂ = l2norm(k[t])     (x / sqrt(sum(x²) + 1e-6))
        S = exp(g[t, h]) * S
        S = S + outer(k̂, beta[t, h] * (v[t, h] - Sᵀ k̂))
        out[t, h] = Sᵀ q̂

    then recurrent_state[s, h] = S (fp32). This is transformers'
    torch_recurrent_gated_delta_rule / torch_chunk_gated_delta_rule with
    use_qk_l2norm_in_kernel=True, initial_state and output_final_state, over a varlen
    batch; Qwen3.5 feeds g = -exp(A_log) * softplus(a + dt_bias) and beta = sigmoid(b).
    Prefill chunks run the chunked form (chunks of 64), decodes the recurrent update;
    fp32 arithmetic, out rounded once into v.dtype. A row without an initial state is
    never read; rows no sequence names are left bit-identical; slots must be distinct
    within a batch. Nothing reads a device value: a decode batch is a fixed launch. See
    kernels.gated_delta_reference.gated_delta_rule_reference.
    """
    name = "gated_delta_rule"
    if q.dim() != 3 or k.shape != q.shape or v.dim() != 3 or v.shape[0] != q.shape[0]:
        raise ValueError(
            f"{name}: q {tuple(q.shape)} and k {tuple(k.shape)} must be one [T, HK, dk] shape "
            f"and v {tuple(v.shape)} [T, HV, dv]"
        )
    t, hk, dk = q.shape
    hv, dv = v.shape[1:]
    if hk == 0 or hv % hk or g.shape != (t, hv) or beta.shape != (t, hv):
        raise ValueError(
            f"{name}: HV {hv} must be a multiple of HK {hk}; g {tuple(g.shape)} and beta "
            f"{tuple(beta.shape)} [{t}, {hv}]"
        )
    if recurrent_state.dim() != 4 or recurrent_state.shape[1:] != (hv, dk, dv):
        raise ValueError(
            f"{name}: recurrent_state {tuple(recurrent_state.shape)} must be "
            f"[num_slots, {hv}, {dk}, {dv}]"
        )
    if q.dtype not in _DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"{name}: q {q.dtype}, k {k.dtype}, v {v.dtype}: one of {_DTYPES}")
    if g.dtype not in _DTYPES or beta.dtype not in _DTYPES:
        raise ValueError(f"{name}: g {g.dtype} and beta {beta.dtype} must be among {_DTYPES}")
    if recurrent_state.dtype != torch.float32 or not recurrent_state.is_contiguous():
        raise ValueError(f"{name}: recurrent_state must be contiguous float32")
    if any(x.stride(-1) != 1 for x in (q, k, v) if x.shape[-1] > 1):
        raise ValueError(f"{name}: q, k and v need unit stride along the head dim")
    if out is not None and (
        out.shape != v.shape or out.dtype != v.dtype or not out.is_contiguous()
    ):
        raise ValueError(f"{name}: out must be contiguous {tuple(v.shape)} {v.dtype}")
    tensors = [q, k, v, g, beta, recurrent_state] + ([] if out is None else [out])
    _check_state_batch(name, batch, t, tensors)
    return implementation(v, "gated_delta").gated_delta_rule(
        q, k, v, g, beta, recurrent_state, batch, out
    )


def _check_state_batch(
    name: str, batch: StateBatch, tokens: int, tensors: list[torch.Tensor]
) -> None:
    meta = (batch.cu_seqlens, batch.state_slots, batch.has_initial_state)
    n = batch.num_seqs
    if tuple(m.dtype for m in meta) != (torch.int32, torch.int32, torch.bool):
        raise ValueError(
            f"{name}: cu_seqlens and state_slots must be int32, has_initial_state bool; got "
            f"{[m.dtype for m in meta]}"
        )
    if tuple(m.shape for m in meta) != ((n + 1,), (n,), (n,)):
        raise ValueError(
            f"{name}: {n} sequences need cu_seqlens [{n + 1}], state_slots and "
            f"has_initial_state [{n}]; got {[tuple(m.shape) for m in meta]}"
        )
    if batch.num_tokens != tokens:
        raise ValueError(f"{name}: the batch holds {batch.num_tokens} tokens, the inputs {tokens}")
    devices = {str(x.device) for x in [*tensors, *meta]}
    if len(devices) != 1:
        raise ValueError(f"{name}: inputs, pools and batch tensors on several devices {devices}")
