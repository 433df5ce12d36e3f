"""The ingress's settings: the `ingress:` section of the application config
(cluster/config.py's AppConfig), handed whole to the Ingress."""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

from router.tools.registry import (
    REASONING_PARSERS,
    TOOL_PARSER_NAMES,
    check_reasoning_parser,
    check_tool_parser,
)

_SHA256_HEX = re.compile(r"[0-9a-f]{64}")


class TenantConfig(BaseModel):
    """One customer: its keys, what it may see and call, its share and its limits."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1, description="The tenant's name (metrics, usage, logs).")
    key_sha256: list[str] = Field(
        default_factory=list,
        description="SHA-256 hex digests of the tenant's bearer keys (the config holds no "
        "secret): `printf %s KEY | sha256sum`.",
    )
    key_env: str | None = Field(
        None,
        min_length=1,
        description="An environment variable of the Ingress's process holding one more key.",
    )
    adapters: list[str] = Field(
        default_factory=list,
        description="fnmatch globs of the adapter names the tenant may call, list, resolve "
        "and (with manage_adapters) load and unload; anything else is an unknown name.",
    )
    base_model: bool = Field(False, description="May call and see the base model.")
    weight: float = Field(1.0, gt=0, description="Fair-share weight in the replicas' scheduler.")
    requests_per_minute: int | None = Field(None, ge=1, description="Request limit.")
    tokens_per_minute: int | None = Field(
        None, ge=1, description="Token limit: prompt + max_tokens charged, refunded to actual."
    )
    manage_adapters: bool = Field(
        False, description="May load and unload adapters whose names match `adapters`."
    )
    adapter_roots: list[str] = Field(
        default_factory=list,
        description="Directories (inside the app's adapter_roots) the tenant's loads must "
        "lie in; required with manage_adapters, so no tenant loads another's files.",
    )

    @field_validator("key_sha256")
    @classmethod
    def _digests(cls, digests: list[str]) -> list[str]:
        lowered = [d.lower() for d in digests]
        bad = [d for d in lowered if not _SHA256_HEX.fullmatch(d)]
        if bad:
            raise ValueError(f"not a SHA-256 hex digest (64 hex digits): {bad[0]!r}")
        return lowered

    @model_validator(mode="after")
    def _has_a_key(self) -> TenantConfig:
        if not self.key_sha256 and self.key_env is None:
            raise ValueError(f"tenant {self.name!r}: needs key_sha256 or key_env")
        if self.manage_adapters and not self.adapter_roots:
            # the app's roots hold every tenant's adapters: loading from them would let a
            # tenant serve another's files under a name of its own
            raise ValueError(f"tenant {self.name!r}: manage_adapters needs adapter_roots")
        return self

    @property
    def limited(self) -> bool:
        return self.requests_per_minute is not None or self.tokens_per_minute is not None


_TOOL_PARSER_HELP = (
    f"Tool-call parser ({', '.join(TOOL_PARSER_NAMES)}, or none); unset: the one the chat "
    "template implies."
)
_REASONING_PARSER_HELP = (
    f"Reasoning parser ({', '.join(REASONING_PARSERS)}, or none); unset: the one the chat "
    "template implies."
)

# a parser's name, refused at load unless registered (router/tools/registry.py)
ToolParserName = Annotated[str | None, AfterValidator(check_tool_parser)]
ReasoningParserName = Annotated[str | None, AfterValidator(check_reasoning_parser)]


class ChatParsers(BaseModel):
    """The parsers of a model's answers, where the chat template's own choice is wrong."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    tool_parser: ToolParserName = Field(None, description=_TOOL_PARSER_HELP)
    reasoning_parser: ReasoningParserName = Field(None, description=_REASONING_PARSER_HELP)


class IngressOptions(BaseModel):
    """The HTTP face's knobs: defaults of requests, timeout, API keys, tenants."""

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
    tenants: list[TenantConfig] = Field(
        default_factory=list,
        description="Customers, each with its keys and adapter scope; with any, every "
        "endpoint but /health and /metrics needs a tenant's key or the admin key.",
    )
    rate_limit_window_s: float = Field(
        60.0,
        gt=0,
        description="The window of requests_per_minute and tokens_per_minute (a bucket "
        "refills fully in this long); other than 60 only for tests.",
    )
    tool_parser: ToolParserName = Field(None, description=_TOOL_PARSER_HELP + " (base model)")
    reasoning_parser: ReasoningParserName = Field(
        None, description=_REASONING_PARSER_HELP + " (base model)"
    )
    adapter_parsers: dict[str, ChatParsers] = Field(
        default_factory=dict,
        description="Parsers per adapter: fnmatch glob of adapter names -> tool_parser, "
        "reasoning_parser (the first glob that matches); otherwise an adapter's come from "
        "its own chat template, else the base model's.",
    )
    tenant_metric_labels: int = Field(
        20,
        ge=0,
        description="Tenants (the first this many of `tenants`) and adapters (the first this "
        "many seen) named in the per-tenant metrics' labels; the rest are 'other'.",
    )

    @field_validator("tenants")
    @classmethod
    def _unique(cls, tenants: list[TenantConfig]) -> list[TenantConfig]:
        names = [t.name for t in tenants]
        if dupes := sorted({n for n in names if names.count(n) > 1}):
            raise ValueError(f"tenant names must be unique: {', '.join(dupes)}")
        digests = [d for t in tenants for d in t.key_sha256]
        if len(set(digests)) != len(digests):
            raise ValueError("a key_sha256 digest is listed for two tenants (or twice)")
        return tenants

    @property
    def rate_limited(self) -> bool:
        return any(t.limited for t in self.tenants)
