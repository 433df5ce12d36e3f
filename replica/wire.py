"""What crosses between the router and a replica: the one contract both sides import.

Torch-free and Ray-free (the ingress imports it without loading torch). Everything here
is validated or built once, on the side that makes it, and never re-checked:

- `SamplingParams`: how a request picks its tokens; its field types carry the only bounds
  (the HTTP request models reuse them), its defaults are the API's.
- `AdapterKey`: one registered version of an adapter, `name@vN` as the engine names it.
- `GenerateRequest`: the argument of `LoRAReplica.generate`; the request router reads its
  adapter to place it.
- `Reply`: one message of a replica's answer stream (new tokens, or the end, or a refusal).
- `RoutingStats`: what a replica publishes for the request router every stats period.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1  # the engine seeds a 64-bit torch.Generator
GREEDY_BELOW = 1e-5  # temperatures under this sample greedily
MAX_TEMPERATURE = 2.0  # OpenAI's bound

# Field types with their bounds: SamplingParams and the HTTP request models share them.
MaxTokens = Annotated[int, Field(ge=1)]
Temperature = Annotated[float, Field(ge=0.0, le=MAX_TEMPERATURE, allow_inf_nan=False)]
TopP = Annotated[float, Field(gt=0.0, le=1.0)]
TopK = Annotated[int, Field(ge=0)]
Seed = Annotated[int, Field(ge=SEED_MIN, le=SEED_MAX)]
TokenId = Annotated[int, Field(ge=0)]

FinishReason = Literal["stop", "length", "abort", "error"]


class SamplingParams(BaseModel):
    """How one request picks its tokens. Defaults are the OpenAI API's (temperature 1);
    temperature 0 means greedy."""

    model_config = ConfigDict(frozen=True)

    max_tokens: MaxTokens = Field(16, description="Maximum number of tokens to generate.")
    temperature: Temperature = Field(1.0, description="0 = greedy; higher = more random.")
    top_p: TopP = Field(1.0, description="Nucleus sampling mass.")
    top_k: TopK = Field(0, description="Keep the k most likely tokens; 0 = all.")
    seed: Seed | None = Field(None, description="Per-request seed for reproducible sampling.")
    stop_token_ids: tuple[TokenId, ...] = Field((), description="Tokens that end the request.")
    ignore_eos: bool = Field(False, description="Keep generating past the model's EOS token.")

    @property
    def greedy(self) -> bool:
        # below this, dividing float32 logits by the temperature overflows (vLLM: the same)
        return self.temperature < GREEDY_BELOW


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


@dataclass(frozen=True)
class GenerateRequest:
    """One generation, as the ingress hands it to a replica (tokenized and validated)."""

    adapter: AdapterKey | None  # None: the base model
    prompt_ids: list[int]
    sampling: SamplingParams
    request_id: str
    timeout_s: float | None = None  # the replica aborts it after this long (status 504)


@dataclass(frozen=True)
class Reply:
    """One message of a replica's answer: the tokens made since the last message, and
    whether the request ended (finish_reason) or was refused or failed (error, status)."""

    token_ids: tuple[int, ...] = ()
    finished: bool = False
    finish_reason: FinishReason | None = None
    error: str | None = None
    status: int | None = None  # an HTTP status for refusals and failures
    num_prompt_tokens: int = 0

    @classmethod
    def refusal(cls, status: int, message: str) -> Reply:
        """A request that never ran: its only message."""
        return cls(finished=True, finish_reason="error", error=message, status=status)

    @classmethod
    def merge(cls, replies: list[Reply]) -> Reply:
        """Consecutive messages as one (one message per engine batch crosses to the ingress)."""
        last = replies[-1]
        tokens = tuple(t for r in replies for t in r.token_ids)
        return cls(
            tokens, last.finished, last.finish_reason, last.error, last.status,
            last.num_prompt_tokens,
        )  # fmt: skip

    @property
    def refused(self) -> bool:
        """Ended before any token with a status: the request was refused or failed."""
        return self.finished and self.status is not None and not self.token_ids


@dataclass(frozen=True)
class RoutingStats:
    """What the request router knows of a replica (up to one stats period old)."""

    device_adapters: frozenset[str] = field(default_factory=frozenset)  # names in a slot
    host_adapters: frozenset[str] = field(default_factory=frozenset)  # names in host memory
    queue_len: int = 0  # requests waiting or running
    free_slots: int = 0  # adapter slots holding nothing: a load there evicts no one

    def to_dict(self) -> dict[str, Any]:
        """Serve's record_routing_stats must return a dict."""
        return {
            "device_adapters": sorted(self.device_adapters),
            "host_adapters": sorted(self.host_adapters),
            "queue_len": self.queue_len,
            "free_slots": self.free_slots,
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
        )
