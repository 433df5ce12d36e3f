"""A request as the engine tracks it."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from replica.wire import SamplingParams


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    adapter: str | None  # the adapter the user asked for; None = base model
    arrival: int  # arrival order, for FCFS and picking the youngest to preempt
    lora_key: str | None = None  # slot-pool name it needs; None = the pinned base slot
    slot: int = 0  # adapter slot while running (0 = base)
    output_ids: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose K/V are in the cache
    blocks: list[int] = field(default_factory=list)
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    error: str | None = None  # why, when finish_reason == "error"
    skips: int = 0  # times passed over because its adapter was not ready (aging)

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
