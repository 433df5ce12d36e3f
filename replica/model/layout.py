"""Where a family's checkpoint keeps each tensor, and reading this rank's part of it.

The decoder asks for a projection by its module name (q_proj, gate_proj, ...); this module
knows the checkpoint's prefix (model., or a multimodal checkpoint's language model) and
whether the module is stored alone or as rows of a fused tensor (Phi-3's qkv_proj and
gate_up_proj), and under tensor parallelism reads only the rows or columns the rank holds.
A sparse layer's router and experts are read from the Hub's per-expert keys
(`<moe_block>.gate.weight`, `<moe_block>.experts.{e}.<gate|up|down>.weight`) and stacked,
or, for gpt-oss, from its stacked experts (`mlp.experts.gate_up_proj` [E, hidden, 2I]
with gate and up columns interleaved, `down_proj` [E, I, hidden], their biases) or the
Hub's MXFP4 form of them (`*_blocks`, `*_scales`), kept packed as kernels.Mxfp4Weight
stacks (gate, up, down) as other quantized experts are. A quantized checkpoint's
projections come packed per module (dense where its config ignores them), a Gated
DeltaNet's in_proj_qkv under tensor parallelism as its q, k and v rows apart (row_parts).
Once the model is built, every checkpoint tensor it did not read must be one of
KNOWN_UNREAD's, each with why it may go unread; any other is an error naming it (a
module this server does not implement would otherwise be served silently without it).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from kernels import Mxfp4Weight, QuantizedWeight, stack_experts
from replica.model.quant_config import MXFP4_GROUP, NF4, ModuleFormat
from replica.model.quant_weights import read_packed
from replica.model.spec import ModelSpec
from replica.model.tp_shard import TPShard
from replica.model.weights import Checkpoint, DummyCheckpoint, WeightLoadError

Range = tuple[int, int]
# A quantized Linear's tensors beside (or instead of) its weight, in the served formats
PACKED_TENSORS = ("weight_scale_inv", "weight_scale", "weight_packed", "qweight",
                  "weight.absmax")  # fmt: skip
LM_HEADS = ("lm_head.weight", "language_model.lm_head.weight")


@dataclass(frozen=True)
class KnownUnread:
    pattern: str  # a regular expression matched at the start of the tensor's name
    arch: str | None  # the model_type whose checkpoints hold it; None: any
    why: str


KNOWN_UNREAD = (
    KnownUnread(r"(.*\.)?rotary_emb\.inv_freq$", None,
                "rotary frequencies, recomputed from config.json's rope parameters"),
    KnownUnread(r"(model\.)?(vision_tower|multi_modal_projector)\.", "gemma3",
                "a multimodal Gemma 3's vision tower and projector: images are not served, "
                "the language model is"),
    KnownUnread(r"model\.(vision_tower|audio_tower|embed_vision|embed_audio)\.", "gemma4",
                "a multimodal Gemma 4's vision and audio towers and their projections: "
                "images and audio are not served, the language model is"),
    *(KnownUnread(r"model\.visual\.", arch,
                  "Qwen3.5's vision tower: images are not served, the language model is")
      for arch in ("qwen3_5", "qwen3_5_moe")),
    *(KnownUnread(r"mtp\.", arch,
                  "Qwen3.5's multi-token-prediction layers: a speculative-decoding head that "
                  "next-token output does not read (speculative decoding is not served)")
      for arch in ("qwen3_5", "qwen3_5_moe")),
)  # fmt: skip


class CheckpointLayout:
    def __init__(
        self, ckpt: Checkpoint | DummyCheckpoint, spec: ModelSpec, shard: TPShard | None = None
    ) -> None:
        self.ckpt, self.spec, self.shard = ckpt, spec, shard
        self.prefix = _find_prefix(ckpt, spec)
        self._fused = {part: (name, parts) for name, parts in spec.fused_modules().items()
                       for part in parts}  # fmt: skip

    def projection(
        self, layer: int, module: str, kind: str = "weight", rows: Range | None = None
    ) -> torch.Tensor | QuantizedWeight:
        """This rank's part of `module`'s weight [out, in] (or bias [out]) in `layer`: a
        tensor, or the packed weight (kernels.quant_formats) of a quantized checkpoint.
        `rows`: these output rows of the whole weight instead (row_parts)."""
        whole = self.spec.layer(layer).module_shapes()
        in_f, out_f = whole[module]
        cols = (0, in_f)
        if rows is None:
            rows = (0, out_f)
            if self.shard is not None:
                shard = self.shard.layer(layer)  # the layer's own shapes' split
                if module in ("o_proj", "down_proj", "out_proj"):
                    cols = shard.in_range(module)
                else:
                    rows = shard.out_range(module)
        if module in self._fused:
            fused, parts = self._fused[module]
            offset = sum(whole[p][1] for p in parts[: parts.index(module)])
            total = sum(whole[p][1] for p in parts)
            rows = (offset + rows[0], offset + rows[1])
            module, out_f = fused, total
        fmt = self.format_of(layer, module)
        if kind == "weight" and fmt is not None:
            name = self.module_path(layer, module)
            return read_packed(self.ckpt, name, fmt, (out_f, in_f), rows, cols)
        name = self._name(layer, module, kind)
        shape = (out_f, in_f) if kind == "weight" else (out_f,)
        if rows != (0, out_f):
            return self.ckpt.get_part(name, shape, 0, *rows)
        if kind == "weight" and cols != (0, in_f):
            return self.ckpt.get_part(name, shape, 1, *cols)
        return self.ckpt.get(name, shape)

    def row_parts(self, layer: int, module: str) -> list[torch.Tensor | QuantizedWeight]:
        """This rank's rows of `module` in `layer` as the parts it holds, in row order: under
        tensor parallelism in_proj_qkv's rows of its q, k and v heads apart (each packed
        part cut along whole blocks), else the one projection."""
        if self.shard is None or module != "in_proj_qkv":
            return [self.projection(layer, module)]
        shard = self.shard.layer(layer)
        return [self.projection(layer, module, rows=rows) for rows in shard.qkv_rows()]

    def format_of(self, layer: int, module: str) -> ModuleFormat | None:
        """How `module` of `layer` is stored: its quantization format, None when dense."""
        return self.format_at(self.module_path(layer, module))

    def format_at(self, path: str) -> ModuleFormat | None:
        """How the Linear at checkpoint path `path` is stored (None: dense), the module
        known by its path under each of the family's prefixes (QuantScheme.format_of)."""
        quant = self.spec.quant
        if quant is None:
            return None
        rel = path.removeprefix(self.prefix)
        return quant.format_of(path, *(p + rel for p in self.spec.weight_prefixes
                                       if p != self.prefix))  # fmt: skip

    def module_path(self, layer: int, module: str) -> str:
        """The checkpoint's path of a projection (its tensors' names less the suffix)."""
        return self.spec.module_path(layer, module, self.prefix)

    def router(self, layer: int, kind: str = "weight") -> torch.Tensor:
        """The router of sparse layer `layer`: [num_experts, hidden] (its bias
        [num_experts]), whole on every rank."""
        s = self.spec
        path = f"{self.prefix}layers.{layer}.{s.moe_block}.{s.router_name}"
        if isinstance(self.ckpt, Checkpoint) and any(
            self.ckpt.has(f"{path}.{packed}") for packed in PACKED_TENSORS
        ):
            raise WeightLoadError(
                f"{self.ckpt.dir}: the router {path!r} is stored quantized: not served (routers "
                "are read unquantized, as published quantized checkpoints keep them; name it "
                "in the config's ignore / modules_to_not_convert and store it dense)"
            )
        shape = (s.num_experts, s.hidden_size) if kind == "weight" else (s.num_experts,)
        return self.ckpt.get(f"{path}.{kind}", shape)

    def shared_expert(
        self, layer: int
    ) -> tuple[torch.Tensor | QuantizedWeight, torch.Tensor | QuantizedWeight,
               torch.Tensor | QuantizedWeight, torch.Tensor]:  # fmt: skip
        """This rank's shared expert of sparse layer `layer` (Qwen3.5-MoE): gate and up
        [S_rank, hidden], down [hidden, S_rank] (each a tensor, or packed as the checkpoint
        stores it), and its gate [1, hidden] whole; S_rank = this rank's columns of
        shared_expert_size."""
        s = self.spec
        h, size = s.hidden_size, s.shared_expert_size
        cut = (0, size) if self.shard is None else self.shard.shared_expert_range
        where = f"{self.prefix}layers.{layer}.mlp.shared_expert"

        def part(module: str, shape: tuple[int, int], dim: int) -> torch.Tensor | QuantizedWeight:
            name = f"{where}.{module}"
            fmt = self.format_at(name)
            if fmt is not None:
                return read_packed(self.ckpt, name, fmt, shape, **{("rows", "cols")[dim]: cut})
            return self.ckpt.get_part(f"{name}.weight", shape, dim, *cut)

        down, gate = part("down_proj", (h, size), 1), self.ckpt.get(f"{where}_gate.weight", (1, h))
        return part("gate_proj", (size, h), 0), part("up_proj", (size, h), 0), down, gate

    def sinks(self, layer: int) -> torch.Tensor:
        """This rank's query heads' sink logits of `layer` (gpt-oss): [heads_rank]."""
        name = f"{self.prefix}layers.{layer}.self_attn.sinks"
        heads = self.spec.num_heads
        lo, hi = (0, heads) if self.shard is None else self.shard.head_range
        return self.ckpt.get(name, (heads,))[lo:hi]

    def expert_biases(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's expert biases of sparse layer `layer` (gpt-oss): gate and up
        [E, 2·I_rank] (laid out as experts() lays out the rows, zero for borrowed
        columns), down [E, hidden]."""
        s = self.spec
        e, h, i = s.num_experts, s.hidden_size, s.moe_intermediate_size
        where = f"{self.prefix}layers.{layer}.mlp.experts"
        gate_up = self.ckpt.get(f"{where}.gate_up_proj_bias", (e, 2 * i))
        return self._split_gate_up(gate_up), self.ckpt.get(f"{where}.down_proj_bias", (e, h))

    def experts(
        self, layer: int
    ) -> tuple[torch.Tensor, torch.Tensor] | tuple[QuantizedWeight, ...]:
        """This rank's experts of sparse layer `layer`, stacked: gate and up rows
        [E, 2·I_rank, hidden] (each expert's gate rows, then its up rows), down
        [E, hidden, I_rank]; I_rank = this rank's columns of moe_intermediate_size (held
        columns, TPShard.expert_held_range: gpt-oss's MXFP4 rounds them out to groups).
        Quantized experts come packed and stacked as (gate, up, down), each [E, ...]."""
        s = self.spec
        if s.expert_layout == "gpt_oss":
            return self._gpt_oss_experts(layer)
        if s.expert_layout == "gemma4":
            return self._gemma4_experts(layer)
        h, i = s.hidden_size, s.moe_intermediate_size
        lo, hi = (0, i) if self.shard is None else self.shard.expert_range
        where = f"{self.prefix}layers.{layer}.{s.moe_block}.experts"
        gate, up, down = s.expert_names
        if self.format_at(f"{where}.0.{gate}") is not None:
            return self._packed_experts(where, (lo, hi))
        gate_up, downs = [], []
        for e in range(s.num_experts):
            parts = [self.ckpt.get_part(f"{where}.{e}.{m}.weight", (i, h), 0, lo, hi)
                     for m in (gate, up)]  # fmt: skip
            gate_up.append(torch.cat(parts))
            downs.append(self.ckpt.get_part(f"{where}.{e}.{down}.weight", (h, i), 1, lo, hi))
        return torch.stack(gate_up), torch.stack(downs)

    def _packed_experts(self, where: str, cols: tuple[int, int]) -> tuple[QuantizedWeight, ...]:
        s = self.spec
        h, i = s.hidden_size, s.moe_intermediate_size
        stacked = []
        for m, shape in zip(s.expert_names, ((i, h), (i, h), (h, i))):
            ws = []
            for e in range(s.num_experts):
                name = f"{where}.{e}.{m}"
                fmt = self.format_at(name)
                if fmt is None or fmt.kind == NF4:
                    raise WeightLoadError(
                        f"{self.ckpt.dir}: expert {name!r} is "
                        f"{'dense beside quantized experts' if fmt is None else 'in NF4'}: "
                        "refused (experts are served in one packed format per layer, not NF4)"
                    )
                part = {"rows": cols} if shape == (i, h) else {"cols": cols}
                ws.append(read_packed(self.ckpt, name, fmt, shape, **part))
            stacked.append(stack_experts(ws))
        return tuple(stacked)

    def _gpt_oss_experts(
        self, layer: int
    ) -> tuple[torch.Tensor, torch.Tensor] | tuple[Mxfp4Weight, ...]:
        """This rank's held columns (TPShard.expert_held_range: whole MXFP4 groups of
        down_proj's inputs), gate/up rows of the columns it borrows zero (code 0 is e2m1's
        +0.0; their scales zeroed too, so no scale byte can make them other than 0)."""
        s = self.spec
        e, h, i = s.num_experts, s.hidden_size, s.moe_intermediate_size
        where = f"{self.prefix}layers.{layer}.mlp.experts"
        lo, hi = (0, i) if self.shard is None else self.shard.expert_held_range
        if isinstance(self.ckpt, DummyCheckpoint):  # "has" every name: the config decides,
            packed = self.format_at(f"{where}.gate_up_proj") is not None  # as for the plan
        else:  # the Hub's MXFP4 stacks (*_blocks, *_scales) in place of the dense ones
            packed = not self.ckpt.has(f"{where}.gate_up_proj")
        if packed:  # kept packed
            blocks, scales = self._mxfp4(f"{where}.gate_up_proj", e, 2 * i, h)
            gate = Mxfp4Weight(*(self._held_rows(t[:, 0::2]) for t in (blocks, scales)))
            up = Mxfp4Weight(*(self._held_rows(t[:, 1::2]) for t in (blocks, scales)))
            blocks, scales = self._mxfp4(f"{where}.down_proj", e, h, i)
            cols = slice(lo // MXFP4_GROUP, hi // MXFP4_GROUP)  # held columns: whole groups
            down = Mxfp4Weight(blocks[:, :, cols].contiguous(), scales[:, :, cols].contiguous())
            return gate, up, down
        # transformers' [E, in, out] stacks
        gate_up = self.ckpt.get(f"{where}.gate_up_proj", (e, h, 2 * i)).transpose(1, 2)
        down = self.ckpt.get(f"{where}.down_proj", (e, i, h)).transpose(1, 2)
        return self._split_gate_up(gate_up), down[:, :, lo:hi].contiguous()

    def _gemma4_experts(
        self, layer: int
    ) -> tuple[torch.Tensor, torch.Tensor] | tuple[QuantizedWeight, ...]:
        """Gemma 4's stacks as transformers holds them: layers.L.experts.gate_up_proj
        [E, 2I, hidden] (gate rows, then up rows) and down_proj [E, hidden, I]; or, from a
        quantized checkpoint that un-fused them (llm-compressor's per-expert layout,
        layers.L.experts.{e}.<gate|up|down>_proj), packed like other families' experts.
        Which of the two: the spec's experts_unfused, as the plan reads it."""
        s = self.spec
        e, h, i = s.num_experts, s.hidden_size, s.moe_intermediate_size
        where = f"{self.prefix}layers.{layer}.experts"
        lo, hi = (0, i) if self.shard is None else self.shard.expert_range
        if s.experts_unfused and s.quant is not None:
            return self._packed_experts(where, (lo, hi))  # refuses one left dense, by name
        gate_up = self.ckpt.get(f"{where}.gate_up_proj", (e, 2 * i, h))
        down = self.ckpt.get(f"{where}.down_proj", (e, h, i))
        gate_up = torch.cat([gate_up[:, lo:hi], gate_up[:, i + lo : i + hi]], dim=1)
        return gate_up, down[:, :, lo:hi].contiguous()

    def _split_gate_up(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gpt-oss's interleaved gate / up rows (gate j at 2j, up j at 2j+1) of
        [E, 2I, ...] -> this rank's held gate rows then its held up rows, [E, 2·I_rank,
        ...], those of borrowed columns zero (_held_rows)."""
        return torch.cat([self._held_rows(gate_up[:, 0::2]), self._held_rows(gate_up[:, 1::2])], 1)

    def _held_rows(self, t: torch.Tensor) -> torch.Tensor:
        """[E, I, ...] -> this rank's held rows [E, I_rank, ...], contiguous, the rows of
        columns it borrows zero (TPShard.hold_expert_columns); all of them unsplit."""
        held = t if self.shard is None else self.shard.hold_expert_columns(t, 1)
        return held.contiguous()

    def _mxfp4(
        self, name: str, experts: int, rows: int, cols: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`name`_blocks [E, rows, cols/32, 16] and `name`_scales [E, rows, cols/32], uint8
        as shipped (an output row's codes and scales together: rows split freely)."""
        if cols % MXFP4_GROUP:
            raise WeightLoadError(
                f"{self.ckpt.dir}: {name}_blocks: MXFP4 needs its input dim ({cols}) to be a "
                "multiple of 32"
            )
        groups = (experts, rows, cols // MXFP4_GROUP)
        blocks = self.ckpt.get_packed(f"{name}_blocks", (*groups, 16), (torch.uint8,))
        scales = self.ckpt.get_packed(f"{name}_scales", groups, (torch.uint8,))
        return blocks, scales

    def replicated_linear(
        self, layer: int | None, module: str, shape: tuple[int, int]
    ) -> torch.Tensor | QuantizedWeight:
        """A Linear held whole on every rank (Gemma 4's per-layer-input gate and projection
        in layer `layer`, its per_layer_model_projection at the model's level: None): its
        weight [out, in] dense, or packed as the checkpoint stores it."""
        where = self.prefix if layer is None else f"{self.prefix}layers.{layer}."
        fmt = self.format_at(where + module)
        if fmt is not None:
            return read_packed(self.ckpt, where + module, fmt, shape)
        return self.ckpt.get(f"{where}{module}.weight", shape)

    def tensor(self, layer: int | None, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """A replicated tensor: `name` of layer `layer`, or of the model (None)."""
        where = self.prefix if layer is None else f"{self.prefix}layers.{layer}."
        return self.ckpt.get(where + name, shape)

    def layer_scalar(self, layer: int) -> torch.Tensor:
        """Gemma 4's stored scalar of `layer`'s output: [1]."""
        return self.tensor(layer, "layer_scalar", (1,))

    def layer_tensor(self, layer: int, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """A tensor `name` of layer `layer` whole (a Gated DeltaNet's norm), or this
        rank's part of one split by heads along dim 0 (its conv taps by the channels of
        in_proj_qkv, A_log and dt_bias by value heads)."""
        name = f"{self.prefix}layers.{layer}.{name}"
        if self.shard is None or name.endswith("norm.weight"):
            return self.ckpt.get(name, shape)
        if name.endswith("conv1d.weight"):
            rows = self.shard.qkv_rows()
        else:
            rows = [self.shard.value_head_range]
        return torch.cat([self.ckpt.get_part(name, shape, 0, lo, hi) for lo, hi in rows])

    def norm(self, layer: int | None, name: str, size: int) -> torch.Tensor:
        """A replicated norm weight: `name` of layer `layer`, or of the model (None)."""
        return self.tensor(layer, name, (size,))

    def vocab(self, lm_head: bool) -> torch.Tensor:
        """The embedding (or untied lm_head): this rank's vocab rows, zero-padded."""
        name = self.prefix + "embed_tokens.weight"
        if lm_head:
            name = next((n for n in LM_HEADS if self.ckpt.has(n)), LM_HEADS[0])
        shape = (self.spec.vocab_size, self.spec.hidden_size)
        if self.shard is None:
            return self.ckpt.get(name, shape)
        start, stop = self.shard.vocab_range
        vocab = self.spec.vocab_size
        t = self.ckpt.get_part(name, shape, 0, min(start, vocab), min(stop, vocab))
        if stop > vocab:  # the last vocab shard: zero rows up to the padded size
            t = torch.cat([t, t.new_zeros(stop - max(start, vocab), *t.shape[1:])])
        return t

    def check_all_read(self) -> None:
        """Raise WeightLoadError naming the checkpoint tensors the model did not read and
        that KNOWN_UNREAD does not explain (a tied model's lm_head copy aside: the
        embedding is the head, as in transformers)."""
        unknown = [n for n in self.ckpt.unread() if not self._known_unread(n)]
        if unknown:
            shown = ", ".join(repr(n) for n in unknown[:3])
            more = f" and {len(unknown) - 3} more" if len(unknown) > 3 else ""
            raise WeightLoadError(
                f"{self.ckpt.dir}: checkpoint tensor {shown}{more} is not used by this "
                f"server's {self.spec.arch} model (a module it does not implement): "
                "refused rather than served without it"
            )

    def _known_unread(self, name: str) -> bool:
        if self.spec.tie_word_embeddings and name in LM_HEADS:
            return True
        if self._borrowed_kv_tensor(name):
            return True
        return any(
            rule.arch in (None, self.spec.arch) and re.match(rule.pattern, name)
            for rule in KNOWN_UNREAD
        )

    def _borrowed_kv_tensor(self, name: str) -> bool:
        """Whether `name` is a k/v projection or norm of a layer that attends over another
        layer's KV (Gemma 4's KV-sharing layers): a checkpoint may hold them, unused, and
        transformers drops them on load too (its _keys_to_ignore_on_load_unexpected)."""
        if not self.spec.kv_sources:
            return False
        where = re.escape(self.prefix)
        m = re.match(rf"{where}layers\.(\d+)\.self_attn\.(k_proj|v_proj|k_norm|v_norm)\.", name)
        return m is not None and self.spec.kv_source(int(m[1])) != int(m[1])

    def _name(self, layer: int, module: str, kind: str) -> str:
        return f"{self.module_path(layer, module)}.{kind}"


def _find_prefix(ckpt: Checkpoint | DummyCheckpoint, spec: ModelSpec) -> str:
    for prefix in spec.weight_prefixes:
        if ckpt.has(prefix + "embed_tokens.weight"):
            return prefix
    tried = ", ".join(p + "embed_tokens.weight" for p in spec.weight_prefixes)
    raise WeightLoadError(f"{ckpt.dir}: missing weight {tried!r} (the token embedding)")
