"""What one tensor-parallel rank holds of every weight and adapter (Megatron + S-LoRA).

Pure arithmetic on the model's shape: no devices, no communication.

  column-parallel (output split): q/k/v (by attention heads), gate/up.
      LoRA: A whole (each rank computes the small x·Aᵀ itself), B split by output rows.
  row-parallel (input split): o, down; the partial outputs are all-reduced.
      LoRA: A split by input columns, so x·Aᵀ is a partial sum: the [tokens, r]
      intermediate is all-reduced; B split by output rows: each rank adds only its
      own output columns before the base layer's all-reduce. LoRA thus costs one
      [tokens, r] all-reduce per row-parallel layer and nothing anywhere else.
  vocab-parallel: embedding and lm_head rows, padded up to a multiple of tp_size.
  replicated: norms, rotary tables, MoE routers.
  experts: every rank holds every expert's share of moe_intermediate_size, split like
      the dense MLP (gate/up by output rows, down by input columns; their LoRA likewise).
      gpt-oss's MXFP4 experts keep one scale per 32 of down's input columns: a rank whose
      columns start or end inside a group holds that whole group (expert_held_range), and
      for the columns it borrows zero gate/up rows, biases and gate/up LoRA B rows (down
      LoRA A's columns present, zero). The clamped SwiGLU of a zero gate is exactly 0
      (gate·sigmoid(alpha·gate) = 0, times up + 1, up clamped finite), so the borrowed
      columns add nothing to the rank's partial down sum and the all-reduce gives the
      unsplit answer, as vLLM's padded intermediate does. Ranks' expert widths may then
      differ by a group; the memory plan takes the widest (widest_shard).
  linear attention (Gated DeltaNet, hybrid models): by heads. in_proj_qkv, in_proj_z,
      in_proj_b, in_proj_a column-parallel (q and k rows of the rank's key heads, v, z,
      b, a rows of its value heads: value head h reads key head h // (HV / HK) on the
      same rank), the conv taps, A_log and dt_bias likewise, out_proj row-parallel; the
      gated norm (per head dim) replicated; each rank keeps the state of its heads.

KV heads are split across ranks; with fewer KV heads than ranks, each rank keeps a
copy of the one KV head its query heads attend with.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TypeVar

import torch

from replica.model.hybrid import LINEAR_IN_MODULES
from replica.model.quant_shares import expert_group, quantization_cuts
from replica.model.spec import ModelConfigError, ModelSpec

COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW_PARALLEL = ("o_proj", "down_proj")
LINEAR_COLUMN_PARALLEL = LINEAR_IN_MODULES

Array = TypeVar("Array")  # a torch tensor or a numpy array: basic slicing (and a copy)


@dataclass(frozen=True)
class TPShard:
    spec: ModelSpec  # the whole model's shape
    rank: int
    size: int

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank {self.rank} outside tp_size {self.size}")
        s, n = self.spec, self.size
        problems = [
            f"{field}={value} is not a multiple of {n}"
            for field, value in (
                ("num_attention_heads", s.num_heads),
                ("intermediate_size", s.intermediate_size),
                ("hidden_size", s.hidden_size),
                ("moe_intermediate_size", s.moe_intermediate_size),
                ("shared_expert_intermediate_size", s.shared_expert_size),
            )
            if value % n
        ]
        linear = s.linear_attention
        if linear is not None:
            problems += [
                f"{field}={value} is not a multiple of {n}"
                for field, value in (("linear_num_key_heads", linear.num_key_heads),
                                     ("linear_num_value_heads", linear.num_value_heads))
                if value % n
            ]  # fmt: skip
        if s.num_kv_heads % n and n % s.num_kv_heads:
            problems.append(f"num_key_value_heads={s.num_kv_heads} neither divides nor is a "
                            f"multiple of {n}")  # fmt: skip
        if problems:
            raise ModelConfigError(f"tp_size={n} cannot split the model: {'; '.join(problems)}")
        for layer in range(s.num_layers):  # layers of their own shapes (Gemma 4): each splits
            self.layer(layer)
        cuts = self.quantization_cuts()
        if cuts:
            more = f" (and {len(cuts) - 1} more)" if len(cuts) > 1 else ""
            raise ModelConfigError(f"tp_size={n} cannot split the quantized model: {cuts[0]}{more}")

    def quantization_cuts(self) -> list[str]:
        """Each packed projection whose share on this rank would cut a scale block, a group
        or a packed word (model/quant_shares.py)."""
        return quantization_cuts(self)

    def layer(self, layer: int) -> TPShard:
        """This rank's shard of `layer` alone, of the layer's own shapes (itself when every
        layer has the same: ModelSpec.layer)."""
        own = self.spec.layer(layer)
        return self if own is self.spec else TPShard(own, self.rank, self.size)

    @property
    def local_spec(self) -> ModelSpec:
        """The shape this rank computes with: its heads, KV heads and MLP columns (each
        layer's own too, where layers differ; a hybrid model's linear-attention heads)."""
        s, n = self.spec, self.size
        linear = s.linear_attention
        if linear is not None:
            linear = replace(linear, num_key_heads=linear.num_key_heads // n,
                             num_value_heads=linear.num_value_heads // n)  # fmt: skip
        return replace(
            s,
            linear_attention=linear,
            num_heads=s.num_heads // n,
            num_kv_heads=self.kv_heads,
            intermediate_size=s.intermediate_size // n,
            moe_intermediate_size=self.expert_held_width,
            shared_expert_size=s.shared_expert_size // n,
            layer_kv_heads=tuple(max(1, k // n) for k in s.layer_kv_heads),
            layer_intermediate_sizes=tuple(i // n for i in s.layer_intermediate_sizes),
        )

    @property
    def expert_range(self) -> tuple[int, int]:
        """Each expert's intermediate columns on this rank (rows of its gate/up, columns
        of its down)."""
        return self._split(self.spec.moe_intermediate_size)

    @property
    def expert_held_range(self) -> tuple[int, int]:
        """The intermediate columns this rank holds of each expert: expert_range rounded
        out to whole groups where the experts' down_proj keeps a scale per group of its
        inputs (gpt-oss's MXFP4: quant_shares.expert_group), else expert_range."""
        (lo, hi), group = self.expert_range, expert_group(self.spec)
        return lo // group * group, -(-hi // group) * group

    @property
    def expert_held_width(self) -> int:
        """How many intermediate columns of each expert this rank holds."""
        lo, hi = self.expert_held_range
        return hi - lo

    def hold_expert_columns(self, t: Array, dim: int) -> Array:
        """`t`'s expert_held_range along `dim` (intermediate columns: gate/up rows and
        their biases, gate/up LoRA B rows, down LoRA A columns), the columns this rank
        borrows and does not own zeroed: a view when it borrows none, else a copy."""
        (lo, hi), (h0, h1) = self.expert_range, self.expert_held_range
        at = (slice(None),) * dim
        held = t[at + (slice(h0, h1),)]
        if (h0, h1) == (lo, hi):
            return held
        held = held.clone() if isinstance(held, torch.Tensor) else held.copy()
        held[at + (slice(0, lo - h0),)] = 0
        held[at + (slice(hi - h0, h1 - h0),)] = 0
        return held

    @property
    def shared_expert_range(self) -> tuple[int, int]:
        """The shared expert's intermediate columns on this rank (Qwen3.5-MoE)."""
        return self._split(self.spec.shared_expert_size)

    @property
    def head_range(self) -> tuple[int, int]:
        """The query heads this rank holds."""
        return self._split(self.spec.num_heads)

    @property
    def kv_heads(self) -> int:
        """KV heads on this rank: a share, or one replicated head when there are fewer."""
        return max(1, self.spec.num_kv_heads // self.size)

    def out_range(self, module: str) -> tuple[int, int]:
        """Rows of a column-parallel module's weight (and of its LoRA B) on this rank."""
        s = self.spec
        if module == "q_proj":  # by heads (with an output gate, [q_h, gate_h] per head)
            return self._split(s.q_proj_size)
        if module in ("k_proj", "v_proj"):
            first = self.rank * s.num_kv_heads // self.size  # the head our query heads use
            return first * s.head_dim, (first + self.kv_heads) * s.head_dim
        if module in ("gate_proj", "up_proj"):
            return self._split(s.intermediate_size)
        if module in ("in_proj_z", "in_proj_b", "in_proj_a"):  # by value heads
            per_head = s.linear_attention.value_head_dim if module == "in_proj_z" else 1
            lo, hi = self.value_head_range
            return lo * per_head, hi * per_head
        raise ValueError(f"{module} is not column-parallel")

    @property
    def value_head_range(self) -> tuple[int, int]:
        """The linear-attention value heads this rank holds."""
        return self._split(self.spec.linear_attention.num_value_heads)

    def qkv_rows(self) -> list[tuple[int, int]]:
        """This rank's row ranges of in_proj_qkv (and of the conv's channels): its key
        heads' q rows, their k rows, its value heads' v rows."""
        linear = self.spec.linear_attention
        q0, q1 = self._split(linear.key_dim)
        v0, v1 = self._split(linear.value_dim)
        k = linear.key_dim
        return [(q0, q1), (k + q0, k + q1), (2 * k + v0, 2 * k + v1)]

    def in_range(self, module: str) -> tuple[int, int]:
        """Columns of a row-parallel module's weight (and of its LoRA A) on this rank."""
        if module == "o_proj":
            return self._split(self.spec.q_size)
        if module == "down_proj":
            return self._split(self.spec.intermediate_size)
        if module == "out_proj":
            return self._split(self.spec.linear_attention.value_dim)
        raise ValueError(f"{module} is not row-parallel")

    @property
    def hidden_range(self) -> tuple[int, int]:
        """Output columns of row-parallel layers this rank adds LoRA to (its rows of B)."""
        return self._split(self.spec.hidden_size)

    @property
    def vocab_rows(self) -> int:
        """Embedding / lm_head rows per rank: vocab_size rounded up to a multiple of size."""
        return -(-self.spec.vocab_size // self.size)

    @property
    def vocab_range(self) -> tuple[int, int]:
        """Token ids this rank embeds and scores; the last rank's may run past the vocab."""
        return self.rank * self.vocab_rows, (self.rank + 1) * self.vocab_rows

    def lora_shapes(self, layer: int | None = None) -> dict[str, tuple[int, int]]:
        """(in_features, out_features) of this rank's LoRA A [r, in] and B [out, r]: the
        layers' projections (`layer`'s own where layers differ), then the vocabulary
        modules (the embedding LoRA whole on every rank, added after the embedding's
        all-reduce; the head's B by vocab rows)."""
        if layer is not None and self.layer(layer) is not self:
            return self.layer(layer).lora_shapes()
        whole = self.spec.module_shapes()
        h = self.spec.hidden_size
        shapes = {"embed_tokens": (self.spec.vocab_size, h), "lm_head": (h, self.vocab_rows)}
        for m in COLUMN_PARALLEL:
            start, stop = self.out_range(m)
            shapes[m] = (whole[m][0], stop - start)
        for m in ROW_PARALLEL:
            start, stop = self.in_range(m)
            shapes[m] = (stop - start, self.spec.hidden_size // self.size)
        if self.spec.linear_attention is not None:
            for m in LINEAR_COLUMN_PARALLEL:
                rows = self.qkv_rows() if m == "in_proj_qkv" else [self.out_range(m)]
                shapes[m] = (h, sum(stop - start for start, stop in rows))
            start, stop = self.in_range("out_proj")
            shapes["out_proj"] = (stop - start, h // self.size)
        for name, parts in self.spec.fused_modules().items():  # held fused: its parts' rows
            shapes[name] = (whole[parts[0]][0], sum(shapes[p][1] for p in parts))
        shapes |= self.spec.per_layer_input_shapes()  # replicated: their LoRA whole
        if self.spec.num_experts:  # one expert's held columns, like the dense MLP's share
            i = self.expert_held_width
            shapes |= {"expert_gate_proj": (h, i), "expert_up_proj": (h, i),
                       "expert_down_proj": (i, h // self.size)}  # fmt: skip
        return shapes

    def slice_lora(
        self, module: str, a: Array, b: Array, layer: int | None = None
    ) -> tuple[Array, Array]:
        """This rank's (A [r, in], B [out, r]) of one module's adapter weights in `layer`
        (needed where layers differ in shape): views (the head's B of the last rank may be
        short of vocab_rows: the arena's rows past the vocabulary stay zero), copies of
        the experts' where the rank borrows columns (hold_expert_columns)."""
        if layer is not None and 0 <= layer < self.spec.num_layers:
            shard = self.layer(layer)
            if shard is not self:
                return shard.slice_lora(module, a, b)
        if module == "embed_tokens" or module in self.spec.per_layer_input_shapes():
            return a, b  # replicated modules: their LoRA whole on every rank
        if module == "lm_head":
            start, stop = self.vocab_range
            return a, b[start:stop]
        if module in COLUMN_PARALLEL or module in LINEAR_COLUMN_PARALLEL:
            if module == "in_proj_qkv":
                return a, b[[r for lo, hi in self.qkv_rows() for r in range(lo, hi)]]
            start, stop = self.out_range(module)
            return a, b[start:stop]
        fused = self.spec.fused_modules()
        if module in fused:  # B's rows: each part's share, from its rows of the fused B
            rows, first, whole = [], 0, self.spec.module_shapes()
            for part in fused[module]:
                start, stop = self.out_range(part)
                rows.extend(range(first + start, first + stop))
                first += whole[part][1]
            return a, b[rows]
        if module in ("expert_gate_proj", "expert_up_proj"):  # A [E, r, H], B [E, I, r]
            return a, self.hold_expert_columns(b, 1)
        if module == "expert_down_proj":  # A [E, r, I], B [E, H, r]
            h0, h1 = self.hidden_range
            return self.hold_expert_columns(a, 2), b[:, h0:h1]
        i0, i1 = self.in_range(module)
        h0, h1 = self.hidden_range
        return a[:, i0:i1], b[h0:h1]

    def _split(self, total: int) -> tuple[int, int]:
        part = total // self.size
        return self.rank * part, (self.rank + 1) * part


def widest_shard(spec: ModelSpec, size: int) -> TPShard:
    """The rank of `size` that holds the most (the memory plan's: every rank must fit):
    rank 0, unless ranks borrow MXFP4 groups (expert_held_range) and another holds more
    expert columns (a group of them outweighs the down biases only rank 0 holds; ranks
    differ in nothing else)."""
    first = TPShard(spec, 0, size)
    if expert_group(spec) == 1:
        return first
    shards = [first] + [replace(first, rank=r) for r in range(1, size)]
    return max(shards, key=lambda shard: shard.expert_held_width)  # the first of the widest
