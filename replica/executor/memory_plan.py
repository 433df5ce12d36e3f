"""The memory plan of one replica rank on a GPU: a pure function of the model's shape, the
engine config and the device's memory, so `lorafleet plan` computes on a laptop what a
replica computes at start.

gpu_memory_utilization of the device, less what is in use there already (the CUDA
context, other processes), is the budget; in vLLM's order it holds

  weights        this rank's share of the model in the engine's dtype, and rotary tables
  activations    the peak working memory of the largest step: max_num_batched_tokens
                 tokens (at most max_model_len) of one prefill chunk ending at
                 max_model_len (the longest context a chunk attends to), with LoRA on and
                 a logit row per token (prompt logprobs), plus the sampler's working
                 copies over max_num_seqs rows. At start a single-rank replica measures
                 the forward's peak (memory_profile.py); elsewhere it is estimated
                 (step_bytes below)
  CUDA graphs    on every rank (TP ranks capture too): the decode graphs' one shared fp32
                 logits buffer [max_num_seqs, vocab], their persistent inputs with block
                 tables as wide as max_model_len, and their memory pool, estimated as one
                 decode step's working memory at the largest bucket (graphs are captured
                 largest first into one pool, so the smaller buckets reuse its blocks):
                 step_bytes at max_num_seqs tokens, no context gathered (the decode kernel
                 reads the cache in place)
  state pool     a hybrid model's linear-attention state (conv and recurrent, per layer)
                 for max_num_seqs sequences and the scratch row: fixed, whatever the
                 context (model/hybrid.py)
  adapter arenas engine.adapters.num_slots or adapter_memory_bytes when set; else
                 ADAPTER_SHARE of what the budget leaves after the three above (never a
                 share of the whole device), at least one and at most MAX_DEFAULT_SLOTS - 1
                 adapters of max_lora_rank
  KV cache       the rest (one block of it the static decode path's scratch block), or
                 engine.kv_cache_bytes when set.

max_model_len (the config's, else the model's context) is honoured when one such sequence
fits the KV cache; otherwise the plan is refused (MemoryPlanError), as is a model whose
weights alone exceed the budget, in one line with the numbers. Only with a KV cache set in
bytes and no max_model_len set is the model's context capped at what the cache holds.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

import torch

from replica.adapters.memory import config_slot_bytes, size_adapter_slots
from replica.config import EngineConfig
from replica.executor.static_decode import static_decode_bytes
from replica.model.kv_cache import KVCache
from replica.model.lora import workspace_columns
from replica.model.lora_slots import arena_rows, block_rows
from replica.model.quant_shares import packed_difference
from replica.model.spec import ModelSpec
from replica.model.tp_shard import widest_shard

MiB, GiB = 2**20, 2**30
CPU_KV_CACHE_BYTES = 256 * MiB  # engine.kv_cache_bytes' default off CUDA
ADAPTER_SHARE = 0.25  # of what weights, activations and graphs leave: the KV cache gets the rest
# `lorafleet plan` on a device nobody uses yet: what the CUDA context (with cuBLAS's
# workspace, outside torch's allocator) takes before our first tensor. At start the
# replica measures it instead.
CUDA_CONTEXT_BYTES = 512 * MiB
# The sampler's working copies per logit of a sampled row: probabilities and a sorted copy
# (fp32) and the sort's indices (int64), beside the logits themselves.
SAMPLER_BYTES_PER_LOGIT = 16


class MemoryPlanError(ValueError):
    """The model and settings do not fit the device; the message says what and by how much."""


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes on one rank, in the order the budget is spent."""

    device_bytes: int  # the device's memory
    gpu_memory_utilization: float
    in_use_bytes: int  # already in use at start (CUDA context, other processes)
    budget_bytes: int  # gpu_memory_utilization of device_bytes, less in_use_bytes
    weights_bytes_per_gpu: int
    activation_bytes: int
    activation_source: str  # "profiled" (measured at start) or "estimated"
    graph_bytes: int  # CUDA graphs' pool and shared logits buffer (0: none captured)
    adapter_memory_bytes: int  # adapter arenas, as allocated
    num_slots: int
    adapter_rows: int  # rank rows of every projection group's arenas
    max_loras_per_batch: int
    kv_cache_bytes: int  # the blocks the allocator hands out (the scratch block aside)
    kv_block_bytes: int
    block_size: int
    max_model_len: int
    tp_size: int
    state_pool_bytes: int = 0  # a hybrid model's per-sequence linear-attention state

    @property
    def num_blocks(self) -> int:
        return self.kv_cache_bytes // self.kv_block_bytes

    @property
    def kv_cache_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def max_concurrency_at_max_model_len(self) -> float:
        """Sequences of max_model_len tokens the KV cache holds at once."""
        return round(self.num_blocks / -(-self.max_model_len // self.block_size), 2)

    @property
    def free_bytes(self) -> int:
        """What the budget leaves unplanned (below one KV block when the cache takes the rest)."""
        return self.budget_bytes - self.planned_bytes

    @property
    def planned_bytes(self) -> int:
        """Everything planned: weights to KV cache, its scratch block included."""
        return (
            self.weights_bytes_per_gpu + self.activation_bytes + self.graph_bytes
            + self.state_pool_bytes + self.adapter_memory_bytes + self.kv_cache_bytes
            + self.kv_block_bytes
        )  # fmt: skip

    def to_json(self) -> dict:
        return asdict(self) | {
            "num_blocks": self.num_blocks,
            "kv_cache_tokens": self.kv_cache_tokens,
            "max_concurrency_at_max_model_len": self.max_concurrency_at_max_model_len,
        }

    def summary(self) -> str:
        """The plan in one line (the replica logs it at start)."""
        return (
            f"memory plan per GPU: budget {gib(self.budget_bytes)} "
            f"(gpu_memory_utilization {self.gpu_memory_utilization:g} of "
            f"{gib(self.device_bytes)}, {gib(self.in_use_bytes)} in use before start); "
            f"weights {gib(self.weights_bytes_per_gpu)}, activations "
            f"{gib(self.activation_bytes)} ({self.activation_source}), CUDA graphs "
            f"{gib(self.graph_bytes)}, "
            + (f"state pool {gib(self.state_pool_bytes)}, " if self.state_pool_bytes else "")
            + f"adapter arenas {gib(self.adapter_memory_bytes)} "
            f"({self.adapter_rows} rank rows per projection group), KV cache "
            f"{gib(self.kv_cache_bytes)}: {self.kv_cache_tokens:,} tokens in "
            f"{self.num_blocks:,} blocks of {self.block_size}, "
            f"{self.max_concurrency_at_max_model_len:g} sequences of max_model_len "
            f"{self.max_model_len:,} at once"
        )


def gib(n: int) -> str:
    return f"{n / GiB:.2f} GiB"


def local_spec(spec: ModelSpec, tp_size: int) -> ModelSpec:
    """The shapes one rank computes with (its heads, KV heads and MLP columns): the
    widest rank's, where ranks differ (tp_shard.widest_shard)."""
    return spec if tp_size == 1 else widest_shard(spec, tp_size).local_spec


def weight_bytes(spec: ModelSpec, tp_size: int, dtype: torch.dtype) -> int:
    """What CausalLM holds on the widest rank of `tp_size` (rank 0 where all hold the same,
    tp_shard.widest_shard: a group of expert columns outweighs rank 0's down biases): its
    share of every projection and expert, its vocabulary rows of the embedding and the
    head (padded to a multiple of tp_size), the replicated norms (Gemma's in fp32),
    routers and q/k/v biases (gpt-oss's o_proj, router and expert biases too, and its
    sinks in fp32), Gemma 4's replicated per-layer inputs and layer scalars, each Gated
    DeltaNet layer's decay rate in fp32, and one cos and one sin table
    [max_position_embeddings, rotary_dim] per distinct rope and rotary_dim."""
    shard = widest_shard(spec, tp_size)
    local = shard.local_spec
    heads = 1 if spec.tie_word_embeddings else 2
    vocab_rows = -(-spec.vocab_size // tp_size)
    params = local.num_parameters() + heads * (vocab_rows - spec.vocab_size) * spec.hidden_size
    if spec.qkv_bias:
        params += spec.num_layers * (local.q_size + 2 * local.kv_size)
    if spec.o_bias:  # whole on every rank, added after the all-reduce
        params += spec.num_layers * spec.hidden_size
    if spec.moe_bias:  # router [E], gate/up [E, 2I] by rank, down [E, H] (on rank 0)
        sparse = sum(spec.is_sparse(i) for i in range(spec.num_layers))
        per_expert = 1 + 2 * local.moe_intermediate_size
        per_expert += spec.hidden_size if shard.rank == 0 else 0
        params += sparse * spec.num_experts * per_expert
    ropes: list = []  # distinct (rope, rotary_dim): RopeSpec holds a dict, compared
    for i in range(spec.num_layers):
        if (spec.rope(i), spec.layer(i).rotary_dim) not in ropes:
            ropes.append((spec.rope(i), spec.layer(i).rotary_dim))
    params += sum(2 * spec.max_position_embeddings * dim for _, dim in ropes)
    extra = 0
    if spec.attn_sinks:  # one fp32 logit per query head and layer
        extra += spec.num_layers * local.num_heads * 4
    if spec.gemma_norm or spec.norm_fp32_weight:  # Gemma's norms: 1 + w (4's: w) in fp32
        norms = spec.num_layers * (4 if spec.sandwich_norms else 2) * spec.hidden_size
        if spec.moe_beside_mlp:  # Gemma 4's MoE block: three norms more per sparse layer
            norms += 3 * spec.hidden_size * sum(map(spec.is_sparse, range(spec.num_layers)))
        if spec.qk_norm:  # q's and, where the layer keeps KV, k's (no linear-attention layer)
            norms += sum((1 + (spec.kv_source(i) == i)) * spec.layer(i).head_dim
                         for i in range(spec.num_layers) if not spec.is_linear(i))  # fmt: skip
        if spec.per_layer_input_size:  # Gemma 4's per-layer inputs: a norm per layer, one
            norms += spec.num_layers * spec.hidden_size + spec.per_layer_input_size  # of all
        extra += (norms + spec.hidden_size) * (4 - dtype.itemsize)
    if local.linear_attention is not None:  # each Gated DeltaNet layer's decay rate, fp32
        linear = local.linear_attention
        extra += len(linear.layers) * linear.num_value_heads * (4 - dtype.itemsize)
    packed = packed_difference(shard, dtype)  # model/quant_shares.py
    return params * dtype.itemsize + extra + packed


def weights_note(spec: ModelSpec) -> str | None:
    """What weight_bytes could not count exactly for `spec`, None when it is exact: a
    quantized Gemma 4 MoE planned from config.json alone, whose experts may be packed per
    expert or stacked dense (only the checkpoint's tensor names tell; model/spec.py)."""
    if spec.expert_layout != "gemma4" or spec.experts_unfused is not None or spec.quant is None:
        return None
    layer = next(i for i in range(spec.num_layers) if spec.is_sparse(i))
    paths = [f"{prefix}layers.{layer}.experts.0.gate_proj" for prefix in spec.weight_prefixes]
    if spec.quant.format_of(*paths) is None:
        return None  # packed or not, the scheme leaves them dense
    return (
        "Gemma 4's experts counted dense, an upper bound: no checkpoint tensors beside "
        "config.json tell experts packed per expert from stacked ones"
    )


def kv_block_bytes(spec: ModelSpec, tp_size: int, block_size: int, dtype: torch.dtype) -> int:
    return KVCache.bytes_per_block(local_spec(spec, tp_size), block_size, dtype)


def step_bytes(
    spec: ModelSpec,
    config: EngineConfig,
    dtype: torch.dtype,
    tokens: int,
    context: int,
    logit_rows: int,
    fp32_logits: bool = True,
) -> int:
    """Estimated peak working memory of one forward of `tokens` tokens whose prefill
    attends over `context` positions (0: decode tokens, read from the cache in place),
    with `logit_rows` logit rows: what persists through the step (the residual stream,
    the LoRA workspace) plus the largest of its phases, for the widest layer (each of
    head_dim, KV heads and MLP width at its largest over layers). Per rank, with b the
    dtype's bytes, T tokens, h hidden, q/kv/i this rank's query, KV and MLP widths, H/kvh
    its query and KV heads, hd the head dim, C the context, V the vocabulary:
      residual + LoRA   T·h·b + T·lora_cols·4 (one fp32 column block per projection slice)
      norm              T·h·(b + 8): fp32 x and its square, the normed output
      attention         T·(q + 2kv)·b + T·(q + kv)·b: the projection's q/k/v and the rotated
                        q and k; then the larger of the rotation's products, T·(q + kv)·b
                        (with qk_norm T·(q + kv)·(2b + 8): the normed q and k and the norm's
                        two fp32 temporaries too), and the output T·q·b plus, where SDPA's
                        flash kernel runs the prefill (flash_prefill), its output and
                        log-sum-exp T·q·b + T·H·4 and, for a chunk over a longer context
                        (C > T), the K and V it gathers out of the cache, 2·kvh·C·hd·b. The
                        Triton kernel (soft caps, windows, fp32) reads the cache in place
                        into the output: no scores, mask or gathered K/V on any path
      dense MLP         T·(h + 4i)·b: the normed input, gate and up, act(gate), the product
      experts           P·(4h + 4i)·b + T·E·(b + 4) + P·32 for P = T·k (token, expert)
                        pairs: their inputs, gate/up, activation, outputs, the weighted copy
                        and the sum; router logits and fp32 probabilities; the sort's ints
      head              R·h·b + R·V_rank·b + (R·V·b gathered under TP) + R·V·4 in fp32
                        (fp32_logits; twice with a final soft cap) for R logit rows."""
    s, b, f32 = widest_layer(local_spec(spec, config.tp_size)), dtype.itemsize, 4
    h, q, kv, hd = s.hidden_size, s.q_size, s.kv_size, s.head_dim
    t, r, vocab = tokens, logit_rows, spec.vocab_size
    persistent = t * h * b + t * workspace_columns(spec, config.max_lora_rank) * f32
    norm = t * h * (b + 8)
    rotation = t * (q + kv) * (2 * b + 2 * f32 if s.qk_norm else b)
    output = t * q * b
    if context and flash_prefill(s, dtype, context):
        output += t * q * b + t * s.num_heads * f32
        if context > t:
            output += 2 * s.num_kv_heads * context * hd * b
    attention = t * (q + 2 * kv) * b + t * (q + kv) * b + max(rotation, output)
    mlp = t * (h + 4 * s.intermediate_size) * b
    if s.num_experts:
        pairs = t * s.num_experts_per_tok
        experts = pairs * (4 * h + 4 * s.moe_intermediate_size) * b + pairs * 32
        mlp = max(mlp, experts + t * s.num_experts * (b + f32))
    vocab_rank = -(-vocab // config.tp_size)
    head = r * h * b + r * vocab_rank * b + (r * vocab * b if config.tp_size > 1 else 0)
    if fp32_logits:
        head += r * vocab * f32 * (2 if s.final_soft_cap is not None else 1)
    return persistent + max(norm, attention, mlp, head)


def widest_layer(spec: ModelSpec) -> ModelSpec:
    """`spec` with every layer's largest head_dim, KV heads and MLP width (where layers
    differ, as Gemma 4's: a step's working memory is bounded by its widest layer)."""
    layers = [spec.layer(i) for i in range(spec.num_layers)]
    if all(layer is spec for layer in layers):
        return spec
    return replace(
        layers[0],
        head_dim=max(layer.head_dim for layer in layers),
        num_kv_heads=max(layer.num_kv_heads for layer in layers),
        intermediate_size=max(layer.intermediate_size for layer in layers),
    )


def flash_prefill(spec: ModelSpec, dtype: torch.dtype, context: int) -> bool:
    """Whether some layer's prefill over `context` positions may run on SDPA's flash
    kernel on CUDA (kernels.attention_triton: a half dtype, no soft cap, no window
    shorter than the context; it also needs a head dim and GPU flash takes, so this may
    say yes where the Triton kernel runs). Every other prefill runs the Triton kernel."""
    if dtype not in (torch.float16, torch.bfloat16) or spec.attn_soft_cap is not None:
        return False
    windows = (spec.window(i) for i in range(spec.num_layers))
    return any(w is None or w >= context for w in windows)


def sampler_bytes(spec: ModelSpec, config: EngineConfig, rows: int) -> int:
    return min(config.max_num_seqs, rows) * spec.vocab_size * SAMPLER_BYTES_PER_LOGIT


def largest_step_tokens(config: EngineConfig, max_model_len: int) -> int:
    return min(config.max_num_batched_tokens, max_model_len)


def estimate_activation_bytes(
    spec: ModelSpec, config: EngineConfig, dtype: torch.dtype, max_model_len: int
) -> int:
    """The largest step's forward (step_bytes) and the sampler after it."""
    t = largest_step_tokens(config, max_model_len)
    forward = step_bytes(spec, config, dtype, t, max_model_len, t)
    return forward + sampler_bytes(spec, config, t)


def captures_graphs(config: EngineConfig) -> bool:
    """Whether a CUDA replica captures decode graphs (each rank of a TP group too)."""
    return config.cuda_graphs


def estimate_graph_bytes(
    spec: ModelSpec, config: EngineConfig, dtype: torch.dtype, max_model_len: int
) -> int:
    """What a rank's static decode path holds: the shared fp32 logits buffer and the
    persistent inputs (static_decode_bytes), and the graphs' pool, one decode step at
    the largest bucket (module docstring)."""
    if not captures_graphs(config):
        return 0
    n = config.max_num_seqs
    blocks = -(-max_model_len // config.block_size)
    fixed = static_decode_bytes(n, spec.vocab_size, blocks)
    return fixed + step_bytes(spec, config, dtype, n, 0, n, fp32_logits=False)


def _adapter_arenas(
    spec: ModelSpec, c: EngineConfig, dtype: torch.dtype, rest: int, where: str
) -> tuple[EngineConfig, int, int]:
    """(config with the slots sized, rank rows per group, bytes) of the adapter arenas,
    from `rest`, what the budget leaves them and the KV cache: by default ADAPTER_SHARE of
    it, and room for one adapter of max_lora_rank at least."""
    one = config_slot_bytes(c, spec, block_rows(c.max_lora_rank), dtype)
    if c.adapters.num_slots is None and c.adapters.adapter_memory_bytes is None and rest < one:
        raise MemoryPlanError(
            f"one adapter of max_lora_rank {c.max_lora_rank} takes {gib(one)}; {where} "
            f"leaves {gib(rest)} after weights, activations and CUDA graphs: short by "
            f"{gib(one - rest)} (lower engine.max_lora_rank or raise tp_size)"
        )
    try:
        sized = size_adapter_slots(c, spec, dtype, max(int(rest * ADAPTER_SHARE), one))
    except ValueError as e:
        raise MemoryPlanError(f"{e} ({where})") from None
    rows = arena_rows(sized.adapters.num_slots, c.max_lora_rank)
    adapters = config_slot_bytes(c, spec, rows, dtype)
    if adapters > rest:
        raise MemoryPlanError(
            f"adapter arenas of {sized.adapters.num_slots - 1} adapters of rank {c.max_lora_rank} "
            f"({gib(adapters)}) exceed what {where} leaves them and the KV cache "
            f"({gib(rest)}) by {gib(adapters - rest)}"
        )
    return sized, rows, adapters


def state_pool_bytes(spec: ModelSpec, config: EngineConfig, dtype: torch.dtype) -> int:
    """A hybrid model's state pool on one rank: max_num_seqs rows and the scratch row (0
    without linear-attention layers)."""
    linear = local_spec(spec, config.tp_size).linear_attention  # this rank's heads
    if linear is None:
        return 0
    return (config.max_num_seqs + 1) * linear.state_bytes_per_seq(dtype)


def wanted_max_model_len(config: EngineConfig, spec: ModelSpec) -> int:
    """The config's max_model_len, else the model's context (never past it)."""
    return min(config.max_model_len or spec.max_position_embeddings, spec.max_position_embeddings)


def plan_memory(
    spec: ModelSpec,
    config: EngineConfig,
    dtype: torch.dtype,
    device_bytes: int,
    *,
    in_use_bytes: int | None = None,
    weights_bytes: int | None = None,
    activation_bytes: int | None = None,
) -> MemoryPlan:
    """The plan of one rank (module docstring). `in_use_bytes`: memory already in use on the
    device (None: a fresh device's CUDA context, CUDA_CONTEXT_BYTES); `weights_bytes`,
    `activation_bytes`: measured values in place of the estimates. Raises MemoryPlanError
    naming what does not fit and by how much."""
    c, tp = config, config.tp_size
    in_use = CUDA_CONTEXT_BYTES if in_use_bytes is None else in_use_bytes
    budget = int(c.gpu_memory_utilization * device_bytes) - in_use
    weights = weight_bytes(spec, tp, dtype) if weights_bytes is None else weights_bytes
    max_len = wanted_max_model_len(c, spec)
    measured = activation_bytes is not None
    if activation_bytes is None:
        activation_bytes = estimate_activation_bytes(spec, c, dtype, max_len)
    graphs = estimate_graph_bytes(spec, c, dtype, max_len)
    block = kv_block_bytes(spec, tp, c.block_size, dtype)
    states = state_pool_bytes(spec, c, dtype)
    fixed = {"weights": weights, "activations": activation_bytes, "CUDA graphs": graphs}
    if states:
        fixed["state pool"] = states
    left = budget - sum(fixed.values()) - block  # the scratch block
    where = (
        f"gpu_memory_utilization {c.gpu_memory_utilization:g} of {gib(device_bytes)} "
        f"less {gib(in_use)} in use: a budget of {gib(budget)} per GPU"
    )
    if left < 0:
        parts = " + ".join(f"{name} {gib(n)}" for name, n in fixed.items())
        hint = "more tensor-parallel ranks split the weights"
        if weights <= budget:  # what else is sized by the engine's settings
            hint = "raise tp_size, or lower engine.max_num_batched_tokens or engine.max_num_seqs"
        raise MemoryPlanError(
            f"{spec.arch} at tp_size={tp} does not fit: {parts} exceed {where} by "
            f"{gib(-left)} before any KV cache ({hint})"
        )
    rest = left if c.kv_cache_bytes is None else left - c.kv_cache_bytes
    if rest < 0:
        raise MemoryPlanError(
            f"engine.kv_cache_bytes {gib(c.kv_cache_bytes)} exceeds what {where} leaves "
            f"after weights, activations and CUDA graphs ({gib(left)}) by {gib(-rest)}"
        )
    sized, rows, adapters = _adapter_arenas(spec, c, dtype, rest, where)
    kv = left - adapters if c.kv_cache_bytes is None else c.kv_cache_bytes
    needed = -(-max_len // c.block_size) * block
    if kv < needed and (c.kv_cache_bytes is None or c.max_model_len is not None):
        spent = (f"after weights {gib(weights)}, activations {gib(activation_bytes)}, CUDA "
                 f"graphs {gib(graphs)} and adapter arenas {gib(adapters)}")  # fmt: skip
        given, hint = f"{where} {spent} leaves", "gpu_memory_utilization or tp_size"
        if c.kv_cache_bytes is not None:
            given, hint = "engine.kv_cache_bytes is", "engine.kv_cache_bytes"
        raise MemoryPlanError(
            f"one sequence of max_model_len {max_len:,} needs {gib(needed)} of KV cache; "
            f"{given} {gib(kv)}: short by {gib(needed - kv)} (lower engine.max_model_len or "
            f"raise {hint})"
        )
    return MemoryPlan(
        device_bytes=device_bytes,
        gpu_memory_utilization=c.gpu_memory_utilization,
        in_use_bytes=in_use,
        budget_bytes=budget,
        weights_bytes_per_gpu=weights,
        activation_bytes=activation_bytes,
        activation_source="profiled" if measured else "estimated",
        graph_bytes=graphs,
        adapter_memory_bytes=adapters,
        num_slots=sized.adapters.num_slots,
        adapter_rows=rows,
        max_loras_per_batch=sized.adapters.max_loras_per_batch or 0,
        kv_cache_bytes=kv,
        kv_block_bytes=block,
        block_size=c.block_size,
        max_model_len=min(max_len, kv // block * c.block_size),
        tp_size=tp,
        state_pool_bytes=states,
    )
