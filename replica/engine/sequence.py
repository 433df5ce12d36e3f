"""A request as the engine tracks it: one Sequence per choice, grouped; each keeps the
wire.GenerateRequest it came in (prompt, sampling, tenant), not copies of its fields."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from replica.errors import RequestRefused
from replica.wire import GenerateRequest, SamplingParams, TokenLogprobs


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)  # identity: the scheduler's queues hold and remove these objects
class Sequence:
    request: GenerateRequest  # with its max_tokens bounded by the engine
    arrival: int  # arrival order, for FCFS and picking the youngest to preempt
    lora_key: str | None = None  # slot-pool name it needs; None = the pinned base slot
    slot: int = 0  # adapter slot while running (0 = base)
    state_slot: int | None = None  # its row of a hybrid model's state pool while running
    output_ids: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose K/V are in the cache
    blocks: list[int] = field(default_factory=list)
    # prefix caching (engine/kv_blocks.py): what computed its K/V ("" = the base model,
    # else one adapter version), the keys of its full blocks so far, how many of its blocks
    # are cached, and how many prompt tokens its first admission found cached
    cache_id: str = ""
    # tenant and cache_salt as the prefix keys' root sees them ("" without either): blocks
    # are never hits across tenants, nor across salts within one
    cache_scope: str = ""
    block_keys: list[bytes] = field(default_factory=list, repr=False)
    num_cached_blocks: int = 0
    num_cached_tokens: int | None = None
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    skips: int = 0  # times passed over because its adapter was not ready (aging)
    index: int = 0  # which of the request's n choices
    group: SequenceGroup | None = field(default=None, repr=False)  # set by SequenceGroup
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # per output token, if asked
    stop_token: int | None = None  # the stop_token_ids entry that ended it
    matcher: Any = None  # structured output: its grammar matcher (xgrammar, host-side)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def prompt_ids(self) -> list[int]:
        return self.request.prompt_ids

    @property
    def sampling(self) -> SamplingParams:
        return self.request.sampling

    @property
    def tenant(self) -> str | None:
        """Who sent it, for fair share (None: no tenant)."""
        return self.request.tenant

    def token_slice(self, start: int, end: int) -> list[int]:
        """(prompt_ids + output_ids)[start:end] without building the whole list."""
        p = len(self.prompt_ids)
        if end <= p:
            return self.prompt_ids[start:end]
        if start >= p:
            return self.output_ids[start - p : end - p]
        return self.prompt_ids[start:] + self.output_ids[: end - p]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_pending(self) -> int:
        """Tokens not yet in the cache (prompt on admission, one per decode step)."""
        return self.num_tokens - self.num_computed

    def prompt_part(self, n: int) -> int:
        """How many of the next n tokens to compute are prompt tokens."""
        return max(0, min(self.num_computed + n, len(self.prompt_ids)) - self.num_computed)

    @property
    def key(self) -> tuple[str, int]:
        """The sampler's name for this choice's state (generator, token counts)."""
        return self.request_id, self.index

    @property
    def choices(self) -> list[Sequence]:
        """Every choice of its request, this one included, by index."""
        return [self] if self.group is None else self.group.seqs

    @property
    def unborn(self) -> bool:
        """A choice > 0 waiting for choice 0's prefill to fork from: in no queue yet."""
        return self.group is not None and self.index > 0 and not self.group.forked


@dataclass(eq=False)
class SequenceGroup:
    """One request's n choices. Choice 0 prefills the prompt; when that prefill completes,
    every choice draws its first token from its logits and choices 1..n-1 are forked: they
    get copies of choice 0's KV blocks and run on their own."""

    seqs: list[Sequence]
    forked: bool = False  # choices 1..n-1 have drawn their first token (and exist)
    # prompt logprobs, when asked: collected while choice 0 prefills (None for the first
    # token), sent with its first output
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    prompt_logprobs_sent: bool = False
    # why the request failed, as its caller is told: RequestError when its grammar has no
    # token of the vocabulary to go on with (retrying cannot help), Unavailable when its
    # adapter did not load; the engine ends every choice of it
    error: RequestRefused | None = None

    def __post_init__(self) -> None:
        for seq in self.seqs:
            seq.group = self
        if self.seqs[0].sampling.prompt_logprobs is not None:
            self.prompt_logprobs = [None]

    @property
    def first(self) -> Sequence:
        return self.seqs[0]

    @property
    def request(self) -> GenerateRequest:
        return self.seqs[0].request

    @property
    def finished(self) -> bool:
        """Every choice has ended: the request is over (the one place that tells)."""
        return all(s.status is SeqStatus.FINISHED for s in self.seqs)

    def prompt_logprob_positions(self, seq: Sequence, start: int, end: int) -> range:
        """Of the positions [start, end) `seq` computes now, those whose logits give a
        prompt logprob not collected yet (position p scores prompt token p + 1): choice 0's,
        until they are sent."""
        if seq is not self.first or self.prompt_logprobs is None or self.prompt_logprobs_sent:
            return range(0)
        wanted = len(self.prompt_logprobs) - 1  # the next position to score
        return range(max(start, wanted), min(end, len(self.first.prompt_ids) - 1))
