"""The registry's copy outside the store's process: what a restarted store lists at once.

A named detached Ray actor, one per Serve application, keeps it in its own memory (public
Ray API: a named actor with `lifetime="detached"`; no private GCS key-value calls). It
outlives the store's replica, which Serve restarts after a crash, and the store sends it
only what each change changed: one adapter's entry, or the meta record once per
VERSION_BLOCK versions, never the whole registry. It lives as long as the cluster, or
until a store started with another preload list replaces it. It holds plain values (the
dataclasses' fields), so a store of another lorafleet version reads it or, if the fields
differ, starts afresh, and the actor needs none of our types.

The store keeps a mirror of what it sent: a checkpoint actor lost while the store lives
(its node died) is made again and given the whole registry at the next write. Both lost
at once (one node holding both) lose the runtime loads; the preloads come back from the
config either way.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.exceptions import RayActorError

from replica.wire import AdapterInfo

log = logging.getLogger(__name__)

NAMESPACE = "lorafleet"  # the checkpoint actors' Ray namespace
# Versions the meta record reserves at a time: one meta write per this many registrations;
# a restored store skips what was left of the block.
VERSION_BLOCK = 1024


@dataclass(frozen=True)
class CheckpointMeta:
    preload: Mapping[str, str]  # the config's preload list the registry was built from
    next_version: int  # every version handed out so far is below this


@dataclass
class Saved:
    """A registry as checkpointed: its meta record and one entry per adapter."""

    meta: CheckpointMeta
    adapters: dict[str, AdapterInfo] = field(default_factory=dict)


class RegistryKeeper:
    """The checkpoint actor: {"meta": fields, "adapters": name -> fields}, changed an entry
    at a time."""

    def __init__(self) -> None:
        self.saved: dict[str, Any] | None = None

    def load(self) -> dict[str, Any] | None:
        return self.saved

    def replace(self, saved: dict[str, Any]) -> None:
        self.saved = saved

    def put(self, name: str, entry: dict[str, Any]) -> None:
        self._saved()["adapters"][name] = entry

    def delete(self, name: str) -> None:
        self._saved()["adapters"].pop(name, None)

    def put_meta(self, meta: dict[str, Any]) -> None:
        self._saved()["meta"] = meta

    def _saved(self) -> dict[str, Any]:
        if self.saved is None:  # never: the store replaces before it changes anything
            raise RuntimeError("the registry checkpoint was never started")
        return self.saved


class Checkpoint:
    """The store's side: the keeper actor named `name`, and the mirror of what it holds."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.num_writes = 0  # entries and meta records sent
        self._keeper = _keeper(name)
        self._mirror: Saved | None = None

    def restore(self) -> Saved | None:
        """What the keeper holds (None: nothing yet, or in fields this version does not
        read). Blocking: the store's constructor."""
        raw = ray.get(self._keeper.load.remote())
        if raw is None:
            return None
        try:
            saved = Saved(
                CheckpointMeta(**raw["meta"]),
                {name: AdapterInfo(**entry) for name, entry in raw["adapters"].items()},
            )
        except (KeyError, TypeError) as e:
            log.warning("registry checkpoint %r not read (%r): starting afresh", self.name, e)
            return None
        self._mirror = _copy(saved)
        return saved

    def start(self, saved: Saved) -> None:
        """Make `saved` the whole checkpoint (a new registry, or a restored one that
        dropped entries). Blocking: the store's constructor."""
        self._mirror = _copy(saved)
        ray.get(self._keeper.replace.remote(_plain(saved)))

    @property
    def next_version(self) -> int:
        return self._saved().meta.next_version

    async def save(self, info: AdapterInfo) -> None:
        """One adapter's entry, added or replaced."""
        self._saved().adapters[info.name] = info
        await self._write("put", info.name, dataclasses.asdict(info))

    async def delete(self, name: str) -> None:
        self._saved().adapters.pop(name, None)
        await self._write("delete", name)

    async def reserve(self, version: int) -> None:
        """Reserve versions up to `version` + VERSION_BLOCK, unless `version` is reserved."""
        saved = self._saved()
        if version < saved.meta.next_version:
            return
        saved.meta = dataclasses.replace(saved.meta, next_version=version + VERSION_BLOCK)
        await self._write("put_meta", dataclasses.asdict(saved.meta))

    async def _write(self, method: str, *args: Any) -> None:
        self.num_writes += 1
        try:
            await getattr(self._keeper, method).remote(*args)
        except RayActorError as e:  # the keeper is gone: a new one gets everything
            log.warning("registry checkpoint %r lost (%s): writing it again", self.name, e)
            self._keeper = _keeper(self.name)
            await self._keeper.replace.remote(_plain(self._saved()))

    def _saved(self) -> Saved:
        if self._mirror is None:
            raise RuntimeError("the registry checkpoint was never started")
        return self._mirror


_RemoteKeeper = ray.remote(RegistryKeeper)


def _keeper(name: str) -> Any:
    """The keeper actor named `name`, made if there is none (or the last one died)."""
    return _RemoteKeeper.options(
        name=name,
        namespace=NAMESPACE,
        lifetime="detached",
        get_if_exists=True,
        num_cpus=0,
    ).remote()


def _copy(saved: Saved) -> Saved:
    return Saved(saved.meta, dict(saved.adapters))


def _plain(saved: Saved) -> dict[str, Any]:
    """`saved` as the keeper holds it: the dataclasses' fields."""
    adapters = {name: dataclasses.asdict(info) for name, info in saved.adapters.items()}
    return {"meta": dataclasses.asdict(saved.meta), "adapters": adapters}
