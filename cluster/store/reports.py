"""Replica reports: each replica's last stats (for /health, /v1/lorafleet/stats and
`lorafleet bench`), answered with the adapter versions it must drop.

Replicas report every stats period with the registry epoch they have seen; the answer
carries only the versions removed since (unloads, in-place replacements), or the whole
live map when the replica is too far behind or this store is a new incarnation.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from cluster.store.registry import Registry
from replica.wire import AdapterKey, RegistryEpoch, ReportReply

# Removals remembered for replica reports; a replica further behind gets the whole map.
CHANGE_LOG_LEN = 4096


@dataclass(frozen=True)
class Removal:
    epoch: int  # the registry epoch it made: the count of removals up to this one
    key: AdapterKey


@dataclass(frozen=True)
class ReplicaReport:
    at: float  # time.time() of the report
    stats: Mapping[str, Any]


class ReplicaReports:
    def __init__(self, incarnation: str) -> None:
        """`incarnation`: this store's (a restarted store is a new one)."""
        self.incarnation = incarnation
        self._epoch = 0  # versions removed so far
        self._removals: collections.deque[Removal] = collections.deque(maxlen=CHANGE_LOG_LEN)
        self._reports: dict[str, ReplicaReport] = {}

    def removed(self, key: AdapterKey) -> None:
        """A version left the registry (the registry's on_removed)."""
        self._epoch += 1
        self._removals.append(Removal(self._epoch, key))

    def report(
        self,
        replica_id: str,
        stats: Mapping[str, Any],
        seen: RegistryEpoch | None,
        registry: Registry,
    ) -> ReportReply:
        """Keep a replica's report; answer with what it must drop since epoch `seen` (the
        previous answer's; None at first), or every live version of `registry` (and those
        removed ones still fetchable: a fetch of one may cross this answer) when the change
        log cannot tell."""
        self._reports[replica_id] = ReplicaReport(time.time(), stats)
        epoch = RegistryEpoch(self.incarnation, self._epoch)
        removed = self._removed_since(seen)
        if removed is None:
            return ReportReply(epoch, registry.fetchable_removed(), registry.live_versions())
        return ReportReply(epoch, removed)

    def latest(self) -> dict[str, dict[str, Any]]:
        """replica id -> its last stats, with their age (age_s)."""
        now = time.time()
        return {rid: {**r.stats, "age_s": round(now - r.at, 3)} for rid, r in self._reports.items()}

    def _removed_since(self, seen: RegistryEpoch | None) -> tuple[AdapterKey, ...] | None:
        """The versions removed after epoch `seen`; None when the log cannot tell."""
        if seen is None or seen.incarnation != self.incarnation or seen.removals > self._epoch:
            return None
        oldest = self._removals[0].epoch if self._removals else self._epoch + 1
        if seen.removals < oldest - 1:  # removals between seen and the log's start were dropped
            return None
        return tuple(r.key for r in self._removals if r.epoch > seen.removals)
