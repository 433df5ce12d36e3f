"""What crosses between the router and a replica: the one contract both sides import.

Torch-free and Ray-free (the ingress imports it without loading torch). Everything here
is validated or built once, on the side that makes it, and never re-checked:

- `SamplingParams`: how a request picks its tokens; its field types carry the only bounds
  (the HTTP request models reuse them), its defaults are the API's.
- `AdapterKey`: one registered version of an adapter, `name@vN` as the engine names it.
- `AdapterInfo`, `AdapterWeightsRef`, `Listing`, `ReportReply`: the AdapterStore's answers
  (cluster/store/): to the ingress, what the registry holds; to a replica, where a
  version's weights are and what it must drop.
- `GenerateRequest`: one generation, the one request type from the ingress to the engine;
  the request router reads its adapter to place it.
- `Reply`: one choice's news from one engine step; a replica streams lists of them. A
  refusal or failure is an exception (replica/errors.py), never a reply.
- `RoutingStats`: what a replica publishes for the request router every stats period.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1  # 64 bits: what the sampler mixes into its keys
GREEDY_BELOW = 1e-5  # temperatures under this sample greedily
MAX_TEMPERATURE = 2.0  # OpenAI's bound
MAX_LOGPROBS = 20  # top logprobs per token, as OpenAI's top_logprobs
MAX_N = 16  # choices per request

# Field types with their bounds: SamplingParams and the HTTP request models share them.
MaxTokens = Annotated[int, Field(ge=1)]
Temperature = Annotated[float, Field(ge=0.0, le=MAX_TEMPERATURE, allow_inf_nan=False)]
TopP = Annotated[float, Field(gt=0.0, le=1.0)]
TopK = Annotated[int, Field(ge=0)]
Seed = Annotated[int, Field(ge=SEED_MIN, le=SEED_MAX)]
TokenId = Annotated[int, Field(ge=0)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0, allow_inf_nan=False)]  # OpenAI's range
RepetitionPenalty = Annotated[float, Field(gt=0.0, le=10.0, allow_inf_nan=False)]
MinP = Annotated[float, Field(ge=0.0, le=1.0)]
Bias = Annotated[float, Field(ge=-100.0, le=100.0, allow_inf_nan=False)]  # OpenAI's range
NumLogprobs = Annotated[int, Field(ge=0, le=MAX_LOGPROBS)]
NumChoices = Annotated[int, Field(ge=1, le=MAX_N)]

FinishReason = Literal["stop", "length"]  # the ends a reply tells; failures are exceptions


class StructuredOutput(BaseModel):
    """A constraint the output must satisfy (OpenAI's response_format, a forced tool
    choice's JSON, or strict tools' calls within free text)."""

    model_config = ConfigDict(frozen=True)

    kind: Literal["json_object", "json_schema", "structural_tag"]
    json_schema: str | None = Field(
        None,
        description="json_schema: the JSON Schema; structural_tag: xgrammar's structural "
        "tag (free text, each tag's content under its schema once its trigger is "
        "written); as JSON text (compiled once, cached).",
    )


class SamplingParams(BaseModel):
    """How one request picks its tokens. Defaults are the OpenAI API's (temperature 1);
    temperature 0 means greedy.

    Order of a row's logit processing (vLLM's): logit_bias, min_tokens (the row's stop
    and EOS tokens masked until it has that many), repetition penalty (over prompt and
    output tokens: positive logits divided, negative multiplied), presence and frequency
    penalties (over output tokens), the structured-output mask; then temperature, top-k,
    top-p, min_p and the draw. Logprobs are log_softmax of the raw logits (before any of
    that) in fp32, vLLM's default."""

    model_config = ConfigDict(frozen=True)

    max_tokens: int | None = Field(
        16,
        ge=0,
        description="Maximum number of tokens to generate (0 only with prompt_logprobs); "
        "None: the rest of the model's context.",
    )
    temperature: Temperature = Field(1.0, description="0 = greedy; higher = more random.")
    top_p: TopP = Field(1.0, description="Nucleus sampling mass.")
    top_k: TopK = Field(0, description="Keep the k most likely tokens; 0 = all.")
    min_p: MinP = Field(0.0, description="Drop tokens below min_p x the top token's probability.")
    seed: Seed | None = Field(None, description="Per-request seed for reproducible sampling.")
    stop_token_ids: tuple[TokenId, ...] = Field((), description="Tokens that end the request.")
    ignore_eos: bool = Field(False, description="Keep generating past the model's EOS token.")
    min_tokens: int = Field(
        0, ge=0, description="Tokens generated before EOS or a stop token may end it."
    )
    presence_penalty: Penalty = Field(0.0, description="Subtracted once from seen tokens' logits.")
    frequency_penalty: Penalty = Field(0.0, description="Subtracted per occurrence in the output.")
    repetition_penalty: RepetitionPenalty = Field(
        1.0, description="vLLM's: > 1 discourages tokens of the prompt and output."
    )
    logit_bias: tuple[tuple[TokenId, Bias], ...] = Field(
        (), description="(token id, bias) added to the logits before sampling."
    )
    n: NumChoices = Field(1, description="Choices generated from one prefill of the prompt.")
    logprobs: NumLogprobs | None = Field(
        None, description="Per generated token: its logprob and this many top alternatives."
    )
    prompt_logprobs: NumLogprobs | None = Field(
        None, description="Per prompt token after the first: its logprob and top alternatives."
    )
    structured_output: StructuredOutput | None = Field(
        None, description="A JSON constraint on the output (response_format)."
    )

    @model_validator(mode="after")
    def _consistent(self) -> SamplingParams:
        if self.max_tokens == 0 and self.prompt_logprobs is None:
            raise ValueError("max_tokens must be at least 1 (0 only to score the prompt)")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) exceeds max_tokens ({self.max_tokens})"
            )
        if len({t for t, _ in self.logit_bias}) != len(self.logit_bias):
            raise ValueError("logit_bias names a token twice")
        return self

    @property
    def greedy(self) -> bool:
        # below this, dividing float32 logits by the temperature overflows (vLLM: the same)
        return self.temperature < GREEDY_BELOW

    @property
    def plain(self) -> bool:
        """Nothing but temperature / top-k / top-p: the sampler's fast path for the row."""
        return (
            self.min_p == 0.0
            and self.min_tokens == 0
            and self.presence_penalty == 0.0
            and self.frequency_penalty == 0.0
            and self.repetition_penalty == 1.0
            and not self.logit_bias
            and self.structured_output is None
        )


