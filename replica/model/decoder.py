"""Our serving implementation of every supported family: one decoder, read from the spec.

transformers supplies nothing here: weights come from safetensors, the forward is ours.
One forward runs a flattened batch of variable-length sequences, prefill and decode
mixed, over the engine's paged KV cache. What differs between families (norm style and
count, q/k norms, attention scale and soft-caps, sliding layers and their rope, MLP
activation, embedding scale, a sparse layer's experts) is a field of ModelSpec
(model/spec.py), chosen once at load. A layer's MLP is dense (DenseMLP) or a mixture of
experts (model/moe.py's SparseMoE); both take the same inputs. A hybrid model's
linear-attention layers mix tokens by model/gated_deltanet.py's GatedDeltaNet over the
per-sequence state pool instead of attending over KV.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

import kernels
from kernels import QuantizedWeight, SegmentInfo, StateBatch
from replica.model.gated_deltanet import GatedDeltaNet, gated_deltanet
from replica.model.gemma4_moe import Gemma4Experts, moe_beside_mlp
from replica.model.kv_cache import KVCache
from replica.model.layout import CheckpointLayout
from replica.model.lora import LoRABuffers, LoRALinear, LoRAWorkspace
from replica.model.lora_slots import LoRASlotBuffers
from replica.model.moe import SparseMoE
from replica.model.per_layer_inputs import PerLayerInputBlock, PerLayerInputs
from replica.model.quant_weights import fused_weight, on_device, tensors_of
from replica.model.rope import RotaryEmbedding, Rotation
from replica.model.spec import ModelSpec, RopeSpec, load_model_spec
from replica.model.tp_layers import TPRank
from replica.model.weights import open_checkpoint

# -- attention over the paged KV cache, a flattened batch of mixed decode and prefill ---------
#
# Rows [0, num_decode) are decode tokens (one per sequence), attended in one call of
# kernels.paged_decode_attention, which reads the block tables and context lengths on the
# device (on a GPU no per-layer gather, and no shape that depends on the context); each
# prefill (or prefill chunk) follows as its own segment, one call of
# kernels.prefill_attention each: a whole prompt attends to its fresh K/V, a chunk after
# earlier ones or the rest of a prompt after a prefix-cache hit to the cache through its
# slots (lower-right causal). Both ops take the layer's window and soft cap, and every path
# they take is fused or chunked: none holds a [heads, n, ctx] score matrix.


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: cache slot (block*block_size + offset) per new token
    num_decode: int  # host: number of decode sequences (= their tokens), rows [0, num_decode)
    block_size: int  # host: tokens per KV block
    decode_block_tables: torch.Tensor  # [D, W] int32: KV blocks of each decode sequence
    decode_context_lens: torch.Tensor  # [D] int32: tokens in cache incl. the new one
    prefill_starts: list[int]  # host: first row of each prefill segment
    prefill_lens: list[int]  # host: new tokens per prefill segment
    prefill_context_lens: list[int]  # host: tokens in cache after this step, per prefill segment
    prefill_slots: list[torch.Tensor | None]  # per prefill: [ctx] int64 slots; None if ctx == n
    # host: programs sharing each decode sequence's context (kernels.decode_splits); None:
    # chosen from the block table's width
    decode_splits: int | None = None


def paged_attention(
    q: torch.Tensor,  # [T, H, hd]
    k: torch.Tensor | None,  # [T, KVH, hd]; None: already in the cache (see below)
    v: torch.Tensor | None,  # [T, KVH, hd]
    k_cache: torch.Tensor,  # [KVH, slots, hd]
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None,
    soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,  # [H] fp32: each head's sink logit (gpt-oss)
) -> torch.Tensor:
    """Write this step's K/V into the cache, then attend (scores scale·q·k, capped to
    soft_cap·tanh(s/soft_cap) when given; sinks join each head's softmax). Returns
    [T, H, hd]. k and v None: an earlier layer already wrote this step's K/V into these
    caches (Gemma 4's KV-sharing layers), so nothing is written and a whole prompt's keys
    are read back from its slots."""
    if k is not None:
        k_cache.index_copy_(1, meta.slot_mapping, k.transpose(0, 1))
        v_cache.index_copy_(1, meta.slot_mapping, v.transpose(0, 1))
    out = torch.empty_like(q)
    d = meta.num_decode
    if d:
        kernels.paged_decode_attention(
            q[:d], k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens,
            meta.block_size, scale, sliding_window, soft_cap=soft_cap, out=out[:d],
            num_splits=meta.decode_splits, sinks=sinks,
        )  # fmt: skip
    for start, n, slots in zip(meta.prefill_starts, meta.prefill_lens, meta.prefill_slots):
        rows = slice(start, start + n)
        if slots is None and k is None:  # whole prompt, its K/V written by another layer
            fresh = meta.slot_mapping[rows]
            keys, values = k_cache.index_select(1, fresh), v_cache.index_select(1, fresh)
        elif slots is None:  # whole prompt in this step: its fresh K/V, no gather
            keys, values = k[rows].transpose(0, 1), v[rows].transpose(0, 1)  # [KVH, n, hd]
        else:
            keys, values = k_cache, v_cache
        kernels.prefill_attention(
            q[rows], keys, values, scale, slots, sliding_window, soft_cap, out=out[rows],
            sinks=sinks,
        )  # fmt: skip
    return out


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64: new tokens of every sequence, segment by segment
    positions: torch.Tensor  # [T] int64: absolute position of each token
    attn: AttentionMetadata
    lora: dict[str, SegmentInfo]  # per projection group: one segment per sequence, token order
    # lm_head LoRA's segments over the logit rows (None: the rows are every token, use
    # lora["lm_head"]); only with engine.lora_embeddings
    logit_lora: SegmentInfo | None = None
    # the sequences' rows of the linear-attention state pools (hybrid models; else None)
    linear: StateBatch | None = None


class RMSNorm:
    """x̂ = x / rms(x) in fp32; then w·x̂ rounded first (Llama, Qwen), or x̂·(offset+w) in
    fp32 rounded last (`gemma=True`: Gemma's offset 1, Gemma 4's 0)."""

    def __init__(
        self, weight: torch.Tensor, eps: float, gemma: bool = False, offset: float = 1.0
    ) -> None:
        self.weight = offset + weight.float() if gemma else weight
        self.eps, self.gemma = eps, gemma
        # Gemma 4 as transformers writes it: pow(ms, -0.5), not rsqrt (ulps apart)
        self.inv_rms = _pow_inv_rms if gemma and offset == 0.0 else torch.rsqrt

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * self.inv_rms(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.gemma:
            return (h * self.weight).to(x.dtype)
        return self.weight * h.to(x.dtype)


def _pow_inv_rms(mean_square: torch.Tensor) -> torch.Tensor:
    return torch.pow(mean_square, -0.5)


def spec_norm(weight: torch.Tensor, spec: ModelSpec) -> RMSNorm:
    """The family's RMSNorm of `weight`: Llama's w·x̂, Gemma's x̂·(1+w), Gemma 4's x̂·w in
    fp32."""
    if spec.norm_fp32_weight:
        return RMSNorm(weight, spec.rms_norm_eps, gemma=True, offset=0.0)
    return RMSNorm(weight, spec.rms_norm_eps, spec.gemma_norm)


def unit_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) over the last dim in fp32, rounded to x's dtype (a norm without weight:
    Gemma 4's values)."""
    h = x.float()
    return (h * torch.pow(h.pow(2).mean(-1, keepdim=True) + eps, -0.5)).to(x.dtype)


Glu = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (gate, up) -> MLP hidden


def gated_activation(spec: ModelSpec) -> Glu:
    """The MLP's (gate, up) -> hidden: act(gate) · up, or gpt-oss's clamped SwiGLU
    (gate clamped to <= limit, up to [-limit, limit], then (up + 1) · gate ·
    sigmoid(alpha · gate))."""
    if spec.swiglu_limit is not None:
        limit, alpha = spec.swiglu_limit, spec.swiglu_alpha

        def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
            gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
            return (up + 1) * (gate * torch.sigmoid(gate * alpha))

        return clamped_swiglu
    if spec.hidden_act == "gelu_tanh":
        return lambda gate, up: F.gelu(gate, approximate="tanh") * up
    return lambda gate, up: F.silu(gate) * up


class DenseMLP:
    """down(glu(gate(x), up(x))), gate and up as one fused projection, each with LoRA."""

    def __init__(self, gate_up: LoRALinear, down: LoRALinear, glu: Glu) -> None:
        self.gate_up_proj, self.down_proj, self.glu = gate_up, down, glu

    def weights(self) -> list[torch.Tensor]:
        return tensors_of(self.gate_up_proj.weight) + tensors_of(self.down_proj.weight)

    def __call__(
        self, x: torch.Tensor, lora: dict[str, SegmentInfo], ws: LoRAWorkspace | None
    ) -> torch.Tensor:
        gate, up = self.gate_up_proj(x, lora["gate_up_proj"], ws).chunk(2, dim=-1)
        return self.down_proj(self.glu(gate, up), lora["down_proj"], ws)


class DecoderLayer:
    def __init__(
        self,
        spec: ModelSpec,  # this rank's shapes (a tensor-parallel rank's share of heads, MLP)
        layout: CheckpointLayout,
        index: int,
        rope: RotaryEmbedding,
        lora: LoRASlotBuffers | None,
        device: torch.device,
        dtype: torch.dtype,
        tp: TPRank | None = None,
    ) -> None:
        self.spec, self.index, self.rope = spec, index, rope
        self.window, self.soft_cap = spec.window(index), spec.attn_soft_cap

        def proj(module: str, kind: str = "weight") -> torch.Tensor | QuantizedWeight:
            return on_device(layout.projection(index, module, kind), device, dtype)

        def norm(name: str, size: int) -> RMSNorm:
            w = layout.norm(index, name, size).to(device=device, dtype=dtype)
            return spec_norm(w, spec)

        bufs = lora.layers[index] if lora is not None else {}
        self.linear_attn: GatedDeltaNet | None = None
        self.qkv_proj = self.o_proj = self.q_norm = self.k_norm = self.sinks = None
        self.owns_kv = self.k_eq_v = self.v_norm = False
        if spec.is_linear(index):  # a Gated DeltaNet layer: no q/k/v/o, no KV
            self.linear_attn = gated_deltanet(spec, layout, index, bufs, device, dtype, tp)
        else:
            self._init_attention(spec, layout, index, bufs, proj, norm, device, tp)
        glu = gated_activation(spec)
        self.mlp: DenseMLP | SparseMoE
        if spec.is_sparse(index) and not spec.moe_beside_mlp:
            self.mlp = SparseMoE(spec, layout, index, bufs, glu, device, dtype, tp)
        else:
            gate_up_w = fused_weight([proj("gate_proj"), proj("up_proj")])
            down_w = fused_weight([proj("down_proj")])
            gate_up = LoRALinear(gate_up_w, None, bufs.get("gate_up_proj"))
            if tp is None:
                down = LoRALinear(down_w, None, bufs.get("down_proj"))
            else:
                down = tp.row_linear(down_w, bufs.get("down_proj"))
            self.mlp = DenseMLP(gate_up, down, glu)
        h = spec.hidden_size
        self.input_norm = norm("input_layernorm.weight", h)
        self.post_attn_out_norm = self.post_mlp_norm = None
        if spec.sandwich_norms:  # Gemma: attention and MLP outputs normed, then MLP input
            self.post_attn_out_norm = norm("post_attention_layernorm.weight", h)
            self.pre_mlp_norm = norm("pre_feedforward_layernorm.weight", h)
            self.post_mlp_norm = norm("post_feedforward_layernorm.weight", h)
        else:
            self.pre_mlp_norm = norm("post_attention_layernorm.weight", h)
        self.experts = None  # Gemma 4's MoE block: experts beside the dense MLP
        if spec.is_sparse(index) and spec.moe_beside_mlp:
            self.experts = Gemma4Experts(spec, layout, index, bufs, glu, device, dtype, tp)
            self.experts_norms = tuple(norm(f"{n}.weight", h) for n in (
                "post_feedforward_layernorm_1", "pre_feedforward_layernorm_2",
                "post_feedforward_layernorm_2"))  # fmt: skip
        self.per_layer_input = None  # Gemma 4: this layer's share of the per-layer inputs
        if spec.per_layer_input_size:
            self.per_layer_input = PerLayerInputBlock(
                spec, layout, index, bufs, device, dtype, lambda w: spec_norm(w, spec)
            )
        self.scalar = None  # Gemma 4: the layer's output times a stored scalar
        if spec.layer_scalar:
            self.scalar = layout.layer_scalar(index).to(device=device, dtype=dtype)

    def _init_attention(
        self,
        spec: ModelSpec,
        layout: CheckpointLayout,
        index: int,
        bufs: dict[str, LoRABuffers],
        proj: Callable[..., torch.Tensor | QuantizedWeight],
        norm: Callable[[str, int], RMSNorm],
        device: torch.device,
        tp: TPRank | None,
    ) -> None:
        """The attention projections, sinks and q/k norms of layer `index`. The qkv group
        holds the rows of the projections the layer has (spec.qkv_modules): q_proj's
        alone on a layer reading another's KV, q_proj's and k_proj's where values are the
        keys' projection (Gemma 4)."""
        self.owns_kv = spec.kv_source(index) == index  # else: reads an earlier layer's
        self.k_eq_v = self.owns_kv and not spec.has_kv_projection(index, "v_proj")
        self.v_norm = spec.v_norm
        modules = spec.qkv_modules(index)
        qkv_w = fused_weight([proj(m) for m in modules])
        qkv_b = None
        if spec.qkv_bias:
            qkv_b = torch.cat([proj(m, "bias") for m in modules])
        self.qkv_proj = LoRALinear(qkv_w, qkv_b, bufs.get("qkv_proj"))
        o_w = fused_weight([proj("o_proj")])
        o_b = proj("o_proj", "bias") if spec.o_bias else None
        if tp is None:
            self.o_proj = LoRALinear(o_w, o_b, bufs.get("o_proj"))
        else:  # input-split: partial outputs summed across ranks
            self.o_proj = tp.row_linear(o_w, bufs.get("o_proj"), o_b)
        self.sinks = None  # gpt-oss: each head's sink logit, fp32 as the softmax is
        if spec.attn_sinks:
            self.sinks = layout.sinks(index).to(device=device, dtype=torch.float32)
        if spec.qk_norm:
            self.q_norm = norm("self_attn.q_norm.weight", spec.head_dim)
            if self.owns_kv:  # a layer reading another's KV has no k_norm (Gemma 4)
                self.k_norm = norm("self_attn.k_norm.weight", spec.head_dim)

    def weights(self) -> list[torch.Tensor]:
        """Every tensor a step reads in full (bench: bytes per decode step)."""
        norms = (self.input_norm, self.q_norm, self.k_norm, self.post_attn_out_norm,
                 self.pre_mlp_norm, self.post_mlp_norm)  # fmt: skip
        extra = [] if self.per_layer_input is None else self.per_layer_input.weights()
        if self.experts is not None:
            extra += self.experts.weights() + [n.weight for n in self.experts_norms]
        if self.linear_attn is not None:
            mixer = self.linear_attn.weights()
        else:
            mixer = tensors_of(self.qkv_proj.weight) + tensors_of(self.o_proj.weight)
        return mixer + self.mlp.weights() + [n.weight for n in norms if n is not None] + extra

    def __call__(
        self,
        x: torch.Tensor,
        batch: ForwardBatch,
        kv: KVCache,
        ws: LoRAWorkspace | None,
        rotation: Rotation,  # self.rope at batch.positions
        per_layer_input: torch.Tensor | None = None,  # [T, width]: Gemma 4's, this layer's
    ) -> torch.Tensor:
        if self.linear_attn is not None:
            i = self.index
            out = self.linear_attn(self.input_norm(x), batch.lora, ws, batch.linear,
                                   kv.states.conv[i], kv.states.recurrent[i])  # fmt: skip
        else:
            out = self._attend(self.input_norm(x), batch, kv, ws, rotation)
        if self.post_attn_out_norm is not None:
            out = self.post_attn_out_norm(out)
        x = x + out
        out = self.mlp(self.pre_mlp_norm(x), batch.lora, ws)
        if self.experts is not None:
            out = moe_beside_mlp(out, x, self.experts, self.experts_norms, batch.lora, ws)
        if self.post_mlp_norm is not None:
            out = self.post_mlp_norm(out)
        x = x + out
        if self.per_layer_input is not None:
            x = x + self.per_layer_input(x, per_layer_input, batch.lora, ws)
        return x if self.scalar is None else x * self.scalar

    def _attend(
        self,
        h: torch.Tensor,  # [T, hidden]: the input norm's output
        batch: ForwardBatch,
        kv: KVCache,
        ws: LoRAWorkspace | None,
        rotation: Rotation,
    ) -> torch.Tensor:
        """The attention branch's output [T, hidden], before any post-attention norm."""
        s = self.spec
        t, heads, kv_heads, hd = h.shape[0], s.num_heads, s.num_kv_heads, s.head_dim
        # [T, q_proj rows], then k_proj's and v_proj's where the layer has them
        qkv = self.qkv_proj(h, batch.lora["qkv_proj"], ws)
        q_rows = s.q_proj_size
        k = v = None  # None: the source layer wrote this step's K/V, attended there
        if self.owns_kv:
            k = qkv[:, q_rows : q_rows + s.kv_size].view(t, kv_heads, hd)
            # values: v_proj's rows, or the keys' projection before k's norm and rope
            v = k if self.k_eq_v else qkv[:, q_rows + s.kv_size :].view(t, kv_heads, hd)
            if self.v_norm:
                v = unit_rms(v, s.rms_norm_eps)
        gate = None
        if s.attn_output_gate:  # q_proj's rows: [q_h, gate_h] per head
            q_gate = qkv[:, :q_rows].view(t, heads, 2 * hd)
            q, gate = q_gate[..., :hd], q_gate[..., hd:]
            q, k = rotation.rotate(self.q_norm(q)), rotation.rotate(self.k_norm(k))
        elif self.q_norm is None:  # q and k side by side in qkv: rotated as one tensor
            qk = qkv[:, : s.q_size + s.kv_size].view(t, heads + kv_heads, hd)
            q, k = rotation.rotate(qk).split([heads, kv_heads], dim=1)
        else:
            q = rotation.rotate(self.q_norm(qkv[:, : s.q_size].view(t, heads, hd)))
            if self.k_norm is not None:  # a layer reading another's KV has no k_norm
                k = rotation.rotate(self.k_norm(k))
        attn = paged_attention(
            q, k, v, kv.k[self.index], kv.v[self.index], batch.attn,
            s.scale, self.window, self.soft_cap, self.sinks,
        )  # fmt: skip
        if gate is not None:
            attn = attn * torch.sigmoid(gate)
        return self.o_proj(attn.reshape(t, s.q_size), batch.lora["o_proj"], ws)


class CausalLM:
    """Weights and forward of one model replica, or of one rank's shard of it when `tp`
    is given (tensor parallelism: see model/tp_shard.py for who holds what)."""

    def __init__(
        self,
        model_dir: str | Path,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        lora: LoRASlotBuffers | None = None,
        spec: ModelSpec | None = None,
        tp: TPRank | None = None,
        load_format: str = "auto",
    ) -> None:
        """`load_format`: "auto" reads the directory's safetensors, "dummy" makes random
        weights on the device from config.json alone (model/weights.py)."""
        self.spec = spec = spec or load_model_spec(model_dir)
        self.device, self.dtype, self.tp = torch.device(device), dtype, tp
        self.lora_cols = 0 if lora is None else lora.workspace_cols
        self.vocab_lora: dict[str, LoRABuffers] = {} if lora is None else lora.vocab
        rank_spec = spec if tp is None else tp.shard.local_spec
        ckpt = open_checkpoint(model_dir, load_format, self.device, dtype,
                               0.0 if spec.gemma_norm else 1.0)  # fmt: skip
        layout = CheckpointLayout(ckpt, spec, None if tp is None else tp.shard)
        self.embed = layout.vocab(lm_head=False).to(self.device, dtype)
        self.embed_scale = None
        if spec.embed_scale is not None:  # Gemma rounds sqrt(hidden) to the weights' dtype
            self.embed_scale = torch.tensor(spec.embed_scale).to(self.device, dtype)
        self.per_layer_inputs = None  # Gemma 4's per-layer input embeddings
        if spec.per_layer_input_size:
            self.per_layer_inputs = PerLayerInputs(
                spec, layout, self.device, dtype, lambda w: spec_norm(w, spec)
            )
        ropes: list[tuple[tuple[RopeSpec, int], RotaryEmbedding]] = []
        self.layers = []
        for i in range(spec.num_layers):
            layer_spec = rank_spec.layer(i)
            key = (spec.rope(i), layer_spec.rotary_dim)
            rope = next((r for k, r in ropes if k == key), None)
            if rope is None:  # one table per distinct rope (Gemma 3: local and global)
                rope = self._rope(spec.rope(i), layer_spec)
                ropes.append((key, rope))
            self.layers.append(
                DecoderLayer(layer_spec, layout, i, rope, lora, self.device, dtype, tp)
            )
        norm = layout.norm(None, "norm.weight", spec.hidden_size).to(self.device, dtype)
        self.norm = spec_norm(norm, spec)
        if spec.tie_word_embeddings:
            self.lm_head = self.embed
        else:
            self.lm_head = layout.vocab(lm_head=True).to(self.device, dtype)
        self.ropes = [r for _, r in ropes]
        layout.check_all_read()

    def step_weights(self) -> list[torch.Tensor]:
        """The tensors a decode step reads in full (the embedding is gathered by row)."""
        extra = [] if self.per_layer_inputs is None else self.per_layer_inputs.weights()
        layers = [w for lay in self.layers for w in lay.weights()]
        return [self.lm_head, self.norm.weight] + layers + extra

    def _rope(self, rope: RopeSpec, s: ModelSpec | None = None) -> RotaryEmbedding:
        """`rope`'s table for layers of `s`'s head_dim (the model's by default)."""
        s = s or self.spec
        return RotaryEmbedding(
            s.head_dim, s.max_position_embeddings, rope.theta, rope.scaling,
            self.device, self.dtype, rotary_dim=s.rotary_dim,
        )  # fmt: skip

    @torch.inference_mode()
    def forward(
        self,
        batch: ForwardBatch,
        kv: KVCache,
        logit_rows: torch.Tensor | None = None,
        layer_done: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """Run the batch; returns float32 logits [len(logit_rows), vocab] (all rows if None).
        `layer_done(i)` is called once layer i's work is issued (replica.device.StepProgress)."""
        tp = self.tp
        if tp is None:
            x = F.embedding(batch.input_ids, self.embed)
        else:  # vocab-parallel: each rank embeds its ids, an all-reduce sums the parts
            x = tp.embed(batch.input_ids, self.embed)
        embed_lora = self.vocab_lora.get("embed_tokens")
        if embed_lora is not None and batch.lora["embed_tokens"].has_lora:
            # PEFT adds the embedding LoRA before the embedding's scale (Gemma) applies
            seg = batch.lora["embed_tokens"]
            inter = kernels.lora_embedding_shrink(
                batch.input_ids, embed_lora.a, seg, embed_lora.max_rank
            )
            kernels.lora_expand(x, inter, embed_lora.b, seg, embed_lora.slice_offsets)
        if self.embed_scale is not None:
            x = x * self.embed_scale
        per_layer = None  # [T, layers, width]: Gemma 4's per-layer inputs
        if self.per_layer_inputs is not None:
            per_layer = self.per_layer_inputs(batch.input_ids, x)
        ws = None  # one zeroed intermediate for every LoRA projection of the step
        if self.lora_cols and any(seg.has_lora for seg in batch.lora.values()):
            ws = LoRAWorkspace(x.shape[0], self.lora_cols, x.device)
        # each distinct rope's cos and sin gathered once for the step, not once a layer
        rotations = {id(r): r.at(batch.positions) for r in self.ropes}
        for i, layer in enumerate(self.layers):
            mine = None if per_layer is None else per_layer[:, i]
            x = layer(x, batch, kv, ws, rotations[id(layer.rope)], mine)
            if layer_done is not None:
                layer_done(i)
        if logit_rows is not None:
            x = x.index_select(0, logit_rows)
        h = self.norm(x)
        logits = F.linear(h, self.lm_head)
        head_lora = self.vocab_lora.get("lm_head")
        if head_lora is not None:
            every_row = logit_rows is None or batch.logit_lora is None  # then: token order
            seg = batch.lora["lm_head"] if every_row else batch.logit_lora
            if seg.has_lora:  # this rank's vocabulary columns, before the gather
                inter = kernels.lora_shrink(h, head_lora.a, seg, head_lora.max_rank)
                kernels.lora_expand(logits, inter, head_lora.b, seg, head_lora.slice_offsets)
        if layer_done is not None:
            layer_done(len(self.layers))  # "past the head": its LoRA rows may be rewritten
        if tp is not None:
            logits = tp.gather_logits(logits)
        cap = self.spec.final_soft_cap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits.float()
