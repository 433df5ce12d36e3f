"""Fast torch path of the multi-LoRA ops: the CPU backend (and CUDA when forced).

Formulation: tokens are grouped by slot; used slots of one rank form *runs*, each
computed as one `torch.bmm` (or, for a run of one slot, one 2-D matmul) per slice over a
zero-copy view of the arenas: k *places* of `rank` rows, `stride` rows apart
(`a[j]` seen as [k, r, in] with as_strided). The slot pool puts every adapter in an
aligned power-of-two block, so slots of one rank always lie on one grid; places on it
that no used slot holds (other adapters, free rows) are computed and dropped. No weight
is copied, and rows past a slot's rank (another adapter's) are never read. Slots of
different ranks never share a run: nothing guarantees zeros past a rank any more.
When the run's slots hold different token counts, its token rows are gathered once
into the padded [k, m] layout the bmm needs (a place past a slot's tokens repeats a
real row) and every slice's matmul shares that operand; each result drops the padded
places with one index_select (cheaper than padding per matmul, zeros + index_copy_ for
every slice: docs/performance.md). A and B read fastest rank-major
(kernels.lora_a_buffer, lora_b_buffer): an adapter's rank rows are then whole rows of
memory, and a shrink is one matmul over every slice.

Picked by measurement (decode, 32 tokens with 32 rank-16 adapters, fp32,
weights cold, 2-core CPU; `lorafleet bench kernels` and the report of the
task that wrote this): vs the per-sequence loop, runs + bmm 3.0x at hidden
512 and 1.3x at 4096 (where the loop already moves bytes near the memory
bandwidth); gather + bmm (BGMV-style, copies every token's A/B) 1.5x / 0.5x;
F.grouped_mm over the slot range 2.2x / 1.25x (a per-group cost in its CPU
fallback); einsum is bmm underneath.

Decode-sized slots of one rank merge into one run while the places between them cost
fewer bytes than the ops a run saves (`_MERGE_BYTES`). A slot with many tokens
(prefill) forms a run alone. Plans are memoized on the metadata's values, so every
layer of a step reuses the plan its first layer built.

Reads the metadata on the host: free on CPU, a device sync on CUDA (where
this path only runs when LORAFLEET_KERNELS=torch forces it). fp16/bf16
weights are widened to fp32 per call (exact, but 3x the bytes): CPU serving
is fp32.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from kernels.segments import SegmentInfo

# Slots with more tokens than this get a run each (their matmul amortizes the
# call); fewer are padded to the run's longest, so padding stays compute-cheap.
_SMALL_TOKENS = 16
# Reading this many extra bytes (places no used slot holds) costs about what one more
# run's ~10 fixed-cost ops do at a CPU's read bandwidth (docs/performance.md), so runs
# merge below it.
_MERGE_BYTES = 512 * 1024


@dataclass(frozen=True)
class _Run:
    """Used slots of one rank read as k places of `rank` arena rows, `stride` rows apart:
    one matmul per slice over a view of the arenas."""

    k: int  # places
    rank: int  # r: the rank of every slot of the run
    row0: int  # the first arena row of place 0
    stride: int  # arena rows from one place to the next (>= rank)
    m: int  # tokens per place after zero padding (bmm runs)
    rows: torch.Tensor  # [n] int64: token rows in (place, token) order
    row_range: tuple[int, int] | None  # rows are exactly range(*row_range): use views
    pos: torch.Tensor | None  # [n] int64: each row's place in the padded [k*m]; None: dense
    # [k*m] int64 when padded: the row each padded place reads (a place past its
    # slot's tokens repeats a real row; what it computes is dropped by pos)
    padded_rows: torch.Tensor | None
    alpha: float  # scaling shared by every used slot (1.0 when they differ)
    row_scale: torch.Tensor | None  # [n or k*m, 1] fp32 per operand row when slots differ

    @property
    def single(self) -> bool:
        return self.k == 1


def _runs(
    indptr: tuple[int, ...],
    slots: tuple[int, ...],
    ranks: tuple[int, ...],
    scalings: tuple[float, ...],
    offsets: tuple[int, ...],
    arena_rows: int,
    bytes_per_rank: int,
    device: torch.device,
) -> tuple[_Run, ...]:
    """Group the batch into runs; bytes_per_rank = bytes one slot reads per rank row."""
    rows_of: dict[int, list[int]] = {}
    for g, s in enumerate(slots):
        if s != 0 and indptr[g + 1] > indptr[g]:
            if not 0 <= s < len(ranks):
                raise ValueError(f"segment slot {s} outside the {len(ranks)} slots")
            if ranks[s] > 0:  # rank 0: the adapter does not target this projection
                rows_of.setdefault(s, []).extend(range(indptr[g], indptr[g + 1]))
    for s in rows_of:
        if offsets[s] < 0 or offsets[s] + ranks[s] > arena_rows:
            raise ValueError(
                f"slot {s}: rows [{offsets[s]}, {offsets[s] + ranks[s]}) outside the "
                f"arena's {arena_rows} rows"
            )
    # Prefill-sized slots each get a run. Decode-sized ones of one rank are merged in arena
    # order while they lie on one grid and the places between them that no used slot holds
    # cost fewer bytes than the ~10 fixed-cost ops a run saves.
    by_rank: dict[int, list[int]] = {}
    for s in sorted(rows_of, key=offsets.__getitem__):
        if len(rows_of[s]) <= _SMALL_TOKENS:
            by_rank.setdefault(ranks[s], []).append(s)
    groups: list[list[int]] = []
    for r, members in sorted(by_rank.items()):
        group = [members[0]]
        for s in members[1:]:
            grown = [*group, s]
            stride = _stride(grown, r, offsets)
            unused = _places_of(grown, stride, offsets) - len(grown)
            if stride and unused * r * bytes_per_rank <= _MERGE_BYTES:
                group = grown
            else:
                groups.append(group)
                group = [s]
        groups.append(group)
    groups += [[s] for s in sorted(rows_of) if len(rows_of[s]) > _SMALL_TOKENS]
    return tuple(_make_run(g, rows_of, ranks, scalings, offsets, device) for g in groups)


def _stride(group: list[int], rank: int, offsets: tuple[int, ...]) -> int:
    """The rows between places when the slots (one rank, in arena order) are places of
    one view: the gcd of their first rows' distances, if no smaller than the rank (the
    slot pool's aligned blocks guarantee it for one rank); 0 when they are not."""
    o0 = offsets[group[0]]
    stride = 0
    for s in group[1:]:
        stride = math.gcd(stride, offsets[s] - o0)
    if len(group) == 1:
        return rank
    return stride if stride >= rank else 0


