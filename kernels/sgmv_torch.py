"""Fast torch path of the multi-LoRA ops: the CPU backend (and CUDA when forced).

Formulation: tokens are grouped by slot; used slots next to each other in the
stacked buffers form a *run*, computed as one `torch.bmm` over a zero-copy view
of the buffers (`a[lo:hi]`, `b[lo:hi, :, :r]` with r the run's largest rank),
or, for a run of one slot, one 2-D matmul. No weight is gathered. When the run's
slots hold different token counts, its rows are gathered once into the padded
[(hi-lo), m] layout the bmm needs (a place past a slot's tokens repeats a real
row) and every slice's matmul shares that operand; each result drops the padded
places with one index_select. (Padding per matmul instead, zeros + index_copy_
for every slice: decode step median 78 vs 71 ms, 32 tokens over 16 adapters of
uneven popularity, the two alternated step by step.) Doing every slice of a run's
shrink in one bmm (the operand repeated per slice) measured no faster: not done.
B reads fastest rank-major (kernels.lora_b_buffer).

Picked by measurement (decode, 32 tokens with 32 rank-16 adapters, fp32,
weights cold, 2-core CPU; `lorafleet bench kernels` and the report of the
task that wrote this): vs the per-sequence loop, runs + bmm 3.0x at hidden
512 and 1.3x at 4096 (where the loop already moves bytes near the memory
bandwidth); gather + bmm (BGMV-style, copies every token's A/B) 1.5x / 0.5x;
F.grouped_mm over the slot range 2.2x / 1.25x (a per-group cost in its CPU
fallback); einsum is bmm underneath.

Decode-sized slots merge into one run while the extra bytes read (unused
slots between, whose rows are zero-padded and dropped; padding past a
lower-rank slot's rank, which the contract keeps zero) cost less than the
ops saved (`_MERGE_BYTES`). Measured in the engine's decode step (hidden 512,
16 adapters of ranks 8-64 in R=64 slots, 32 tokens): one run per rank took
~130 ms of LoRA ops per step, merged runs far less. A slot with many tokens
(prefill) forms a run alone. Plans are
memoized on the metadata's values, so every layer of a step reuses the plan
its first layer built.

Reads the metadata on the host: free on CPU, a device sync on CUDA (where
this path only runs when LORAFLEET_KERNELS=torch forces it). fp16/bf16
weights are widened to fp32 per call (exact, but 3x the bytes): CPU serving
is fp32.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from kernels.segments import SegmentInfo

# Slots with more tokens than this get a run each (their matmul amortizes the
# call); fewer are padded to the run's longest, so padding stays compute-cheap.
_SMALL_TOKENS = 16
# Reading this many extra bytes (zero padding of lower-rank slots, unused slots
# between) costs about what one more run's ~10 fixed-cost ops do at the ~10-20 GB/s
# measured here, so runs merge below it.
_MERGE_BYTES = 512 * 1024


@dataclass(frozen=True)
class _Run:
    """Used slots in [lo, hi), all of one rank: one matmul over a view of the buffers."""

    lo: int  # first slot
    hi: int  # one past the last slot
    rank: int  # r: the rank of every used slot in the run
    m: int  # tokens per slot after zero padding (bmm runs)
    rows: torch.Tensor  # [n] int64: token rows in (slot, token) order
    row_range: tuple[int, int] | None  # rows are exactly range(*row_range): use views
    pos: torch.Tensor | None  # [n] int64: each row's place in the padded [(hi-lo)*m]; None: dense
    # [(hi-lo)*m] int64 when padded: the row each padded place reads (a place past its
    # slot's tokens repeats a real row; what it computes is dropped by pos)
    padded_rows: torch.Tensor | None
    alpha: float  # scaling shared by every used slot (1.0 when they differ)
    row_scale: torch.Tensor | None  # [n or (hi-lo)*m, 1] fp32 per operand row when slots differ

    @property
    def single(self) -> bool:
        return self.hi - self.lo == 1


def _runs(
    indptr: tuple[int, ...],
    slots: tuple[int, ...],
    ranks: tuple[int, ...],
    scalings: tuple[float, ...],
    r_max: int,
    bytes_per_rank: int,
    device: torch.device,
) -> tuple[_Run, ...]:
    """Group the batch into runs; bytes_per_rank = bytes one slot reads per rank row."""
    rows_of: dict[int, list[int]] = {}
    for g, s in enumerate(slots):
        if s != 0 and indptr[g + 1] > indptr[g]:
            rows_of.setdefault(s, []).extend(range(indptr[g], indptr[g + 1]))
    for s in rows_of:
        if not 0 <= s < len(ranks):
            raise ValueError(f"segment slot {s} outside the {len(ranks)} slots")
        if ranks[s] > r_max:
            raise ValueError(f"slot {s} has rank {ranks[s]} > the buffers' max rank {r_max}")
    groups: list[list[int]] = []
    # Prefill-sized slots each get a run. Decode-sized ones are merged in slot order while
    # the bytes a merge adds (padding up to the run's largest rank, unused slots between)
    # cost less than the ops it saves: on CPU a run's fixed cost is ~10 ops of ~10 us.
    # A rank-0 slot (an adapter that does not target this projection) may ride along
    # inside a run: its weights are all padding, i.e. zero, and keeping its rows in the
    # run keeps the run's rows one contiguous range (views instead of gather/scatter).
    small = sorted(s for s in rows_of if len(rows_of[s]) <= _SMALL_TOKENS)
    for s in small:
        if groups and _merge_cost(groups[-1], s, ranks, bytes_per_rank) <= _MERGE_BYTES:
            groups[-1].append(s)
        else:
            groups.append([s])
    groups = [g for g in groups if max(ranks[s] for s in g) > 0]
    groups += [[s] for s in sorted(rows_of) if ranks[s] > 0 and len(rows_of[s]) > _SMALL_TOKENS]
    return tuple(_make_run(g, rows_of, ranks, scalings, device) for g in groups)


def _run_bytes(group: list[int], ranks: tuple[int, ...], bytes_per_rank: int) -> int:
    return (group[-1] + 1 - group[0]) * max(ranks[s] for s in group) * bytes_per_rank


def _merge_cost(group: list[int], s: int, ranks: tuple[int, ...], bytes_per_rank: int) -> int:
    """Extra bytes read if slot s joins the run `group` instead of starting its own."""
    alone = _run_bytes(group, ranks, bytes_per_rank) + _run_bytes([s], ranks, bytes_per_rank)
    return _run_bytes([*group, s], ranks, bytes_per_rank) - alone


def _make_run(
    group: list[int],
    rows_of: dict[int, list[int]],
    ranks: tuple[int, ...],
    scalings: tuple[float, ...],
    device: torch.device,
) -> _Run:
    lo, hi = group[0], group[-1] + 1
    m = max(len(rows_of[s]) for s in group)
    rows = [t for s in group for t in rows_of[s]]
    dense = len(rows) == (hi - lo) * m
    pos = None if dense else [(s - lo) * m + i for s in group for i in range(len(rows_of[s]))]
    contiguous = rows == list(range(rows[0], rows[0] + len(rows)))
    shared = len({scalings[s] for s in group}) == 1
    if pos is None:
        padded_rows = None
        row_scale = [scalings[s] for s in group for _ in rows_of[s]]
    else:  # every place of every slot in [lo, hi), m per slot
        padded_rows = [
            rows_of[s][i] if i < len(rows_of.get(s, ())) else rows[0]
            for s in range(lo, hi)
            for i in range(m)
        ]
        row_scale = [scalings[s] for s in range(lo, hi) for _ in range(m)]

    def tensor(values: list, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=device)

    return _Run(
        lo=lo,
        hi=hi,
        rank=max(ranks[s] for s in group),  # slots of lower rank read their zero padding
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
    key: tuple[bytes, bytes, bytes, bytes], r_max: int, bytes_per_rank: int, device: torch.device
) -> tuple[_Run, ...]:
    indptr, slots, ranks = (tuple(memoryview(k).cast("i")) for k in key[:3])
    scalings = tuple(memoryview(key[3]).cast("f"))
    return _runs(indptr, slots, ranks, scalings, r_max, bytes_per_rank, device)


def _plan(seg: SegmentInfo, r_max: int, bytes_per_rank: int, device: torch.device):
    # Memoized on the metadata's values, not the object, so buffers the engine
    # refills in place never serve a stale plan; every layer of a step hits the
    # entry its first layer made. (Raw bytes: the cheapest exact key.)
    meta = (seg.seg_indptr, seg.seg_slots, seg.slot_ranks, seg.slot_scalings)
    key = tuple(t.cpu().numpy().tobytes() for t in meta)
    return _cached_runs(key, r_max, bytes_per_rank, device)


def _cut(t: torch.Tensor, dim: int, start: int, end: int) -> torch.Tensor:
    """t[start:end] along dim (negative dims count from the end); t itself when that
    is all of it: at decode sizes each view op skipped is measurable."""
    if start == 0 and end == t.shape[dim]:
        return t
    if dim < 0:
        return t[(Ellipsis, slice(start, end)) + (slice(None),) * (-1 - dim)]
    return t[(slice(None),) * dim + (slice(start, end),)]


def _operand(src: torch.Tensor, run: _Run) -> torch.Tensor:
    """The run's rows of src as float32, in the matmul's layout: [n, k] when dense (a
    view when the rows are a range), [(hi-lo)*m, k] padded otherwise. Gathered once per
    run, so every slice's matmul shares it."""
    if run.padded_rows is not None:
        return src.index_select(0, run.padded_rows).float()
    if run.row_range is not None:
        return _cut(src, 0, *run.row_range).float()
    return src.index_select(0, run.rows).float()