@dataclass(frozen=True, order=True)
class AdapterKey:
    """One registered version of an adapter: re-registering a name gives a new version, so
    a replica never serves stale weights from a slot or its host cache."""

    name: str
    version: int

    def __str__(self) -> str:
        """The engine's name for this version (its slot pool and host cache key)."""
        return f"{self.name}@v{self.version}"

    @classmethod
    def parse(cls, key: str) -> AdapterKey:
        """The inverse of str(): 'name@vN' -> AdapterKey(name, N)."""
        name, sep, version = key.rpartition("@v")
        if not sep or not name or not version.isdigit():
            raise ValueError(f"not an adapter key (name@vN): {key!r}")
        return cls(name, int(version))


def applied_text(applied: Mapping[str, int]) -> str:
    """'self_attn.q_proj ×32, self_attn.v_proj ×32': the modules an adapter changes, named
    within their layer, with their layer counts (LoRAAdapterWeights.applied)."""
    return ", ".join(f"{m} \u00d7{n}" for m, n in applied.items()) or "no module"


@dataclass(frozen=True)
class AdapterInfo:
    """One registered adapter version, as the AdapterStore tells of it (no weights): what
    the ingress lists and resolves names to, and what a replica reserves device rows by.

    `ranks` is computed once, where the store converts the weights: the rank rows the
    adapter needs in each projection group it targets (qkv_proj, o_proj, ..., see
    replica/model/lora.py; groups it does not target are absent). A replica reserves
    exactly those before it fetches the weights."""

    name: str
    version: int
    ranks: Mapping[str, int] = field(hash=False)
    path: str
    target_modules: tuple[str, ...]
    nbytes: int  # the converted weights' bytes
    created: int  # unix time of the registration
    source: str | None = None  # the resolver that found it; None: loaded or preloaded
    # module within its layer ("linear_attn.in_proj_qkv") -> layers it is applied on
    # (LoRAAdapterWeights.applied); {} in checkpoints written before it was recorded, and
    # bare module names ("q_proj") in those written before the layer path was
    applied: Mapping[str, int] = field(default_factory=dict, hash=False)

    @property
    def key(self) -> AdapterKey:
        return AdapterKey(self.name, self.version)

    @property
    def rank(self) -> int:
        """The largest rank of any module (what `max_lora_rank` bounds)."""
        return max(self.ranks.values(), default=0)


@dataclass(frozen=True)
class AdapterWeightsRef:
    """Where one adapter version's converted weights are: the store's answer to a replica
    that fetches it. `weights` is the ray.ObjectRef of the packed arrays
    (replica/adapters/packing.py), typed Any so that this module needs no Ray."""

    info: AdapterInfo
    weights: Any


@dataclass(frozen=True)
class Listing:
    """The store's registry for the ingress: every adapter sorted by name, or None when
    the caller already holds the listing of `tag` (a tag changes with every registration,
    unload and store restart)."""

    tag: str
    adapters: tuple[AdapterInfo, ...] | None


