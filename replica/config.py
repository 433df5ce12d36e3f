"""Engine knobs of one replica. cluster/config.py composes this into the app config."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class EngineConfig(BaseModel):
    """Every setting of a replica's engine, with defaults that work on a CPU."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field(description="Hugging Face model directory (config.json + safetensors).")
    device: str = Field("auto", description="'auto', 'cpu', 'cuda' or 'cuda:N'.")
    dtype: str = Field("auto", description="'auto' (bf16 on CUDA, fp32 on CPU) or a dtype name.")
    max_lora_rank: int = Field(64, ge=1, description="Largest adapter rank a slot can hold.")
    num_slots: int = Field(
        8, ge=1, description="Device adapter slots including slot 0 (the pinned base model)."
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