def _slots(buf: torch.Tensor, run: _Run) -> torch.Tensor:
    """The run's slots of a stacked buffer, a view: buf[lo] for one slot, else buf[lo:hi]."""
    return buf[run.lo] if run.single else buf[run.lo : run.hi]


def _matmul(p: torch.Tensor, w: torch.Tensor, run: _Run) -> torch.Tensor:
    """p @ wᵀ per slot of the run: p from _operand, w [N, k] (one slot) or
    [(hi-lo), N, k] -> [n, N] fp32, the padded places dropped. One slot is a plain 2-D
    matmul (a batch-of-one bmm costs more per call); several are one bmm."""
    if run.single:
        return torch.nn.functional.linear(p, w.float())
    res = torch.bmm(p.reshape(run.hi - run.lo, run.m, p.shape[1]), w.float().transpose(1, 2))
    flat = res.view(-1, res.shape[-1])  # [(hi-lo)*m, N]
    return flat if run.pos is None else flat.index_select(0, run.pos)


def lora_shrink(
    x: torch.Tensor,  # [T, in]
    a: torch.Tensor,  # [S, num_slices*R, in]
    seg: SegmentInfo,
    num_slices: int = 1,
    out: torch.Tensor | None = None,  # [T, num_slices*R] float32 zeros, written in place
) -> torch.Tensor:  # [T, num_slices*R] float32
    """out[rows_g, j*R : j*R+r] = x[rows_g] @ a[s, j*R : j*R+r]ᵀ, zero elsewhere
    (s = seg_slots[g] != 0, r = slot_ranks[s]); see kernels.reference."""
    if out is None:
        out = torch.zeros(x.shape[0], a.shape[1], dtype=torch.float32, device=x.device)
    if not seg.has_lora or x.shape[0] == 0:
        return out
    if seg.graph_safe:
        return _shrink_per_token(x, a, seg, num_slices, out)
    r_max = a.shape[1] // num_slices
    for run in _plan(seg, r_max, num_slices * a.shape[2] * a.element_size(), x.device):
        xs = _operand(x, run)  # [n or (hi-lo)*m, in]
        w_all = _slots(a, run)  # [(hi-lo,) num_slices*R, in]
        # a rank filling every slice is one matmul over all of a's rows
        if run.rank == r_max:
            col_ranges = [(0, a.shape[1])]
        else:
            col_ranges = [(j * r_max, j * r_max + run.rank) for j in range(num_slices)]
        for c0, c1 in col_ranges:
            res = _matmul(xs, _cut(w_all, -2, c0, c1), run)  # [n, c1-c0]
            if run.row_range is not None:
                _cut(_cut(out, 0, *run.row_range), 1, c0, c1).copy_(res)
            else:
                _cut(out, 1, c0, c1).index_copy_(0, run.rows, res)
    return out