@dataclass(frozen=True)
class RegistryEpoch:
    """How far a replica has followed the store's removals: the store's incarnation (a
    restarted store is a new one) and how many versions it had removed."""

    incarnation: str
    removals: int


@dataclass(frozen=True)
class ReportReply:
    """The store's answer to a replica's periodic report: the versions removed since the
    epoch the replica last saw (unloads, in-place replacements). When the store cannot
    tell (another incarnation, a replica behind its change log), `live` lists every live
    version (name -> version) and `removed` those removed ones still fetchable."""

    epoch: RegistryEpoch
    removed: tuple[AdapterKey, ...] = ()
    live: Mapping[str, int] | None = field(default=None, hash=False)


_request_ids = itertools.count()


@dataclass(frozen=True)
class GenerateRequest:
    """One generation, tokenized and validated: what the ingress builds and hands, as it is,
    through LoRAReplica.generate and AsyncLLMEngine down to LLMEngine.add_request, whose
    sequences keep it. The request router reads its adapter and prompt to place it."""

    prompt_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    # the ingress names an adapter version (AdapterKey); offline, an engine's adapters are
    # named as LLMEngine.load_adapter registered them. None: the base model. The engine's
    # name for it is str(adapter) either way.
    adapter: AdapterKey | str | None = None
    request_id: str = field(default_factory=lambda: f"req-{next(_request_ids)}")
    timeout_s: float | None = None  # the replica aborts it after this long (DeadlineExceeded)
    # who sent it (None: no tenants configured, or the admin key): the scheduler's fair
    # share is per tenant, and the prefix cache never shares blocks across tenants
    tenant: str | None = None
    tenant_weight: float = 1.0  # the tenant's fair-share weight (config `weight`)
    cache_salt: str | None = None  # vLLM's `cache_salt`: partitions the cache within a tenant


def cache_scope(tenant: str | None, cache_salt: str | None) -> str:
    """The prefix-cache partition of a request's tenant and cache_salt ("" for neither):
    the replica's prefix cache roots its block keys in it and the router's prefix
    affinity hashes it, so both see one identity."""
    if tenant is None and cache_salt is None:
        return ""
    return json.dumps([tenant, cache_salt])


@dataclass(frozen=True)
class TokenLogprobs:
    """One token's logprob and the best alternatives at its position (log_softmax of the
    raw logits, fp32), best first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), as many as requested


@dataclass(frozen=True)
class Reply:
    """One choice's news from one engine step: the token it drew (with its logprobs, when
    asked), and how the choice ended, if it did. A replica's answer to a GenerateRequest is
    a stream of messages, each a list of these in step order: one per choice with news per
    step, several steps' worth when the caller reads slower than the engine steps. Each
    choice of the request ends with a reply that has a finish_reason; a request that
    cannot go on ends the stream with an exception (replica/errors.py) instead."""

    token_ids: tuple[int, ...] = ()
    finish_reason: FinishReason | None = None
    index: int = 0  # which of the request's n choices
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # of the prompt tokens, those served from the prefix cache
    logprobs: tuple[TokenLogprobs, ...] = ()  # one per token of token_ids, when requested
    # choice 0's first reply of a request asking for them: one per prompt token (None for
    # the first, which has no context)
    prompt_logprobs: tuple[TokenLogprobs | None, ...] | None = None
    stop_token: int | None = None  # the stop token id that ended the choice, if one did

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class RoutingStats:
    """What the request router knows of a replica (up to one stats period old)."""

    device_adapters: frozenset[str] = field(default_factory=frozenset)  # names in a slot
    host_adapters: frozenset[str] = field(default_factory=frozenset)  # names in host memory
    queue_len: int = 0  # requests waiting or running
    free_slots: int = 0  # adapter slots holding nothing: a load there evicts no one
    # fair share (VTC): per tenant ("" = no tenant), how far its counter is above that of
    # the tenant served next there; absent = 0, served first (see engine/fair_share.py)
    tenant_lag: Mapping[str, float] = field(default_factory=dict, hash=False)

    def to_dict(self) -> dict[str, Any]:
        """Serve's record_routing_stats must return a dict."""
        return {
            "device_adapters": sorted(self.device_adapters),
            "host_adapters": sorted(self.host_adapters),
            "queue_len": self.queue_len,
            "free_slots": self.free_slots,
            "tenant_lag": dict(self.tenant_lag),
        }

    @classmethod
    def from_dict(cls, stats: Mapping[str, Any] | None) -> RoutingStats:
        """From a replica's published dict; a replica that has not reported yet is empty."""
        stats = stats or {}
        return cls(
            frozenset(stats.get("device_adapters", ())),
            frozenset(stats.get("host_adapters", ())),
            int(stats.get("queue_len", 0)),
            int(stats.get("free_slots", 0)),
            {str(t): float(v) for t, v in (stats.get("tenant_lag") or {}).items()},
        )
