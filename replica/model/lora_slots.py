"""Device memory for adapter slots: stacked A/B buffers of every layer, rank and scaling per slot.

This class only owns memory and copies weights in; which adapter lives in
which slot is the slot pool's decision. Slot 0 is the base model: it always
holds zeros and rank 0, so a segment on slot 0 adds nothing.
"""

from __future__ import annotations

import numpy as np
import torch

import kernels
from replica.device import StagedBuffer, StepProgress
from replica.model.adapter_weights import LoRAAdapterWeights
from replica.model.lora import MODULE_GROUPS, LoRABuffers
from replica.model.spec import ModelSpec


class LoRASlotBuffers:
    def __init__(
        self,
        spec: ModelSpec,
        num_slots: int,
        max_rank: int,
        device: torch.device,
        dtype: torch.dtype,
        shapes: dict[str, tuple[int, int]] | None = None,
    ) -> None:
        """`shapes`: (in, out) of A [r, in] and B [out, r] per module, when not the whole
        model's (a tensor-parallel rank's share, TPShard.lora_shapes())."""
        if num_slots < 1:
            raise ValueError("num_slots must be >= 1 (slot 0 is the base model)")
        self.spec, self.num_slots, self.max_rank = spec, num_slots, max_rank
        shapes = shapes or spec.module_shapes()
        # layers[i][group] -> LoRABuffers; each owns columns of a step's LoRAWorkspace
        self.layers: list[dict[str, LoRABuffers]] = []
        self.workspace_cols = 0
        for _ in range(spec.num_layers):
            groups = {}
            for group, names in MODULE_GROUPS.items():
                in_f = shapes[names[0]][0]
                offsets = [0]
                for n in names:
                    offsets.append(offsets[-1] + shapes[n][1])
                a = torch.zeros(num_slots, len(names) * max_rank, in_f, device=device, dtype=dtype)
                b = kernels.lora_b_buffer(num_slots, offsets[-1], max_rank, device, dtype)
                groups[group] = LoRABuffers(a, b, offsets, names, self.workspace_cols)
                self.workspace_cols += a.shape[1]
            self.layers.append(groups)
        # Host copies, the source of truth for batch metadata. Ranks are per projection
        # group: 0 where the adapter does not target it, so batches skip reading those slots.
        self.ranks: dict[str, list[int]] = {g: [0] * num_slots for g in MODULE_GROUPS}
        self.scalings = [0.0] * num_slots
        # Rows at or past a slot's dirty rank are zero in every buffer: loads zero only
        # the rows a previous, larger adapter left behind, not the whole slot.
        self._dirty_rank = [0] * num_slots
        # What write() copies into, per layer and group: numpy views of the buffers on CPU
        # (a write is ~100 small copies, and numpy slicing costs a tenth of torch's: the
        # write took 1.3-2.9 ms, mostly indexing, for adapters of 0.85-18.6 MB); the
        # tensors themselves elsewhere.
        self._targets = [
            {g: (_copy_target(buf.a), _copy_target(buf.b)) for g, buf in groups.items()}
            for groups in self.layers
        ]

    def write(
        self, slot: int, adapter: LoRAAdapterWeights, progress: StepProgress | None = None
    ) -> None:
        """Copy `adapter` into `slot` (zero-padding past its rank and untargeted modules).

        The copies are issued on the current stream; callers choose it (the
        prefetcher runs this on a side stream and records an event after). The
        slot's rank stays 0 (invisible to batches) until activate(). With `progress`,
        the slot is one the running step still reads: layer i is written only once
        that step is past layer i."""
        if slot == 0:
            raise ValueError("slot 0 is the pinned base slot and never holds an adapter")
        if adapter.rank > self.max_rank:
            raise ValueError(f"{adapter.name}: rank {adapter.rank} > max_lora_rank {self.max_rank}")
        r, dirty = adapter.rank, self._dirty_rank[slot]
        self._dirty_rank[slot] = max(dirty, r)  # holds even if a copy below fails
        for layer, groups in enumerate(self.layers):
            if progress is not None:
                progress.wait_layer(layer)
            for group, buf in groups.items():
                a, b = self._targets[layer][group]
                a, b = a[slot], b[slot]
                for j, module in enumerate(buf.slice_names):
                    ab = adapter.weights.get((layer, module))
                    r_j = 0 if ab is None else r  # rows of this slice the adapter fills
                    row0 = j * self.max_rank
                    c0, c1 = buf.slice_offsets[j], buf.slice_offsets[j + 1]
                    if dirty > r_j:  # what a larger earlier adapter left past our rank
                        _fill(a[row0 + r_j : row0 + dirty], None)
                        _fill(b[c0:c1, r_j:dirty], None)
                    if ab is not None:
                        _fill(a[row0 : row0 + r], ab[0])
                        _fill(b[c0:c1, :r], ab[1])
        self._dirty_rank[slot] = r

    def activate(self, slot: int, adapter: LoRAAdapterWeights) -> None:
        """Make a written slot visible to batches (main thread, once its copies are done)."""
        for group, names in MODULE_GROUPS.items():
            targeted = any(n in adapter.target_modules for n in names)
            self.ranks[group][slot] = adapter.rank if targeted else 0
        self.scalings[slot] = adapter.scaling

    def clear(self, slot: int) -> None:
        """Forget the slot's adapter (weights stay until overwritten; rank 0 disables them)."""
        for ranks in self.ranks.values():
            ranks[slot] = 0
        self.scalings[slot] = 0.0


class SlotTensors:
    """Slot ranks (per projection group) and scalings where the kernels read them: device
    tensors at fixed addresses, rewritten in place (one copy) only when the values a step
    runs with differ from the last ones sent: after a slot is activated or cleared, or for
    the one step that runs with the view taken before a hand-over."""

    def __init__(self, num_slots: int, device: torch.device) -> None:
        layout = {g: (torch.int32, (num_slots,)) for g in MODULE_GROUPS}
        self._buffer = StagedBuffer(layout | {"scalings": (torch.float32, (num_slots,))}, device)
        self.ranks = {g: self._buffer.device[g] for g in MODULE_GROUPS}
        self.scalings = self._buffer.device["scalings"]
        self._sent: tuple | None = None
        self.uploads = 0  # how often the values changed (tests: not every step)

    def update(self, ranks: dict[str, list[int]], scalings: list[float]) -> None:
        values = (tuple(tuple(ranks[g]) for g in MODULE_GROUPS), tuple(scalings))
        if values == self._sent:
            return
        host = self._buffer.writable()
        for g, group_ranks in zip(MODULE_GROUPS, values[0]):
            host[g].copy_(torch.tensor(group_ranks, dtype=torch.int32))
        host["scalings"].copy_(torch.tensor(values[1], dtype=torch.float32))
        self._buffer.upload()
        self._sent = values
        self.uploads += 1


def _copy_target(buf: torch.Tensor) -> np.ndarray | torch.Tensor:
    """A numpy view of a CPU buffer (bfloat16 has no numpy dtype), else the tensor."""
    if buf.device.type == "cpu" and buf.dtype != torch.bfloat16:
        return buf.numpy()
    return buf


def _fill(dst: np.ndarray | torch.Tensor, src: torch.Tensor | None) -> None:
    """dst = src (or zeros). On CPU through numpy: torch ops issued from the loader
    thread would start a second OpenMP team that measurably slows the step loop's
    compute on the same cores (decode step 57 -> 99 ms); numpy copies use no OpenMP.
    On CUDA a non_blocking copy on the caller's stream."""
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
