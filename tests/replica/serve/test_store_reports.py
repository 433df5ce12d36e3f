"""A replica drops its copies of the adapter versions the store removed, from answers
that carry only the changes (cluster/store/reports.py): also a version whose fetch
crossed the answer that announced its removal."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from replica.adapters.object_store import ObjectStoreSource
from replica.serve.deployment import LoRAReplica
from replica.wire import AdapterInfo, AdapterKey, AdapterWeightsRef, RegistryEpoch, ReportReply


def stored(key: AdapterKey) -> AdapterWeightsRef:
    """The store's answer to a fetch of `key` (a stand-in for the weights' reference)."""
    info = AdapterInfo(key.name, key.version, {"qkv_proj": 8}, "/a", ("q_proj",), 0, 0)
    return AdapterWeightsRef(info, f"ref-{key}")


@dataclass
class Store:
    """Answers each report with the next scripted answer; keeps the epochs it was sent."""

    answers: list[ReportReply]
    seen: list[RegistryEpoch | None] = field(default_factory=list)

    @property
    def report_replica(self) -> Any:
        return _Remote(self._report)

    @property
    def get_weights(self) -> Any:
        return _Remote(stored)

    def _report(self, replica_id: str, stats: dict, seen: RegistryEpoch | None) -> ReportReply:
        self.seen.append(seen)
        return self.answers.pop(0)


@dataclass
class _Remote:
    fn: Any

    def remote(self, *args: Any) -> Any:
        async def call() -> Any:
            return self.fn(*args)

        return call()


class Engine:
    def __init__(self, source: ObjectStoreSource) -> None:
        self.source, self.unloaded = source, []

    def unload_adapter(self, key: str) -> None:
        self.unloaded.append(key)
        self.source.remove(key)  # at once: no request in flight here


class AsyncEngine:
    async def call(self, fn: Any) -> Any:
        return fn()

    def shutdown(self) -> None:  # LoRAReplica.__del__
        pass


def replica(store: Store, held: list[str]) -> Any:
    r = LoRAReplica.__new__(LoRAReplica)
    r.source = ObjectStoreSource()
    for key in held:
        r.source.add(stored(AdapterKey.parse(key)))
    r.engine, r.aengine, r.store = Engine(r.source), AsyncEngine(), store
    r.replica_id, r._fetching = "r1", {}
    r._store_epoch, r._removed = None, {}
    return r


def test_reports_drop_removed_versions_and_keep_the_rest():
    epoch, later = RegistryEpoch("store-1", 0), RegistryEpoch("store-1", 2)
    store = Store(
        [
            ReportReply(epoch, live={"a": 1, "b": 2}),
            ReportReply(later, (AdapterKey("b", 2), AdapterKey("gone", 9))),
            ReportReply(later),
        ]
    )
    r = replica(store, ["a@v1", "b@v2", "old@v7"])

    async def main():
        await r._report({})  # the whole map: old@v7 is not live
        assert sorted(r.engine.unloaded) == ["old@v7"]
        await r._report({})
        assert r.engine.unloaded[-1] == "b@v2" and r.source.names() == ["a@v1"]
        await r._report({})

    asyncio.run(main())
    assert store.seen == [None, epoch, later]  # each report sends the last epoch


def test_a_fetch_that_lands_after_its_removal_was_announced_is_dropped_next_report():
    store = Store(
        [
            ReportReply(RegistryEpoch("s", 1), (AdapterKey("late", 3),)),
            ReportReply(RegistryEpoch("s", 1)),
        ]
    )
    r = replica(store, [])
    r._store_epoch = RegistryEpoch("s", 0)

    async def main():
        await r._report({})  # announces the removal before this replica holds it
        assert r.engine.unloaded == []
        await r._ensure_adapter(AdapterKey("late", 3))  # then the fetch lands
        assert "late@v3" in r.source
        await r._report({})  # nothing new in the answer, but the removal is remembered

    asyncio.run(main())
    assert r.engine.unloaded == ["late@v3"] and "late@v3" not in r.source
