"""Fast torch path of the multi-LoRA ops: the CPU backend (and CUDA when forced).

Formulation, picked by measurement (`lorafleet bench kernels`, numbers in the
lead's report): tokens are grouped by slot, slots by rank; slots of one rank
that sit next to each other in the stacked buffers form a *run*, and a run is
one `torch.bmm` on a zero-copy view `a[lo:hi, rows, :]` / `b[lo:hi, :, :r]`.
So each used slot's A and B are read once, never gathered (a gather reads,
writes and re-reads them: 3x the bytes), and 32 decode tokens with 32
adapters cost a handful of ops, not one Python iteration each. Alternatives
measured and rejected: gather + bmm (copies the weights), F.grouped_mm
(a per-group cost in its CPU fallback, 4-5x slower than bmm at hidden 512),
einsum / mul-sum (slower than bmm, same bytes).

A run may bridge a gap of unused slots when reading them is cheaper than
another run (`_GAP_BYTES`); their rows are zero-padded and dropped. A slot
with many tokens (prefill) forms a run alone. Plans are memoized on the
metadata's values, so every layer of a step reuses its step's plan.

Reads the metadata on the host: free on CPU, a device sync on CUDA (where
this path only runs when LORAFLEET_KERNELS=torch forces it).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from kernels.segments import SegmentInfo

# Slots with more tokens than this get a run each (their matmul amortizes the
# call); fewer are padded to the run's longest, so padding stays compute-cheap.
_SMALL_TOKENS = 16
# Reading this many bytes of unused slots costs about one more run's fixed op
# overhead (~10 us at the ~20 GB/s measured here), so bridge gaps below it.
_GAP_BYTES = 192 * 1024


@dataclass(frozen=True)
class _Run:
    """Slots [lo, hi) of one rank, computed as one bmm over a buffer view."""

    lo: int  # first slot
    hi: int  # one past the last slot
    rank: int  # r: the rank of every used slot in the run
    m: int  # tokens per slot after zero padding
    rows: torch.Tensor  # [n] int64: token rows in (slot, token) order
    pos: torch.Tensor | None  # [n] int64: place of each row in the padded [(hi-lo)*m]; None = dense
    row_range: tuple[int, int] | None  # rows are exactly range(*row_range), dense: use views


def _runs(
    indptr: tuple[int, ...],
    slots: tuple[int, ...],
    ranks: tuple[int, ...],
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
    for s in sorted((s for s in rows_of if ranks[s] > 0), key=lambda s: (ranks[s], s)):
        prev = groups[-1][-1] if groups else None
        small = len(rows_of[s]) <= _SMALL_TOKENS
        if (
            prev is not None
            and small
            and len(rows_of[prev]) <= _SMALL_TOKENS
            and ranks[prev] == ranks[s]
            and (s - prev - 1) * ranks[s] * bytes_per_rank <= _GAP_BYTES
        ):
            groups[-1].append(s)
        else:
            groups.append([s])
    return tuple(_make_run(g, rows_of, ranks, device) for g in groups)


def _make_run(
    group: list[int], rows_of: dict[int, list[int]], ranks: tuple[int, ...], device: torch.device
) -> _Run:
    lo, hi = group[0], group[-1] + 1
    m = max(len(rows_of[s]) for s in group)
    rows = [t for s in group for t in rows_of[s]]
    dense = len(rows) == (hi - lo) * m
    pos = None if dense else [(s - lo) * m + i for s in group for i in range(len(rows_of[s]))]
    contiguous = dense and rows == list(range(rows[0], rows[0] + len(rows)))
    return _Run(
        lo=lo,
        hi=hi,
        rank=ranks[group[0]],
        m=m,
        rows=torch.tensor(rows, dtype=torch.int64, device=device),
        pos=None if pos is None else torch.tensor(pos, dtype=torch.int64, device=device),
        row_range=(rows[0], rows[0] + len(rows)) if contiguous else None,
    )


_cached_runs = functools.lru_cache(maxsize=64)(_runs)


def _plan(seg: SegmentInfo, r_max: int, bytes_per_rank: int, device: torch.device):
    # Memoized on the metadata's values (not the object), so buffers the
    # engine refills in place can never serve a stale plan.
    return _cached_runs(
        tuple(seg.seg_indptr.tolist()),
        tuple(seg.seg_slots.tolist()),
        tuple(seg.slot_ranks.tolist()),
        r_max,
        bytes_per_rank,
        device,
    )


def _gather(src: torch.Tensor, run: _Run) -> torch.Tensor:
    """src rows of the run, zero-padded: [(hi-lo), m, src.shape[1]]."""
    shape = (run.hi - run.lo, run.m, src.shape[1])
    if run.row_range is not None:
        return src[run.row_range[0] : run.row_range[1]].reshape(shape)
    picked = src.index_select(0, run.rows)
    if run.pos is None:
        return picked.view(shape)
    padded = src.new_zeros(shape[0] * shape[1], shape[2])
    return padded.index_copy_(0, run.pos, picked).view(shape)


def _valid(res: torch.Tensor, run: _Run) -> torch.Tensor:
    """Drop the padding rows of a [(hi-lo), m, w] result: [n, w] in run.rows order."""
    flat = res.reshape(-1, res.shape[-1])
    return flat if run.pos is None else flat.index_select(0, run.pos)


def lora_shrink(
    x: torch.Tensor,  # [T, in]
    a: torch.Tensor,  # [S, num_slices*R, in]
    seg: SegmentInfo,
    num_slices: int = 1,
) -> torch.Tensor:  # [T, num_slices*R] float32
    """out[rows_g, j*R : j*R+r] = x[rows_g] @ a[s, j*R : j*R+r]ᵀ, zero elsewhere
    (s = seg_slots[g] != 0, r = slot_ranks[s]); see kernels.reference."""
    out = torch.zeros(x.shape[0], a.shape[1], dtype=torch.float32, device=x.device)
    if not seg.has_lora or x.shape[0] == 0:
        return out
    r_max = a.shape[1] // num_slices
    for run in _plan(seg, r_max, num_slices * a.shape[2] * a.element_size(), x.device):
        xs = _gather(x, run).float()  # [(hi-lo), m, in]
        r = run.rank
        # one bmm for every slice when the rank fills them; else one per slice
        col_ranges = [(0, a.shape[1])] if r == r_max else [(j * r_max, j * r_max + r) for j in range(num_slices)]
        for c0, c1 in col_ranges:
            w = a[run.lo : run.hi, c0:c1].float()  # [(hi-lo), c1-c0, in]: a view for fp32
            res = torch.bmm(xs, w.transpose(1, 2))  # [(hi-lo), m, c1-c0]
            if run.row_range is not None:
                out[run.row_range[0] : run.row_range[1], c0:c1] = res.reshape(-1, c1 - c0)
            else:
                out[:, c0:c1].index_copy_(0, run.rows, _valid(res, run))
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
    r_max = b.shape[2]
    used_cols = slice_offsets[-1] - slice_offsets[0]
    for run in _plan(seg, r_max, used_cols * b.element_size(), y.device):
        r = run.rank
        # scale the small intermediate, not the output
        scale = seg.slot_scalings[run.lo : run.hi].view(-1, 1, 1)
        t = _gather(inter, run) * scale  # [(hi-lo), m, num_slices*R]
        for j in range(len(slice_offsets) - 1):
            c0, c1 = slice_offsets[j], slice_offsets[j + 1]
            w = b[run.lo : run.hi, c0:c1, :r].float()  # [(hi-lo), c1-c0, r]: a view for fp32
            res = torch.bmm(t[:, :, j * r_max : j * r_max + r], w.transpose(1, 2))
            _accumulate(y[:, c0:c1], res, run)
    return y


def _accumulate(y_cols: torch.Tensor, res: torch.Tensor, run: _Run) -> None:
    """y_cols[run rows] += res (fp32), rounding once into y's dtype."""
    if run.row_range is not None:
        # in-place add promotes to fp32 and rounds once on store
        y_cols[run.row_range[0] : run.row_range[1]].add_(res.reshape(-1, res.shape[-1]))
        return
    delta = _valid(res, run)
    if y_cols.dtype == torch.float32:
        y_cols.index_add_(0, run.rows, delta)
    else:
        y_cols[run.rows] = (y_cols[run.rows] + delta).to(y_cols.dtype)
