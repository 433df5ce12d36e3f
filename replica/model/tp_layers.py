"""What the model calls under tensor parallelism: one rank's shard and its collectives.

Column-parallel projections (q/k/v, gate/up) need nothing from here: a LoRALinear
over the rank's rows of W and of B, with A whole, computes the rank's output columns
from the replicated input without communicating.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

import kernels
from kernels import SegmentInfo
from replica.model.lora import LoRABuffers, LoRAWorkspace, linear
from replica.model.quant_weights import PackedLinear
from replica.model.tp_comm import TPComm
from replica.model.tp_shard import TPShard


@dataclass
class TPRank:
    shard: TPShard
    comm: TPComm

    def row_linear(
        self,
        weight: torch.Tensor | PackedLinear,
        lora: LoRABuffers | None,
        bias: torch.Tensor | None = None,
    ) -> RowParallelLoRALinear:
        return RowParallelLoRALinear(weight, lora, self, bias)

    def embed(self, ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Vocab-parallel lookup: each rank embeds the ids in its rows, zeros for the
        rest, and the all-reduce adds the ranks' parts. ids [T] -> [T, hidden]."""
        start, _ = self.shard.vocab_range
        local = ids - start
        outside = (local < 0) | (local >= weight.shape[0])
        x = F.embedding(local.masked_fill(outside, 0), weight)
        x.masked_fill_(outside.unsqueeze(-1), 0)
        return self.comm.all_reduce(x, "embed")

    def gather_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """[N, vocab_rows] on each rank -> [N, vocab] on every rank (padding cut)."""
        return self.comm.all_gather(logits, "logits")[:, : self.shard.spec.vocab_size]


class RowParallelLoRALinear:
    """y = x Wᵀ + per-segment LoRA, with x and W split by input across ranks (o, down).

    x Aᵀ over this rank's input columns is a partial sum of the [T, r] intermediate:
    it is all-reduced (the only communication LoRA adds), then each rank expands into
    its own output columns (its rows of B), and the base output's all-reduce sums the
    ranks' partial outputs and their disjoint LoRA columns in one go. A bias (whole on
    every rank) is added once, after that all-reduce."""

    def __init__(
        self,
        weight: torch.Tensor | PackedLinear,
        lora: LoRABuffers | None,
        tp: TPRank,
        bias: torch.Tensor | None = None,  # [out]
    ) -> None:
        self.weight, self.lora, self.comm = weight, lora, tp.comm  # weight [out, in / N]
        self.bias = bias
        self.cols = slice(*tp.shard.hidden_range)

    def __call__(
        self, x: torch.Tensor, seg: SegmentInfo, workspace: LoRAWorkspace | None = None
    ) -> torch.Tensor:
        y = linear(x, self.weight)  # [T, out]: this rank's partial sum
        if self.lora is not None and seg.has_lora:
            out = None if workspace is None else workspace.region(self.lora)
            inter = kernels.lora_shrink(x, self.lora.a, seg, self.lora.max_rank, out=out)
            self.comm.all_reduce(inter, "lora")
            kernels.lora_expand(y[:, self.cols], inter, self.lora.b, seg, self.lora.slice_offsets)
        y = self.comm.all_reduce(y, "layer")
        return y if self.bias is None else y + self.bias
