"""Device memory for adapters: per projection, arenas of rank rows; per slot, a rank,
a scaling and, per projection group, the arena offset of its rows.

An adapter whose rank in a projection group is r holds r rows there (in a block of
block_rows(r): the next power of two), at one offset per group, the same in every
layer's arenas of that group, so the budget holds adapters at their own rank per group:
a rank-8 adapter takes an eighth of a rank-64 one, and a group it does not target costs
it nothing. This class only owns memory and copies weights in; which adapter lives in
which slot and which rows is the slot pool's decision (replica/adapters). Slot 0 is the
base model: rank 0, no rows, so a segment on slot 0 adds nothing.

A sparse (mixture-of-experts) layer has expert groups (with engine.lora_experts) instead
of the dense MLP's: their arenas hold one block of rows per expert ([num_slices, E *
num_rows, in]), the adapter's expert e at rows e * num_rows + [offset, offset + rank):
the same offset in every block, so one slot offset still names every row it owns, and an
expert adapter takes its real E x (gate, up, down) x rank rows per layer
(replica/adapters/memory.py counts them). Without the setting a sparse layer has no
expert arenas and its experts run without LoRA (such adapters are refused at load).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import torch

import kernels
from replica.device import StepProgress
from replica.model.adapter_weights import VOCAB_LAYER, LoRAAdapterWeights
from replica.model.lora import (
    EXPERT_GROUPS,
    LINEAR_GROUPS,
    MODULE_GROUPS,
    PER_LAYER_INPUT_GROUPS,
    VOCAB_GROUPS,
    LoRABuffers,
    layer_groups,
)
from replica.model.spec import ModelSpec

_EXPERT_MODULES = frozenset(m for names in EXPERT_GROUPS.values() for m in names)
MIN_BLOCK_ROWS = 8  # ranks 1..8 take 8 rows: smaller blocks would only grow the slot tables


def block_rows(rank: int) -> int:
    """Arena rows an adapter of `rank` holds: 0 for rank 0, else the next power of two
    (at least MIN_BLOCK_ROWS). Aligned power-of-two blocks keep fragmentation bounded."""
    if rank <= 0:
        return 0
    return max(MIN_BLOCK_ROWS, 1 << (rank - 1).bit_length())


def arena_rows(num_slots: int, max_rank: int) -> int:
    """Rows of arenas sized for num_slots - 1 adapters of max_rank (slot 0 holds none)."""
    return (num_slots - 1) * block_rows(max(max_rank, 1))


def num_slot_handles(num_rows: int) -> int:
    """Slot 0, one slot per smallest block, and one for a rank-0 adapter (the unpinned
    base): the length of the per-slot tables the kernels read."""
    return num_rows // MIN_BLOCK_ROWS + 2


def adapter_group_ranks(spec: ModelSpec, adapter: LoRAAdapterWeights) -> dict[str, int]:
    """The rank rows `adapter` needs in each projection group it targets (groups it does
    not target left out): its largest module's rank in the group, over every layer
    (LoRAAdapterWeights.group_rank). A function of the weights and the model only, so it
    is computed once, where the adapter is converted, and travels with it: every group
    the model could have is listed (the expert and vocabulary ones too), and whether a
    server builds them is checked at conversion (engine.lora_experts, lora_embeddings)."""
    modules: dict[str, set[str]] = {g: set(names) for g, names in VOCAB_GROUPS.items()}
    for layer in range(spec.num_layers):  # a group's slices may differ by layer (Gemma 4)
        for group, names in layer_groups(spec, layer, experts=True).items():
            modules.setdefault(group, set()).update(names)
    ranks = adapter.module_ranks()  # one pass over the weights, not one per group
    by_group = {g: max((ranks.get(m, 0) for m in names), default=0) for g, names in modules.items()}
    return {g: r for g, r in by_group.items() if r}


# The first arena row of an adapter's block per projection group (an int: the same row
# in every group).
Rows = Mapping[str, int] | int


@dataclass
class SlotTable:
    """The host view of every slot a step runs with, per projection group the ranks (0
    where the adapter does not target it) and first arena rows; the scalings. `version`
    changes with every change of the values (activate, clear), so SlotTensors
    (executor/batch.py) tells a table it has sent from one it has not without comparing
    every value each step."""

    ranks: dict[str, list[int]]
    scalings: list[float]
    offsets: dict[str, list[int]]
    version: int = 0


Shapes = dict[str, tuple[int, int]]  # module -> (in_features, out_features)


class LoRASlotBuffers:
    def __init__(
        self,
        spec: ModelSpec,
        num_slots: int,
        max_rank: int,
        device: torch.device,
        dtype: torch.dtype,
        shapes: Shapes | Callable[[int | None], Shapes] | None = None,
        vocab: bool = False,
        experts: bool = False,
    ) -> None:
        """Arenas of arena_rows(num_slots, max_rank) rows. `shapes`: (in, out) of A [r, in]
        and B [out, r] per module, when not the whole model's (a tensor-parallel rank's
        share: TPShard.lora_shapes, a function of the layer, or its dict for every layer).
        `vocab`: arenas for embed_tokens and lm_head too (engine.lora_embeddings), read
        before the first layer and after the last. `experts`: arenas for a sparse layer's
        experts (engine.lora_experts), E blocks of rows each."""
        if num_slots < 2:
            raise ValueError("num_slots must be >= 2 (slot 0 is the base model)")
        self.spec, self.max_rank, self.expert_lora = spec, max_rank, experts
        self.num_rows = arena_rows(num_slots, max_rank)
        self.num_slots = num_slot_handles(self.num_rows)
        # per layer (Gemma 4's layers differ): a TP rank's shares, TPShard.lora_shapes
        if callable(shapes):
            layer_shapes, whole = shapes, shapes(None)
        elif shapes is not None:
            layer_shapes, whole = (lambda _: shapes), shapes
        else:
            layer_shapes, whole = (lambda i: spec.layer(i).lora_shapes()), spec.lora_shapes()
        # layers[i][group] -> LoRABuffers; each owns columns of a step's LoRAWorkspace
        # (expert groups excepted: their rows are (token, expert) pairs, not tokens)
        self.layers: list[dict[str, LoRABuffers]] = []
        self.workspace_cols = 0
        for layer in range(spec.num_layers):
            groups = {}
            shapes = layer_shapes(layer)
            for group, names in layer_groups(spec, layer, experts=self.expert_lora).items():
                in_f = shapes[names[0]][0]
                offsets = [0]
                for n in names:
                    offsets.append(offsets[-1] + shapes[n][1])
                experts = group in EXPERT_GROUPS
                rows = self.num_rows * (spec.num_experts if experts else 1)
                a = kernels.lora_a_buffer(len(names), rows, in_f, device, dtype)
                b = kernels.lora_b_buffer(offsets[-1], rows, device, dtype)
                buf = LoRABuffers(a, b, offsets, names, max_rank, self.workspace_cols)
                groups[group] = buf
                if not experts:
                    self.workspace_cols += buf.width
            self.layers.append(groups)
        # embed_tokens, lm_head: one slice each, their own intermediates (not the
        # workspace's: the head's rows are the logit rows, not the step's tokens)
        self.vocab: dict[str, LoRABuffers] = {}
        for group in VOCAB_GROUPS if vocab else ():
            in_f, out_f = whole[group]
            a = kernels.lora_a_buffer(1, self.num_rows, in_f, device, dtype)
            b = kernels.lora_b_buffer(out_f, self.num_rows, device, dtype)
            self.vocab[group] = LoRABuffers(a, b, [0, out_f], (group,), max_rank)
        experts = tuple(EXPERT_GROUPS) if spec.num_experts and self.expert_lora else ()
        ple = tuple(PER_LAYER_INPUT_GROUPS) if spec.per_layer_input_size else ()
        linear = tuple(LINEAR_GROUPS) if spec.linear_attention is not None else ()
        # the slot table's rank columns
        self.groups = (*MODULE_GROUPS, *linear, *ple, *experts, *self.vocab)
        # Host copies, the source of truth for batch metadata. Ranks are per projection
        # group: 0 where the adapter does not target it, so batches skip reading those slots.
        n = self.num_slots
        self.table = SlotTable(
            {g: [0] * n for g in self.groups}, [0.0] * n, {g: [0] * n for g in self.groups}
        )
        # What write() copies into, per layer and group: numpy views of the arenas on CPU
        # (a write is ~100 small copies, mostly indexing, and numpy slicing costs a tenth
        # of torch's: docs/performance.md, "Figures behind code choices"); the tensors
        # themselves elsewhere. B as the arena is, [out, P]: an adapter's B
        # [out, r] is then copied as it is staged, contiguous (a transposed source
        # would make torch copy it to pageable memory first and wait for the copy).
        self._targets = [
            {g: (_copy_target(buf.a), _copy_target(buf.b)) for g, buf in groups.items()}
            for groups in [*self.layers, self.vocab]
        ]  # the last entry: the vocabulary modules

    def nbytes(self) -> int:
        """Device bytes of every arena."""
        return sum(
            buf.a.numel() * buf.a.element_size() + buf.b.numel() * buf.b.element_size()
            for groups in [*self.layers, self.vocab]
            for buf in groups.values()
        )

    def view(self) -> SlotTable:
        """A copy of the slot table (what a step runs with while slots change)."""
        t = self.table
        return SlotTable(
            {g: list(r) for g, r in t.ranks.items()},
            list(t.scalings),
            {g: list(o) for g, o in t.offsets.items()},
            t.version,
        )

    def group_ranks(self, adapter: LoRAAdapterWeights) -> dict[str, int]:
        """The rank rows `adapter` needs in each group's arenas (0: none), what the slot
        pool reserves (adapter_group_ranks, every group of these buffers listed)."""
        ranks = adapter_group_ranks(self.spec, adapter)
        return {g: ranks.get(g, 0) for g in self.groups}

    def write(
        self, rows: Rows, adapter: LoRAAdapterWeights, progress: StepProgress | None = None
    ) -> None:
        """Copy `adapter` into each group's arena rows [rows[g], rows[g] + its rank there)
        (zeros for the slices of a targeted group that it does not target: the group's
        rank covers every slice).

        The copies are issued on the current stream; callers choose it (the prefetcher
        runs this on a side stream and records an event after). No slot reads the rows
        until activate(). With `progress`, the rows are ones the running step still
        reads: layer i is written only once that step is past layer i (the embedding
        after layer 0, the head once the step is done with it: "layer" num_layers)."""
        vocab = [g for g in VOCAB_GROUPS if (VOCAB_LAYER, g) in adapter.weights]
        if vocab and not self.vocab:
            raise ValueError(
                f"{adapter.name}: LoRA on {'/'.join(vocab)} needs engine.lora_embeddings"
            )
        if not self.expert_lora and any(m in _EXPERT_MODULES for _, m in adapter.weights):
            raise ValueError(f"{adapter.name}: LoRA on the experts needs engine.lora_experts")
        if adapter.rank > self.max_rank:
            raise ValueError(f"{adapter.name}: rank {adapter.rank} > max_lora_rank {self.max_rank}")
        group_ranks = self.group_ranks(adapter)
        first = _first_rows(rows, group_ranks)
        for g, r in group_ranks.items():
            if r and not 0 <= first[g] <= self.num_rows - r:
                raise ValueError(
                    f"{g}: rows [{first[g]}, {first[g] + r}) outside the arena's {self.num_rows}"
                )
        for layer, groups in enumerate(self.layers):
            if progress is not None:
                progress.wait_layer(layer)
            for group, buf in groups.items():
                if not group_ranks[group]:
                    continue  # rank 0 for this group: its rows are never read
                a, b = self._targets[layer][group]
                blocks = self.spec.num_experts if group in EXPERT_GROUPS else 1
                for j, m in enumerate(buf.slice_names):
                    outs = slice(buf.slice_offsets[j], buf.slice_offsets[j + 1])
                    ab = adapter.weights.get((layer, m))
                    for e in range(blocks):  # expert e's rows: block e of the arenas
                        part = ab if ab is None or blocks == 1 else (ab[0][e], ab[1][e])
                        row0 = e * self.num_rows + first[group]
                        _write_rows(a[j], b[outs], row0, group_ranks[group], part)
        for group in self.vocab:
            if (VOCAB_LAYER, group) not in adapter.weights:
                continue  # rank 0 for this group
            if progress is not None:
                progress.wait_layer(0 if group == "embed_tokens" else len(self.layers))
            a, b = self._targets[-1][group]
            _write_rows(a[0], b, first[group], None, adapter.weights[(VOCAB_LAYER, group)])

    def activate(self, slot: int, rows: Rows, adapter: LoRAAdapterWeights) -> None:
        """Make written rows visible to batches as `slot` (main thread, once the copies
        are done)."""
        if slot == 0:
            raise ValueError("slot 0 is the pinned base slot and never holds an adapter")
        group_ranks = self.group_ranks(adapter)
        first = _first_rows(rows, group_ranks)
        for group, rank in group_ranks.items():
            self.table.ranks[group][slot] = rank
            self.table.offsets[group][slot] = first[group] if rank else 0
        self.table.scalings[slot] = adapter.scaling
        self.table.version += 1

    def clear(self, slot: int) -> None:
        """Forget the slot's adapter (weights stay until overwritten; rank 0 disables them)."""
        for group in self.groups:
            self.table.ranks[group][slot] = 0
            self.table.offsets[group][slot] = 0
        self.table.scalings[slot] = 0.0
        self.table.version += 1


