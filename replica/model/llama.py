"""Our serving implementation of the Llama family (Llama, Mistral, Qwen2 layouts).

transformers supplies nothing here: weights come from safetensors, the
forward is ours. One forward runs a flattened batch of variable-length
sequences, prefill and decode mixed, over the engine's paged KV cache.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from kernels import SegmentInfo
from replica.model.attention import AttentionMetadata, paged_attention
from replica.model.kv_cache import KVCache
from replica.model.lora import LoRALinear, LoRAWorkspace
from replica.model.lora_slots import LoRASlotBuffers
from replica.model.rope import RotaryEmbedding
from replica.model.spec import ModelSpec, load_model_spec
from replica.model.tp_layers import TPRank
from replica.model.tp_shard import ShardedCheckpoint
from replica.model.weights import Checkpoint


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64: new tokens of every sequence, segment by segment
    positions: torch.Tensor  # [T] int64: absolute position of each token
    attn: AttentionMetadata
    lora: dict[str, SegmentInfo]  # per projection group: one segment per sequence, token order


class RMSNorm:
    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        self.weight, self.eps = weight, eps

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class DecoderLayer:
    def __init__(
        self,
        spec: ModelSpec,  # this rank's shapes (a tensor-parallel rank's share of heads, MLP)
        ckpt: Checkpoint | ShardedCheckpoint,
        index: int,
        lora: LoRASlotBuffers | None,
        device: torch.device,
        dtype: torch.dtype,
        tp: TPRank | None = None,
    ) -> None:
        self.spec = spec
        p = f"model.layers.{index}."
        h, q, kv, i = spec.hidden_size, spec.q_size, spec.kv_size, spec.intermediate_size

        def w(name: str, shape: tuple[int, ...]) -> torch.Tensor:
            return ckpt.get(p + name, shape).to(device=device, dtype=dtype)

        qkv_w = torch.cat([w("self_attn.q_proj.weight", (q, h)),
                           w("self_attn.k_proj.weight", (kv, h)),
                           w("self_attn.v_proj.weight", (kv, h))])  # fmt: skip
        qkv_b = None
        if spec.qkv_bias:
            qkv_b = torch.cat([w("self_attn.q_proj.bias", (q,)),
                               w("self_attn.k_proj.bias", (kv,)),
                               w("self_attn.v_proj.bias", (kv,))])  # fmt: skip
        gate_up_w = torch.cat([w("mlp.gate_proj.weight", (i, h)), w("mlp.up_proj.weight", (i, h))])
        bufs = lora.layers[index] if lora is not None else {}
        self.qkv_proj = LoRALinear(qkv_w, qkv_b, bufs.get("qkv_proj"))
        o_w, down_w = w("self_attn.o_proj.weight", (h, q)), w("mlp.down_proj.weight", (h, i))
        self.gate_up_proj = LoRALinear(gate_up_w, None, bufs.get("gate_up_proj"))
        if tp is None:
            self.o_proj = LoRALinear(o_w, None, bufs.get("o_proj"))
            self.down_proj = LoRALinear(down_w, None, bufs.get("down_proj"))
        else:  # input-split: partial outputs summed across ranks
            self.o_proj = tp.row_linear(o_w, bufs.get("o_proj"))
            self.down_proj = tp.row_linear(down_w, bufs.get("down_proj"))
        self.input_norm = RMSNorm(w("input_layernorm.weight", (h,)), spec.rms_norm_eps)
        self.post_attn_norm = RMSNorm(w("post_attention_layernorm.weight", (h,)), spec.rms_norm_eps)
        self.index = index

    def __call__(
        self,
        x: torch.Tensor,
        batch: ForwardBatch,
        rope: RotaryEmbedding,
        kv: KVCache,
        ws: LoRAWorkspace | None,
    ) -> torch.Tensor:
        s = self.spec
        t = x.shape[0]
        qkv = self.qkv_proj(self.input_norm(x), batch.lora["qkv_proj"], ws)
        q, k, v = qkv.split([s.q_size, s.kv_size, s.kv_size], dim=-1)
        q = q.view(t, s.num_heads, s.head_dim)
        k = k.view(t, s.num_kv_heads, s.head_dim)
        v = v.view(t, s.num_kv_heads, s.head_dim)
        q, k = rope.apply(q, k, batch.positions)
        attn = paged_attention(
            q, k, v, kv.k[self.index], kv.v[self.index], batch.attn,
            s.head_dim**-0.5, s.sliding_window,
        )  # fmt: skip
        x = x + self.o_proj(attn.reshape(t, s.q_size), batch.lora["o_proj"], ws)
        gate_up = self.gate_up_proj(self.post_attn_norm(x), batch.lora["gate_up_proj"], ws)
        gate, up = gate_up.chunk(2, dim=-1)
        return x + self.down_proj(F.silu(gate) * up, batch.lora["down_proj"], ws)


class LlamaForCausalLM:
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
    ) -> None:
        self.spec = spec = spec or load_model_spec(model_dir)
        self.device, self.dtype, self.tp = torch.device(device), dtype, tp
        self.lora_cols = 0 if lora is None else lora.workspace_cols
        ckpt = Checkpoint(model_dir)
        h, vocab, layer_spec = spec.hidden_size, spec.vocab_size, spec
        if tp is not None:
            ckpt = ShardedCheckpoint(ckpt, tp.shard)
            vocab, layer_spec = tp.shard.vocab_rows, tp.shard.local_spec
        self.embed = ckpt.get("model.embed_tokens.weight", (vocab, h)).to(self.device, dtype)
        self.layers = [
            DecoderLayer(layer_spec, ckpt, i, lora, self.device, dtype, tp)
            for i in range(spec.num_layers)
        ]
        self.norm = RMSNorm(
            ckpt.get("model.norm.weight", (h,)).to(self.device, dtype), spec.rms_norm_eps
        )
        if spec.tie_word_embeddings:
            self.lm_head = self.embed
        else:
            self.lm_head = ckpt.get("lm_head.weight", (vocab, h)).to(self.device, dtype)
        self.rope = RotaryEmbedding(
            spec.head_dim, spec.max_position_embeddings, spec.rope_theta, spec.rope_scaling,
            self.device, dtype,
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
        ws = None  # one zeroed intermediate for every LoRA projection of the step
        if self.lora_cols and any(seg.has_lora for seg in batch.lora.values()):
            ws = LoRAWorkspace(x.shape[0], self.lora_cols, x.device)
        for i, layer in enumerate(self.layers):
            x = layer(x, batch, self.rope, kv, ws)
            if layer_done is not None:
                layer_done(i)
        if logit_rows is not None:
            x = x.index_select(0, logit_rows)
        logits = F.linear(self.norm(x), self.lm_head)
        return (logits if tp is None else tp.gather_logits(logits)).float()