def lora_expand(
    y: torch.Tensor,  # [T, out_total], updated in place
    inter: torch.Tensor,  # [T, num_slices*R] float32
    b: torch.Tensor,  # [S, out_total, R]
    seg: SegmentInfo,
    slice_offsets: list[int],  # host, [num_slices+1]
) -> torch.Tensor:  # y
    """y[rows_g, cols_j] += scaling[s] * inter[rows_g, j*R : j*R+r] @ b[s, cols_j, :r]ᵀ,
    fp32 accumulation rounded once into y.dtype; see kernels.reference."""
    if not seg.has_lora or y.shape[0] == 0:
        return y
    if seg.graph_safe:
        return _expand_per_token(y, inter, b, seg, slice_offsets)
    r_max = b.shape[2]
    used_cols = slice_offsets[-1] - slice_offsets[0]
    for run in _plan(seg, r_max, used_cols * b.element_size(), y.device):
        t = _operand(inter, run)  # [n or (hi-lo)*m, num_slices*R]
        if run.row_scale is not None:
            t = t * run.row_scale  # slots differ in scaling: scale the small side
        w_all = _cut(_slots(b, run), -1, 0, run.rank)  # [(hi-lo,) out_total, r]
        for j in range(len(slice_offsets) - 1):
            c0, c1 = slice_offsets[j], slice_offsets[j + 1]
            t_j = _cut(t, 1, j * r_max, j * r_max + run.rank)  # [., r]
            res = _matmul(t_j, _cut(w_all, -2, c0, c1), run)  # [n, c1-c0]
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
# CPU tests of the static decode path trace): each token's slot weights are gathered
# (BGMV), columns past the slot's rank masked. Reads every token's A and B, so it is
# the slower CPU formulation; eager decode steps keep the runs above.


