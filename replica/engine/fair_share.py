"""Admission policies: in which order the scheduler considers waiting requests.

The scheduler asks its policy for candidates and keeps every budget itself (tokens, KV
blocks, sequences, adapters per batch, readiness, aging): a candidate it cannot run now
is skipped, not waited on, whatever the policy. Two policies, chosen once from the
engine config (`scheduling`):

- `FCFS`: arrival order, the scheduler's default (engine/scheduler.py, beside the
  `AdmissionPolicy` protocol every policy implements).
- `VTC`: weighted Virtual Token Counter fair share (Sheng et al., "Fairness in Serving
  Large Language Models", OSDI '24). Each tenant has a counter, charged
  `(W_IN * uncached prompt tokens + W_OUT * output tokens) / weight` as it is served
  (the prompt when admitted, each output token when drawn). The next candidate is always
  the oldest waiting request of the waiting tenant with the lowest counter (on a tie,
  the tenant with fewer requests running), recomputed after every admission. A tenant
  arriving with nothing waiting is lifted to the lowest counter of the tenants waiting
  (see `_floor` for when none waits), so idle time banks no credit.

  The bound (the paper's 2U): a tenant is admitted only while its counter is the lowest,
  so while two tenants are both backlogged, either counter exceeds the other by at most
  U = (W_IN * longest prompt + W_OUT * the output its running requests may still draw,
  at most max_num_seqs * max_tokens) / its weight; their weighted service over any
  interval of the backlog therefore differs by at most 2U. A flood from one tenant
  cannot push another's requests back, and a request that cannot run now (its adapter
  not ready) is skipped without holding back other tenants.

Requests with no tenant (none configured, or the admin key) form one tenant, `None`.
Host-only: plain numbers and sequences, no tensors.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterator

from replica.engine.scheduler import FCFS, AdmissionPolicy
from replica.engine.sequence import SeqStatus, Sequence

W_IN = 1.0  # counter charge per uncached prompt token
W_OUT = 2.0  # counter charge per output token


class VTC:
    """Weighted virtual token counters (see the module docstring)."""

    def __init__(self, w_in: float = W_IN, w_out: float = W_OUT) -> None:
        self.w_in, self.w_out = w_in, w_out
        self._counter: dict[str | None, float] = {}
        self._weight: dict[str | None, float] = {}

    def arrived(
        self, seq: Sequence, weight: float, waiting: list[Sequence], running: list[Sequence]
    ) -> None:
        tenant = seq.tenant
        self._weight[tenant] = weight
        counter = self._counter.get(tenant, 0.0)
        if all(s.tenant != tenant for s in waiting):  # back from idle: no credit for it
            counter = max(counter, self._floor(tenant, waiting, running))
        self._counter[tenant] = counter

    def candidates(
        self, waiting: list[Sequence], running: list[Sequence] = ()
    ) -> Iterator[Sequence]:
        queues: dict[str | None, deque[Sequence]] = {}
        for seq in waiting:  # each tenant's requests in arrival order
            queues.setdefault(seq.tenant, deque()).append(seq)
        served = Counter(s.tenant for s in running)

        def rank(t: str | None) -> tuple[float, int, int]:
            # the lowest counter; on a tie (a tenant just lifted to another's counter) the
            # one with fewer requests running, then the oldest request
            return self._counter.get(t, 0.0), served[t], queues[t][0].arrival

        while queues:
            tenant = min(queues, key=rank)
            queue = queues[tenant]
            seq = queue.popleft()
            if not queue:
                del queues[tenant]
            yield seq
            if seq.status is SeqStatus.RUNNING:  # admitted
                served[tenant] += 1

    def admitted(self, seq: Sequence, uncached_prompt_tokens: int) -> None:
        self._charge(seq.tenant, self.w_in * uncached_prompt_tokens)

    def generated(self, seq: Sequence) -> None:
        self._charge(seq.tenant, self.w_out)

    def counters(self) -> dict[str | None, float]:
        return dict(self._counter)

    def lags(self, waiting: list[Sequence], running: list[Sequence]) -> dict[str | None, float]:
        floor = self._floor(None, waiting, running) if waiting or running else 0.0
        return {t: c - floor for t, c in self._counter.items() if c > floor}

    def _floor(self, tenant: str | None, waiting: list[Sequence], running: list[Sequence]) -> float:
        """The counter `tenant`, arriving with nothing waiting, is lifted to: the lowest of
        the waiting tenants'; with none waiting, the lowest of the other tenants running;
        with none of those either, the highest of all (tenants back from idle start even,
        and none starts below one that is running)."""
        backlogged = {s.tenant for s in waiting}
        if backlogged:
            return min(self._counter[t] for t in backlogged)
        others = {s.tenant for s in running} - {tenant}
        if others:
            return min(self._counter[t] for t in others)
        return max(self._counter.values(), default=0.0)

    def _charge(self, tenant: str | None, amount: float) -> None:
        weight = self._weight.get(tenant, 1.0)
        self._counter[tenant] = self._counter.get(tenant, 0.0) + amount / weight


def make_policy(scheduling: str | None) -> AdmissionPolicy:
    """The policy a config's `scheduling` names (None: FCFS)."""
    if scheduling in (None, "fcfs"):
        return FCFS()
    if scheduling == "vtc":
        return VTC()
    raise ValueError(f"unknown scheduling policy {scheduling!r} (fcfs or vtc)")
