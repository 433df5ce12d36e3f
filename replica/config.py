"""Engine knobs of one replica. cluster/config.py composes this into the app config."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class EngineConfig(BaseModel):
    """Every setting of a replica's engine, with defaults that work on a CPU."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field(description="Hugging Face model directory (config.json + safetensors).")
    device: str = Field("auto", description="'auto', 'cpu', 'cuda' or 'cuda:N'.")
    dtype: str = Field("auto", description="'auto' (bf16 on CUDA, fp32 on CPU) or a dtype name.")
    max_lora_rank: int = Field(64, ge=1, description="Largest adapter rank a slot can hold.")
    num_slots: int = Field(
        8, ge=2, description="Device adapter slots including slot 0 (the pinned base model)."
    )
    max_loras_per_batch: int = Field(
        8, ge=1, description="Distinct adapters allowed in one running batch."
    )
    kv_cache_bytes: int = Field(
        256 * 2**20, ge=1, description="Memory budget of the paged KV cache, in bytes."
    )
    block_size: int = Field(16, ge=1, description="Tokens per KV cache block.")
    max_num_seqs: int = Field(64, ge=1, description="Sequences in the running batch at most.")
    max_num_batched_tokens: int = Field(
        2048, ge=1, description="Token budget of one step (prefill chunks + decodes)."
    )
    max_model_len: int | None = Field(
        None, ge=1, description="Longest prompt + output; default the model's context length."
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
    cuda_graphs: bool = Field(
        True,
        description="On CUDA, replay decode-only steps as CUDA graphs, one per batch-size "
        "bucket (1, 2, 4, 8, then multiples of 8 up to max_num_seqs), with and without "
        "LoRA, captured at start; other steps, tensor-parallel replicas and CPUs run "
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
