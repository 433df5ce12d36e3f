"""Engine knobs of one replica. cluster/config.py composes this into the app config.

The adapter-residency knobs (device slots, host cache, prefetch, eviction) form their own
sub-model, `engine.adapters`, handed whole to the parts that keep adapters resident.
"""

from __future__ import annotations

import logging
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

log = logging.getLogger(__name__)


def moved_key(old: str, new: str) -> None:
    """Logs that config key `old` is deprecated for `new` (one line per old key read)."""
    log.warning("config key %s is deprecated: write %s (the old key goes next release)", old, new)


class AdapterResidencyConfig(BaseModel):
    """How a replica keeps adapters resident: device slots, host cache, prefetch, eviction."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    adapter_memory_bytes: int | None = Field(
        None,
        ge=1,
        description="Device memory for resident adapters, each held at its own rank (the "
        "next power of two of rows, at least 8): a rank-8 adapter takes an eighth of a "
        "rank-64 one. Kept as num_slots. Default: on CUDA a quarter of what the memory "
        "plan's budget leaves after weights, activations and CUDA graphs (the KV cache "
        "gets the rest), on CPU 1 GiB; either way at most 255 adapters of max_lora_rank.",
    )
    num_slots: int | None = Field(
        None,
        ge=2,
        description="Adapter memory as a count instead of bytes: room for num_slots - 1 "
        "adapters of max_lora_rank (and more of lower ranks) beside slot 0, the pinned base "
        "model (set this or adapter_memory_bytes, not both).",
    )
    max_loras_per_batch: int | None = Field(
        None,
        ge=1,
        description="Distinct adapters allowed in one running batch. Default: num_slots - 1 "
        "(so the batch never holds every block a max-rank adapter could use), at most "
        "max_num_seqs. With adapters churning, one or two fewer leave room for the next "
        "load (docs/performance.md).",
    )
    host_cache_bytes: int = Field(
        1 << 30, ge=0, description="Budget of adapters staged in (pinned) host memory, in bytes."
    )
    prefetch_window: int = Field(
        16,
        ge=0,
        description="Distinct adapters, in waiting-queue order, the prefetcher looks ahead "
        "for each step (S-LoRA).",
    )
    max_loads_in_flight: int = Field(8, ge=1, description="Adapter loads running at once.")
    adapter_loading: Literal["overlap", "sync"] = Field(
        "overlap",
        description="'overlap': prefetch on a side stream/thread, polled; "
        "'sync': load on admission, blocking the step (ablation).",
    )
    eviction_policy: Literal["lru", "fifo"] = Field(
        "lru", description="Which unused adapter slot to evict."
    )
    pin_base_slot: bool = Field(
        True,
        description="Base model in pinned slot 0 (never evicted, never waits). "
        "False treats the base as one more evictable adapter (ablation).",
    )
    aging_steps: int = Field(
        32, ge=1, description="Skips after which a request's adapter is given priority."
    )

    @model_validator(mode="after")
    def _one_slot_sizing(self) -> AdapterResidencyConfig:
        if self.num_slots is not None and self.adapter_memory_bytes is not None:
            raise ValueError(
                "set engine.adapters.num_slots or engine.adapters.adapter_memory_bytes, not "
                "both: the slot count is either fixed or sized from the memory budget"
            )
        return self


class EngineConfig(BaseModel):
    """Every setting of a replica's engine, with defaults that work on a CPU."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field(description="Hugging Face model directory (config.json + safetensors).")
    device: str = Field("auto", description="'auto', 'cpu', 'cuda' or 'cuda:N'.")
    dtype: str = Field("auto", description="'auto' (bf16 on CUDA, fp32 on CPU) or a dtype name.")
    load_format: Literal["auto", "dummy"] = Field(
        "auto",
        description="'auto': the model directory's safetensors. 'dummy': random weights made "
        "on the device from config.json alone (seeded, unit-scale), no weight file read: "
        "speed and memory at a model's real shapes without its checkpoint (vLLM's "
        "--load-format dummy); the tokens it generates mean nothing.",
    )
    max_lora_rank: int = Field(
        64, ge=1, description="Largest adapter rank a replica accepts (sizes no adapter's memory)."
    )
    lora_embeddings: bool = Field(
        False,
        description="Serve LoRA on embed_tokens and lm_head (PEFT's embedding and head "
        "modules, same vocabulary as the base). Every adapter row of the arenas then also "
        "holds a vocabulary-sized A and B: fewer adapters in the same memory (about 10% on "
        "Llama-3-8B, 15% on Gemma-2-9B). Off: such adapters are refused at load.",
    )
    lora_experts: bool = Field(
        False,
        description="Serve LoRA on a mixture of experts' experts (per-expert keys or PEFT "
        "target_parameters on the stacked experts). Every adapter row of the arenas then "
        "also holds each sparse layer's experts' gate/up/down once per expert: 63x the "
        "bytes of a row without them on Qwen3-30B-A3B, 18x on Mixtral-8x7B, so that many "
        "times fewer adapters in the same memory. Off: such adapters are refused at load; "
        "adapters on attention and dense MLPs serve alike either way.",
    )
    gpu_memory_utilization: float = Field(
        0.90,
        gt=0,
        le=1,
        description="On CUDA, the share of each GPU's memory the replica may bring into use "
        "(with what other processes and the CUDA context hold at start). The memory plan "
        "spends it on the weights, the profiled activation peak, the CUDA graphs, the "
        "adapter arenas, and gives the rest to the KV cache (`lorafleet plan` shows it "
        "before any GPU is used).",
    )
    kv_cache_bytes: int | None = Field(
        None,
        ge=1,
        description="Memory of the paged KV cache per rank, in bytes. Default: on CUDA what "
        "the memory plan leaves (gpu_memory_utilization), on CPU 256 MiB. Set, it wins on "
        "CUDA too (the plan still refuses one that does not fit the budget).",
    )
    block_size: int = Field(16, ge=1, description="Tokens per KV cache block.")
    max_num_seqs: int = Field(64, ge=1, description="Sequences in the running batch at most.")
    max_num_batched_tokens: int = Field(
        2048, ge=1, description="Token budget of one step (prefill chunks + decodes)."
    )
    max_model_len: int | None = Field(
        None, ge=1, description="Longest prompt + output; default the model's context length."
    )
    scheduling: Literal["fcfs", "vtc"] | None = Field(
        None,
        description="Admission order of waiting requests. 'fcfs': arrival order. 'vtc': "
        "weighted fair share between tenants (Virtual Token Counter: a counter per tenant "
        "charged 1 per uncached prompt token and 2 per output token, divided by the "
        "tenant's weight; the waiting tenant with the lowest counter goes first). Requests "
        "without a tenant share one counter. None: fcfs (the application config makes it "
        "vtc when tenants are configured).",
    )
    cuda_graphs: bool = Field(
        True,
        description="On CUDA, replay decode-only steps as CUDA graphs, one per batch-size "
        "bucket (1, 2, 4, 8, then multiples of 8 up to max_num_seqs), with and without "
        "LoRA, captured at start on every rank; steps with a prefill, and CPUs, run "
        "eagerly.",
    )
    enable_prefix_caching: bool = Field(
        True,
        description="Reuse the KV blocks of a prompt prefix already computed under the same "
        "adapter version (or the base model): a request prefills only what follows its "
        "longest cached prefix. Unreferenced cached blocks are evicted LRU when needed.",
    )
    tp_size: int = Field(
        1,
        ge=1,
        description="Tensor-parallel ranks (devices) per replica: rank 0 drives, ranks 1..N-1 "
        "are Ray actors in the replica's placement group. 1 = no tensor parallelism.",
    )
    adapters: AdapterResidencyConfig = Field(
        default_factory=AdapterResidencyConfig,
        description="Adapter residency: device slots, host cache, prefetch, eviction.",
    )

    @model_validator(mode="before")
    @classmethod
    def _nest_adapter_keys(cls, values: Any) -> Any:
        """Old flat keys (engine.num_slots) moved under engine.adapters, each logged."""
        return nest_adapter_keys(values) if isinstance(values, dict) else values

    def with_adapters(self, **update: Any) -> EngineConfig:
        """This config with `update` applied to its adapters sub-model."""
        return self.model_copy(update={"adapters": self.adapters.model_copy(update=update)})


def nest_adapter_keys(engine: dict[str, Any]) -> dict[str, Any]:
    """`engine` (an EngineConfig's values) with the residency keys of the flat shape moved
    into its `adapters` section, one deprecation line each; a key given both ways is an
    error, not a silent choice."""
    flat = [k for k in AdapterResidencyConfig.model_fields if k in engine]
    if not flat:
        return engine
    engine, adapters = dict(engine), engine.get("adapters") or {}
    if not isinstance(adapters, dict):
        adapters = adapters.model_dump(exclude_unset=True)
    adapters = dict(adapters)
    for key in flat:
        if key in adapters:
            raise ValueError(f"engine.{key} and engine.adapters.{key} both set: keep the second")
        moved_key(f"engine.{key}", f"engine.adapters.{key}")
        adapters[key] = engine.pop(key)
    engine["adapters"] = adapters
    return engine