def _first_rows(rows: Rows, group_ranks: dict[str, int]) -> dict[str, int]:
    """Each targeted group's first arena row (an int: the same in every group)."""
    if isinstance(rows, int):
        return dict.fromkeys(group_ranks, rows)
    missing = [g for g, r in group_ranks.items() if r and g not in rows]
    if missing:
        raise ValueError(f"no arena rows given for the groups {missing} the adapter targets")
    return {g: rows.get(g, 0) for g in group_ranks}


def _copy_target(buf: torch.Tensor) -> np.ndarray | torch.Tensor:
    """A numpy view of a CPU buffer (bfloat16 has no numpy dtype), else the tensor."""
    if buf.device.type == "cpu" and buf.dtype != torch.bfloat16:
        return buf.numpy()
    return buf


def _write_rows(
    a: np.ndarray | torch.Tensor,
    b: np.ndarray | torch.Tensor,
    row0: int,
    group_rank: int | None,
    ab: tuple[torch.Tensor, torch.Tensor] | None,
) -> None:
    """One module's (A [r, in], B [out, r]) (None: not targeted here) into the A
    [rows, in] and B [out, rows] views from row0: its own rank's rows, then zeros up to
    the group's rank (a smaller module of the group, a module the adapter does not
    target, or a layer it skips: the group's rank rows are read in every layer, and stale
    rows would be another adapter's weights). group_rank None: its own rows."""
    r = 0 if ab is None else ab[0].shape[0]
    if r:
        _fill(a[row0 : row0 + r], ab[0])
        _fill(b[: ab[1].shape[0], row0 : row0 + r], ab[1])  # a TP head's B may be short
    if group_rank is not None and group_rank > r:
        _fill(a[row0 + r : row0 + group_rank], None)
        _fill(b[:, row0 + r : row0 + group_rank], None)


def _fill(dst: np.ndarray | torch.Tensor, src: torch.Tensor | None) -> None:
    """dst = src (or zeros). On CPU through numpy: torch ops issued from the loader
    thread would start a second OpenMP team that slows the step loop's compute on the
    same cores (docs/performance.md); numpy copies use no OpenMP.
    On CUDA a non_blocking copy on the caller's stream, asynchronous when `src` is
    contiguous in pinned memory (the host cache stages it so)."""
    if isinstance(dst, np.ndarray):
        if src is None:
            dst.fill(0)
        else:  # numpy has no bfloat16: widen it first (fp16/fp32 numpy casts itself)
            host = src.float() if src.dtype == torch.bfloat16 else src
            np.copyto(dst, host.numpy(), casting="same_kind")
    elif src is None:
        dst.zero_()
    else:
        dst.copy_(src, non_blocking=True)
