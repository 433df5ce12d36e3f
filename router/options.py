"""The ingress's settings: part of the application config (cluster/config.py's AppConfig
inherits these fields, so a Serve config sets them at the top of its `args:`)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class IngressOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    default_max_tokens: int = Field(
        16,
        ge=1,
        description="max_tokens when a completions request omits it (chat: the rest of the "
        "context, as vLLM).",
    )
    request_timeout_s: float = Field(
        600.0, gt=0, description="A request still unfinished after this long is aborted: 504."
    )
    api_key: str | None = Field(
        None,
        min_length=1,
        description="Bearer token required by the adapter endpoints (load/unload); prefer "
        "api_key_env to keep it out of config files.",
    )
    api_key_env: str = Field(
        "LORAFLEET_API_KEY",
        description="Environment variable read for the key when api_key is not set (in the "
        "Ingress's process: the shell that starts Ray, or the Serve config's runtime_env).",
    )
    api_key_for_inference: bool = Field(
        False, description="Require the key on the inference endpoints and /v1/models too."
    )
