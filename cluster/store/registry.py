"""The AdapterStore's registry: adapter names -> registered versions, and the ways in.

`register` (POST /v1/load_lora_adapter) checks the path against the roots (paths.py),
converts the weights once (conversion.py) and gives them a new version; `resolve` finds a
name nobody registered through the configured resolvers (cluster/resolvers.py),
allow-list first, one lookup per name at a time, and registers what it finds exactly as
an explicit load. Changes of one name are serialized (NameLocks), reads never wait, and
every change reaches the checkpoint (checkpoint.py) before it is answered.

A version that leaves the registry (unloaded, replaced in place) stays fetchable for
RETIRED_TTL_S: requests resolved to it just before may reach a replica that has no copy
yet. `on_removed` hears of each one (the replica reports' change log).

Restored from the checkpoint, the registry lists the same adapters under the same
versions at once, reading no adapter file: each is read, checked and put again on its
first fetch (replicas keep the copies they hold), and one that no longer checks out is
dropped then, with the reason. A checkpoint made under another preload list (the config
changed) is replaced: the config wins.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import ray

from cluster.resolvers import AdapterResolver, ResolveError, allowed
from cluster.store.checkpoint import VERSION_BLOCK, Checkpoint, CheckpointMeta, Saved
from cluster.store.conversion import Converted, Converter
from cluster.store.locks import NameLocks
from cluster.store.paths import AdapterRoots
from replica.wire import AdapterInfo, AdapterKey, AdapterWeightsRef, Listing, applied_text
from router.errors import BadRequestError, NotFoundError

log = logging.getLogger(__name__)

# How long a replaced or unloaded version's weights stay fetchable.
RETIRED_TTL_S = 60.0


@dataclass
class Registration:
    """A registered adapter version and its weights in the object store."""

    info: AdapterInfo
    weights: ray.ObjectRef | None  # None: restored, not read again yet (its first fetch does)


@dataclass(frozen=True)
class Retired:
    """A version that left the registry, fetchable until RETIRED_TTL_S after `since`."""

    info: AdapterInfo
    weights: ray.ObjectRef | None  # None: restored, and removed before any fetch
    since: float  # time.monotonic()


class Registry:
    def __init__(
        self,
        converter: Converter,
        roots: AdapterRoots,
        preload: Mapping[str, str],
        checkpoint: Checkpoint | None,
        resolvers: Sequence[AdapterResolver],
        resolve_allow: Sequence[str],
        incarnation: str,
        on_removed: Callable[[AdapterKey], None],
    ) -> None:
        """`preload`: the config's adapters (trusted: no roots apply), registered unless a
        checkpoint of the same preload list is restored; `checkpoint` None: a restart
        loses runtime loads. `resolvers`, tried in order for names nobody registered
        whose name matches a `resolve_allow` glob. `incarnation` tags every listing."""
        self.converter, self.roots, self.checkpoint = converter, roots, checkpoint
        self.preload = dict(preload)
        self.resolvers, self.resolve_allow = list(resolvers), tuple(resolve_allow)
        self.incarnation, self.on_removed = incarnation, on_removed
        self._adapters: dict[str, Registration] = {}
        self._retired: dict[AdapterKey, Retired] = {}
        self._listing: tuple[AdapterInfo, ...] | None = None  # until the next change
        self._changes = 0  # registry changes so far: the listing's tag
        self._versions = itertools.count(1)
        self._locks = NameLocks()
        self._resolving: dict[str, asyncio.Future[AdapterInfo]] = {}
        self.num_puts = 0
        self.num_ref_requests = 0
        self.num_restored = 0
        self.num_resolved = 0
        self._start()

    # -- changes -------------------------------------------------------------------------------

    async def register(
        self, name: str, path: str, inplace: bool = False, roots: list[str] | None = None
    ) -> AdapterInfo:
        """Check, convert and put `path` under `name`; nothing is registered on error.

        `inplace` replaces a live `name` with a new version in one step (vLLM's
        load_inplace): requests resolved before it finish on the old version, later ones
        get the new one, and no request in between finds the name missing. `roots`: a
        tenant's own directories, each inside the adapter roots, that `path` must lie in."""
        async with self._locks.hold(name):
            if name in self._adapters and not inplace:
                raise BadRequestError(
                    f"adapter {name!r} is already registered; unload it first, or load it "
                    "with load_inplace: true to replace it"
                )
            own = None if roots is None else self.roots.tenant_roots(roots)
            checked = self.roots.check(path, own)
            return await self._add(await self.converter.convert_async(name, checked))

    async def unregister(self, name: str) -> AdapterInfo:
        """Remove `name` for new requests at once; replicas drop their copies when unused."""
        async with self._locks.hold(name):
            registration = self._adapters.pop(name, None)
            if registration is None:
                raise NotFoundError(_not_found(name))
            self._changed()
            self._retire(registration)
            if self.checkpoint is not None:
                await self.checkpoint.delete(name)
            return registration.info

    # -- reads ---------------------------------------------------------------------------------

    async def resolve(self, name: str) -> AdapterInfo:
        """The registered adapter `name`; one nobody registered is looked up by the
        resolvers (concurrent calls for it share one lookup). NotFoundError says why."""
        registration = self._adapters.get(name)
        if registration is not None:
            return registration.info
        if not self.resolvers:
            raise NotFoundError(_not_found(name))
        pending = self._resolving.get(name)
        if pending is None:
            pending = asyncio.ensure_future(self._resolve_new(name))
            self._resolving[name] = pending
            pending.add_done_callback(lambda f: self._resolved(name, f))
        # a caller that gives up (its request's deadline) leaves the lookup to the others
        return await asyncio.shield(pending)

    async def weights(self, key: AdapterKey) -> AdapterWeightsRef:
        """Where version `key`'s weights are, with its info (a replica reserves its ranks
        before fetching). NotFoundError once that version is gone (unloaded)."""
        self.num_ref_requests += 1
        registration = self._adapters.get(key.name)
        if registration is not None and registration.info.version == key.version:
            if registration.weights is None:
                registration = await self._reload(registration.info)
            return AdapterWeightsRef(registration.info, registration.weights)
        self._prune_retired()
        retired = self._retired.get(key)
        if retired is None or retired.weights is None:
            raise NotFoundError(
                f"adapter {key.name!r} version {key.version} is no longer registered"
            )
        return AdapterWeightsRef(retired.info, retired.weights)

    def listing(self, known: str | None = None) -> Listing:
        """Every registered adapter sorted by name (sorted once per change), or None in
        place of the list when `known` is the tag already."""
        tag = f"{self.incarnation}/{self._changes}"
        if known == tag:
            return Listing(tag, None)
        if self._listing is None:
            infos = (r.info for r in self._adapters.values())
            self._listing = tuple(sorted(infos, key=lambda i: i.name))
        return Listing(tag, self._listing)

    def live_versions(self) -> dict[str, int]:
        return {name: r.info.version for name, r in self._adapters.items()}

    def fetchable_removed(self) -> tuple[AdapterKey, ...]:
        """Removed versions whose weights may still be fetched."""
        self._prune_retired()
        return tuple(self._retired)

    def __len__(self) -> int:
        return len(self._adapters)

    # -- internals -----------------------------------------------------------------------------

    def _start(self) -> None:
        """Restore the checkpoint made under this preload list, else register the preloads
        (and start the checkpoint with them)."""
        saved = None if self.checkpoint is None else self.checkpoint.restore()
        if saved is not None and saved.meta.preload == self.preload:
            self._restore(saved)
            return
        for name, path in self.preload.items():
            self._insert(self.converter.convert(name, path), next(self._versions))
        if self.checkpoint is not None:
            meta = CheckpointMeta(self.preload, self._peek_version() + VERSION_BLOCK)
            self.checkpoint.start(Saved(meta, self._infos()))

    def _restore(self, saved: Saved) -> None:
        """List what `saved` lists, reading no file; drop what a gone resolver found."""
        kinds = {r.kind for r in self.resolvers}
        for info in sorted(saved.adapters.values(), key=lambda i: i.version):
            if info.source is not None and info.source not in kinds:
                log.warning(
                    "adapter %r not restored: the %s resolver is gone", info.name, info.source
                )
                continue
            self._adapters[info.name] = Registration(info, None)
            self.num_restored += 1
        # past every version handed out before (some were unloaded since)
        last = max((i.version for i in saved.adapters.values()), default=0)
        self._versions = itertools.count(max(saved.meta.next_version, last + 1))
        assert self.checkpoint is not None
        if len(self._adapters) < len(saved.adapters):
            self.checkpoint.start(Saved(saved.meta, self._infos()))

    async def _add(self, converted: Converted) -> AdapterInfo:
        """Register `converted` under a new version (the caller holds its name's lock)."""
        version = next(self._versions)
        if self.checkpoint is not None:  # reserved before it is handed out: never reused
            await self.checkpoint.reserve(version)
        info = self._insert(converted, version)
        if self.checkpoint is not None:
            await self.checkpoint.save(info)
        log.info("adapter %r v%d applies %s", info.name, version, applied_text(info.applied))
        return info

    def _insert(self, converted: Converted, version: int) -> AdapterInfo:
        """Register under `version`, retiring the version it replaces. Synchronous: no
        request sees a half-done change."""
        info = converted.info(version)
        old = self._adapters.get(info.name)
        self._adapters[info.name] = Registration(info, converted.weights)
        self.num_puts += 1  # counted here, in the event loop: conversions run on threads
        self._changed()
        if old is not None:
            self._retire(old)
        return info

    async def _reload(self, info: AdapterInfo) -> Registration:
        """Read, check and put a restored adapter on its first fetch (one read however many
        replicas ask at once); one that no longer checks out is dropped, with the reason."""
        async with self._locks.hold(info.name):
            registration = self._adapters.get(info.name)
            if registration is None or registration.info.version != info.version:
                raise NotFoundError(
                    f"adapter {info.name!r} version {info.version} is no longer registered"
                )
            if registration.weights is not None:  # another caller read it meanwhile
                return registration
            try:
                converted = await self.converter.in_turn(functools.partial(self._again, info))
            except Exception as e:  # gone or changed on disk since it was registered
                log.warning("adapter %r not restored from %s: %s", info.name, info.path, e)
                del self._adapters[info.name]
                self._changed()
                self._retire(registration)  # replicas still holding a copy drop it
                if self.checkpoint is not None:
                    await self.checkpoint.delete(info.name)
                raise NotFoundError(
                    f"adapter {info.name!r} was registered, but after the store's restart "
                    f"its files no longer check out: {getattr(e, 'message', e)}"
                ) from None
            registration = Registration(
                converted.info(info.version, info.created), converted.weights
            )
            self._adapters[info.name] = registration
            self.num_puts += 1
            if registration.info != info:  # the same directory, other weights now
                self._changed()
                if self.checkpoint is not None:
                    await self.checkpoint.save(registration.info)
            return registration

    def _again(self, info: AdapterInfo) -> Converted:
        """Convert a restored adapter under the checks its first load passed (blocking)."""
        if info.source is not None:  # a resolver found it: it must find the same directory
            resolver = next((r for r in self.resolvers if r.kind == info.source), None)
            if resolver is None:
                raise ValueError(f"the {info.source} resolver is no longer configured")
            found = resolver.find(info.name)
            if str(found.path) != info.path:
                raise ValueError(f"{info.name!r} now resolves to {found.path}")
            checked = self.roots.check(info.path, found.roots)
            return self.converter.convert(info.name, checked, info.source)
        path = info.path
        if self.preload.get(info.name) != path:  # loaded at runtime: the roots apply
            path = str(self.roots.check(path))
        return self.converter.convert(info.name, path)

    async def _resolve_new(self, name: str) -> AdapterInfo:
        if not allowed(name, self.resolve_allow):
            raise NotFoundError(
                f"adapter {name!r} is not registered, and resolve_allow does not let it be "
                "resolved on first request"
            )
        reasons = []
        for resolver in self.resolvers:
            try:
                found = await asyncio.to_thread(resolver.find, name)
                break
            except ResolveError as e:
                reasons.append(f"{resolver.kind}: {e}")
        else:
            raise NotFoundError(
                f"adapter {name!r} is not registered, and no resolver found it "
                f"({'; '.join(reasons)})"
            )
        async with self._locks.hold(name):
            registration = self._adapters.get(name)
            if registration is not None:  # registered explicitly meanwhile
                return registration.info
            try:
                path = self.roots.check(str(found.path), found.roots)
                converted = await self.converter.convert_async(name, path, found.source)
            except BadRequestError as e:
                raise NotFoundError(
                    f"adapter {name!r} is not registered, and what the {found.source} "
                    f"resolver found is not a valid adapter: {e.message}"
                ) from None
            info = await self._add(converted)
            self.num_resolved += 1
            log.info("adapter %r resolved by %s: %s (v%d)", name, found.source, path, info.version)
            return info

    def _resolved(self, name: str, future: asyncio.Future) -> None:
        self._resolving.pop(name, None)
        if not future.cancelled():
            future.exception()  # retrieved: every caller may have gone

    def _changed(self) -> None:
        self._listing = None
        self._changes += 1

    def _retire(self, registration: Registration) -> None:
        """Keep a version that left the registry fetchable for RETIRED_TTL_S, and tell
        on_removed (replicas drop their copies once unused)."""
        self._prune_retired()
        info = registration.info
        self._retired[info.key] = Retired(info, registration.weights, time.monotonic())
        self.on_removed(info.key)

    def _prune_retired(self) -> None:
        now = time.monotonic()
        self._retired = {k: r for k, r in self._retired.items() if now - r.since < RETIRED_TTL_S}

    def _infos(self) -> dict[str, AdapterInfo]:
        return {name: r.info for name, r in self._adapters.items()}

    def _peek_version(self) -> int:
        """The next version `_versions` will hand out, without consuming it."""
        nxt = next(self._versions)
        self._versions = itertools.count(nxt)
        return nxt


def _not_found(name: str) -> str:
    return f"adapter {name!r} is not registered"  # not every name: there may be thousands