def _rank_mask(seg: SegmentInfo, r_max: int, num_slices: int) -> torch.Tensor:
    """[T, num_slices*R] bool: column j*R + c is inside the token's slot's rank."""
    ranks = seg.slot_ranks.index_select(0, seg.seg_slots)  # [T]; slot 0 has rank 0
    cols = torch.arange(r_max, device=ranks.device)
    return (cols[None, :] < ranks[:, None]).repeat(1, num_slices)


def _shrink_per_token(
    x: torch.Tensor, a: torch.Tensor, seg: SegmentInfo, num_slices: int, out: torch.Tensor
) -> torch.Tensor:
    w = a.index_select(0, seg.seg_slots)  # [T, num_slices*R, in]
    res = torch.bmm(w.float(), x.float().unsqueeze(2)).squeeze(2)  # [T, num_slices*R]
    mask = _rank_mask(seg, a.shape[1] // num_slices, num_slices)
    return out.copy_(torch.where(mask, res, 0.0))  # rows past a rank may hold anything


def _expand_per_token(
    y: torch.Tensor,
    inter: torch.Tensor,
    b: torch.Tensor,
    seg: SegmentInfo,
    slice_offsets: list[int],
) -> torch.Tensor:
    r_max, num_slices = b.shape[2], len(slice_offsets) - 1
    keep = _rank_mask(seg, r_max, 1)  # [T, R]
    scale = seg.slot_scalings.index_select(0, seg.seg_slots)[:, None]  # [T, 1]
    w = b.index_select(0, seg.seg_slots)  # [T, out_total, R]
    w = torch.where(keep[:, None, :], w.float(), 0.0)  # B columns past a rank are never read
    acc = y.float()
    for j in range(num_slices):
        c0, c1 = slice_offsets[j], slice_offsets[j + 1]
        t = torch.where(keep, inter[:, j * r_max : (j + 1) * r_max], 0.0) * scale  # [T, R]
        acc[:, c0:c1] += torch.bmm(w[:, c0:c1], t.unsqueeze(2)).squeeze(2)
    return y.copy_(acc)