def _places_of(group: list[int], stride: int, offsets: tuple[int, ...]) -> int:
    return (
        1
        if len(group) == 1 or not stride
        else (offsets[group[-1]] - offsets[group[0]]) // stride + 1
    )


def _make_run(
    group: list[int],
    rows_of: dict[int, list[int]],
    ranks: tuple[int, ...],
    scalings: tuple[float, ...],
    offsets: tuple[int, ...],
    device: torch.device,
) -> _Run:
    r = ranks[group[0]]
    row0, stride = offsets[group[0]], _stride(group, r, offsets)
    place = {s: (offsets[s] - row0) // stride for s in group}
    k = place[group[-1]] + 1
    at = {p: s for s, p in place.items()}  # place -> slot (places between: none)
    m = max(len(rows_of[s]) for s in group)
    rows = [t for s in group for t in rows_of[s]]
    dense = len(rows) == k * m
    pos = None if dense else [place[s] * m + i for s in group for i in range(len(rows_of[s]))]
    contiguous = rows == list(range(rows[0], rows[0] + len(rows)))
    shared = len({scalings[s] for s in group}) == 1
    if pos is None:
        padded_rows = None
        row_scale = [scalings[s] for s in group for _ in rows_of[s]]
    else:  # every place, m rows each
        padded_rows = [
            rows_of[at[p]][i] if p in at and i < len(rows_of[at[p]]) else rows[0]
            for p in range(k)
            for i in range(m)
        ]
        row_scale = [scalings[at[p]] if p in at else 0.0 for p in range(k) for _ in range(m)]

    def tensor(values: list, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=device)

    return _Run(
        k=k,
        rank=r,
        row0=row0,
        stride=stride,
        m=m,
        rows=tensor(rows),
        row_range=(rows[0], rows[0] + len(rows)) if contiguous else None,
        pos=None if pos is None else tensor(pos),
        padded_rows=None if padded_rows is None else tensor(padded_rows),
        alpha=scalings[group[0]] if shared else 1.0,
        row_scale=None if shared else tensor(row_scale, torch.float32)[:, None],
    )


@functools.lru_cache(maxsize=64)
def _cached_runs(
    key: tuple[bytes, ...], arena_rows: int, bytes_per_rank: int, device: torch.device
) -> tuple[_Run, ...]:
    indptr, slots, ranks, offsets = (tuple(memoryview(key[i]).cast("i")) for i in (0, 1, 2, 4))
    scalings = tuple(memoryview(key[3]).cast("f"))
    return _runs(indptr, slots, ranks, scalings, offsets, arena_rows, bytes_per_rank, device)


def _plan(seg: SegmentInfo, arena_rows: int, bytes_per_rank: int, device: torch.device):
    # Memoized on the metadata's values, not the object, so buffers the engine
    # refills in place never serve a stale plan; every layer of a step hits the
    # entry its first layer made. (Raw bytes: the cheapest exact key.)
    meta = (seg.seg_indptr, seg.seg_slots, seg.slot_ranks, seg.slot_scalings, seg.slot_offsets)
    key = tuple(t.cpu().numpy().tobytes() for t in meta)
    return _cached_runs(key, arena_rows, bytes_per_rank, device)


def _cut(t: torch.Tensor, dim: int, start: int, end: int) -> torch.Tensor:
    """t[start:end] along dim (negative dims count from the end); t itself when that
    is all of it: at decode sizes each view op skipped is measurable."""
    if start == 0 and end == t.shape[dim]:
        return t
    if dim < 0:
        return t[(Ellipsis, slice(start, end)) + (slice(None),) * (-1 - dim)]
    return t[(slice(None),) * dim + (slice(start, end),)]


def _operand(src: torch.Tensor, run: _Run) -> torch.Tensor:
    """The run's token rows of src as float32, in the matmul's layout: [n, k] when dense
    (a view when the rows are a range), [k*m, k] padded otherwise. Gathered once per
    run, so every slice's matmul shares it."""
    if run.padded_rows is not None:
        return src.index_select(0, run.padded_rows).float()
    if run.row_range is not None:
        return _cut(src, 0, *run.row_range).float()
    return src.index_select(0, run.rows).float()


def _places(arena: torch.Tensor, run: _Run) -> torch.Tensor:
    """The run's weights out of an arena laid out [P, cols] (rank rows first), a view:
    [r, cols] for one place, [k, r, cols] for several (place i at row0 + i*stride)."""
    if run.single:
        return _cut(arena, 0, run.row0, run.row0 + run.rank)
    row, col = arena.stride()
    return arena.as_strided(
        (run.k, run.rank, arena.shape[1]),
        (run.stride * row, row, col),
        arena.storage_offset() + run.row0 * row,
    )


def _matmul(p: torch.Tensor, w_t: torch.Tensor, run: _Run) -> torch.Tensor:
    """p @ w_t per place of the run: p from _operand, w_t [r, N] (one place) or
    [k, r, N] -> [n, N] fp32, the padded places dropped. One place is a plain 2-D
    matmul (a batch-of-one bmm costs more per call); several are one bmm."""
    if run.single:
        return p @ w_t.float()
    res = torch.bmm(p.reshape(run.k, run.m, p.shape[1]), w_t.float())
    flat = res.view(-1, res.shape[-1])  # [k*m, N]
    return flat if run.pos is None else flat.index_select(0, run.pos)


def lora_shrink(
    x: torch.Tensor,  # [T, in]
    a: torch.Tensor,  # [num_slices, P, in]
    seg: SegmentInfo,
    max_rank: int,
    out: torch.Tensor | None = None,  # [T, num_slices*R] float32 zeros, written in place
) -> torch.Tensor:  # [T, num_slices*R] float32
    """out[rows_g, j*R : j*R+r] = x[rows_g] @ a[j, o : o+r]ᵀ, zero elsewhere
    (s = seg_slots[g] != 0, r = slot_ranks[s], o = slot_offsets[s]); see kernels.reference."""
    num_slices, arena_rows = a.shape[0], a.shape[1]
    if out is None:
        out = torch.zeros(x.shape[0], num_slices * max_rank, dtype=torch.float32, device=x.device)
    if not seg.has_lora or x.shape[0] == 0:
        return out
    if seg.graph_safe:
        return _shrink_per_token(x, a, seg, max_rank, out)
    plan = _plan(seg, arena_rows, num_slices * a.shape[2] * a.element_size(), x.device)
    rank_major = a.stride(0) == a.shape[2] and a.stride(1) == num_slices * a.shape[2]
    for run in plan:
        xs = _operand(x, run)  # [n or k*m, in]
        if rank_major:  # every slice of a place is one [r * num_slices, in] block: one matmul
            w = _places(a.permute(1, 0, 2).reshape(arena_rows, -1), run)  # [(k,) r, ns*in]
            w = w.unflatten(-1, (num_slices, a.shape[2])).flatten(-3, -2)  # [(k,) r*ns, in]
            res = _matmul(xs, w.transpose(-1, -2), run)  # [n, r*ns], (c, j) order
            dst = _cut(out.view(out.shape[0], num_slices, max_rank), 2, 0, run.rank)
            src = res.view(-1, run.rank, num_slices).transpose(1, 2)  # [n, ns, r]
            if run.row_range is not None:
                _cut(dst, 0, *run.row_range).copy_(src)
            else:
                dst.index_copy_(0, run.rows, src)
            continue
        for j in range(num_slices):
            c0 = j * max_rank
            w = _places(a[j], run)  # [(k,) r, in]
            res = _matmul(xs, w.transpose(-1, -2), run)  # [n, r]
            if run.row_range is not None:
                _cut(_cut(out, 0, *run.row_range), 1, c0, c0 + run.rank).copy_(res)
            else:
                _cut(out, 1, c0, c0 + run.rank).index_copy_(0, run.rows, res)
    return out


def lora_expand(
    y: torch.Tensor,  # [T, out_total], updated in place
    inter: torch.Tensor,  # [T, num_slices*R] float32
    b: torch.Tensor,  # [out_total, P]
    seg: SegmentInfo,
    slice_offsets: list[int],  # host, [num_slices+1]
) -> torch.Tensor:  # y
    """y[rows_g, cols_j] += scaling[s] * inter[rows_g, j*R : j*R+r] @ b[cols_j, o : o+r]ᵀ,
    fp32 accumulation rounded once into y.dtype; see kernels.reference."""
    if not seg.has_lora or y.shape[0] == 0:
        return y
    num_slices = len(slice_offsets) - 1
    r_max = inter.shape[1] // num_slices
    if seg.graph_safe:
        return _expand_per_token(y, inter, b, seg, slice_offsets, r_max)
    c_lo, c_hi = slice_offsets[0], slice_offsets[-1]
    rank_rows = _cut(b, 0, c_lo, c_hi).t()  # [P, used cols]: rank rows first
    for run in _plan(seg, b.shape[1], (c_hi - c_lo) * b.element_size(), y.device):
        t = _operand(inter, run)  # [n or k*m, num_slices*R]
        if run.row_scale is not None:
            t = t * run.row_scale  # slots differ in scaling: scale the small side
        w_all = _places(rank_rows, run)  # [(k,) r, used cols]
        for j in range(num_slices):
            c0, c1 = slice_offsets[j], slice_offsets[j + 1]
            t_j = _cut(t, 1, j * r_max, j * r_max + run.rank)  # [., r]
            res = _matmul(t_j, _cut(w_all, -1, c0 - c_lo, c1 - c_lo), run)  # [n, c1-c0]
            _accumulate(_cut(y, 1, c0, c1), res, run)
    return y


def _accumulate(y_cols: torch.Tensor, res: torch.Tensor, run: _Run) -> None:
    """y_cols[run.rows] += alpha * res (fp32), rounded once into y's dtype."""
    if run.row_range is not None:
        # in-place add computes in fp32 and rounds once on store
        _cut(y_cols, 0, *run.row_range).add_(res, alpha=run.alpha)
    elif y_cols.dtype == torch.float32:
        y_cols.index_add_(0, run.rows, res, alpha=run.alpha)
    else:
        y_cols[run.rows] = torch.add(y_cols[run.rows], res, alpha=run.alpha).to(y_cols.dtype)


# -- graph-safe: one token per segment, metadata read only on the device ---------------------
# A fixed sequence of ops whatever the slots (what a CUDA graph can replay, and what the
# CPU tests of the static decode path trace): each token's adapter rows are gathered
# (BGMV), rows past the slot's rank masked. Reads every token's A and B, so it is
# the slower CPU formulation; eager decode steps keep the runs above.


def _token_rows(seg: SegmentInfo, r_max: int, arena_rows: int) -> tuple[torch.Tensor, ...]:
    """[T*R] int64 arena rows of each token's adapter (row c of token t at t*R + c,
    clamped into the arena) and [T, R] bool: c is inside the token's slot's rank."""
    ranks = seg.slot_ranks.index_select(0, seg.seg_slots)  # [T]; slot 0 has rank 0
    first = seg.slot_offsets.index_select(0, seg.seg_slots).long()  # [T]
    cols = torch.arange(r_max, device=ranks.device)
    keep = cols[None, :] < ranks[:, None]
    rows = (first[:, None] + cols[None, :]).clamp_(max=arena_rows - 1)
    return rows.view(-1), keep


def _shrink_per_token(
    x: torch.Tensor, a: torch.Tensor, seg: SegmentInfo, r_max: int, out: torch.Tensor
) -> torch.Tensor:
    num_slices, t = a.shape[0], x.shape[0]
    rows, keep = _token_rows(seg, r_max, a.shape[1])
    w = a.index_select(1, rows).view(num_slices, t, r_max, a.shape[2])  # [ns, T, R, in]
    res = torch.matmul(w.float(), x.float()[None, :, :, None]).squeeze(-1)  # [ns, T, R]
    res = res.permute(1, 0, 2).reshape(t, num_slices * r_max)
    mask = keep.repeat(1, num_slices)
    return out.copy_(torch.where(mask, res, 0.0))  # rows past a rank belong to others


def _expand_per_token(
    y: torch.Tensor,
    inter: torch.Tensor,
    b: torch.Tensor,
    seg: SegmentInfo,
    slice_offsets: list[int],
    r_max: int,
) -> torch.Tensor:
    rows, keep = _token_rows(seg, r_max, b.shape[1])
    scale = seg.slot_scalings.index_select(0, seg.seg_slots)[:, None]  # [T, 1]
    w = b.t().index_select(0, rows).view(y.shape[0], r_max, b.shape[0])  # [T, R, out_total]
    w = torch.where(keep[:, :, None], w.float(), 0.0)  # rows past a rank: other adapters'
    acc = y.float()
    for j in range(len(slice_offsets) - 1):
        c0, c1 = slice_offsets[j], slice_offsets[j + 1]
        t = torch.where(keep, inter[:, j * r_max : (j + 1) * r_max], 0.0) * scale  # [T, R]
        acc[:, c0:c1] += torch.bmm(t.unsqueeze(1), w[:, :, c0:c1]).squeeze(1)
    return y.copy_(acc)
