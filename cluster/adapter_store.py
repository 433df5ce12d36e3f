"""AdapterStore: the cluster's registry of LoRA adapters, weights kept in Ray's object store.

One per application (a Serve deployment of one replica, so the controller
health-checks and restarts it). `register` validates a PEFT directory against
the base model and the limits, converts it once with the engine's conversion
and `ray.put`s it: weights enter the object store once per cluster, however
many replicas use them. Replicas ask for the ObjectRef of the version a request
names and map it zero-copy. Mutations of one name are serialized; reads never wait.

`resolve` is the one way requests find an adapter: a name nobody registered goes to the
configured resolvers (cluster/resolvers.py), allow-list first; one resolution per name
at a time, and what it finds is checked and registered exactly as an explicit load.

Every mutation checkpoints what it changed in Ray's GCS key-value store, which outlives
actors: one key per adapter (name -> path, version, source, and what the registry lists:
rank, modules, bytes) and one meta key (preload list, versions reserved), so a change
writes one key however many adapters there are. A store that Serve restarts after a
crash lists the same adapters under the same versions at once, reading no adapter file:
each is read, checked and put again on its first get_ref (replicas keep the copies they
hold), and one that no longer checks out is dropped then, with the reason. A checkpoint
made under another preload list (the config changed) is dropped: the config wins.

Replicas report every stats period with the registry epoch they have seen; the answer
carries only the versions removed since (unloads, in-place replacements), or the whole
live map when the replica is too far behind or this store is a new incarnation.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray

from cluster.resolvers import AdapterResolver, ResolveError, allowed
from replica.adapters.packing import pack_adapter
from replica.model.adapter_weights import (
    WEIGHTS_FILES,
    AdapterFormatError,
    adapter_weights_file,
    load_peft_adapter,
)
from replica.model.spec import load_model_spec
from router.errors import BadRequestError, NotFoundError

log = logging.getLogger(__name__)

KV_NAMESPACE = "lorafleet"
CANCEL_TTL_S = 120.0  # how long a cancelled request id is passed on to replicas
# How long a replaced or unloaded version's weights stay fetchable: requests the ingress
# resolved to it just before may still reach a replica that has no copy yet.
RETIRED_TTL_S = 60.0
# Removals remembered for replica reports; a replica further behind gets the whole map.
CHANGE_LOG_LEN = 4096
# Conversions running at once (each holds an adapter's tensors in memory, up to
# max_adapter_bytes): two overlap one load's disk reads with another's conversion.
MAX_CONCURRENT_LOADS = 2
# Versions the checkpoint's meta key reserves at a time: one meta write per this many
# registrations; a restored store skips what was left of the block.
VERSION_BLOCK = 1024


@dataclass(frozen=True)
class AdapterInfo:
    """What the registry tells about one registered adapter (no weights)."""

    name: str
    version: int
    path: str
    rank: int
    target_modules: tuple[str, ...]
    nbytes: int
    created: int
    source: str | None = None  # the resolver that found it; None: loaded or preloaded


@dataclass(frozen=True)
class _Loaded:
    """A validated, converted adapter in the object store, not registered yet."""

    name: str
    path: str
    rank: int
    target_modules: tuple[str, ...]
    nbytes: int
    ref: ray.ObjectRef
    source: str | None


class AdapterStore:
    def __init__(
        self,
        model: str,
        max_lora_rank: int,
        adapter_roots: list[str],
        preload: dict[str, str],
        reserved_names: tuple[str, ...] = (),
        max_adapter_bytes: int | None = None,
        checkpoint: bool = False,
        resolvers: Sequence[AdapterResolver] = (),
        resolve_allow: Sequence[str] = ("*",),
        lora_embeddings: bool = False,
    ) -> None:
        """`checkpoint`: keep the registry in Ray's GCS key-value store, under the Serve
        application's name (off: a restart loses runtime loads). `resolvers`, tried in
        order for names nobody registered whose name matches a `resolve_allow` glob."""
        self.spec = load_model_spec(model)
        self.max_lora_rank = max_lora_rank
        self.lora_embeddings = lora_embeddings  # the engine's: refuse what it cannot serve
        self.roots = [Path(r).resolve() for r in adapter_roots]
        self.reserved = set(reserved_names)
        self.max_adapter_bytes = max_adapter_bytes
        self.resolvers = list(resolvers)
        self.resolve_allow = tuple(resolve_allow)
        # name -> (info, weights); weights None: restored, not read again yet (get_ref does)
        self._adapters: dict[str, tuple[AdapterInfo, ray.ObjectRef | None]] = {}
        self._listing: list[AdapterInfo] | None = None  # list()'s answer until a change
        self._changes = 0  # registry changes so far: listing()'s tag
        self._versions = itertools.count(1)
        # (name, version) -> (weights, when retired, rank)
        self._retired: dict[tuple[str, int], tuple[ray.ObjectRef | None, float, int]] = {}
        self._name_locks: dict[str, tuple[asyncio.Lock, int]] = {}  # lock, holders+waiters
        self._loads = asyncio.Semaphore(MAX_CONCURRENT_LOADS)
        self._resolving: dict[str, asyncio.Future[AdapterInfo]] = {}
        # registry epoch: +1 per removed version; (epoch, name, version) of recent removals
        self.incarnation = uuid.uuid4().hex
        self._epoch = 0
        self._removals: collections.deque[tuple[int, str, int]] = collections.deque(
            maxlen=CHANGE_LOG_LEN
        )
        self._replica_stats: dict[str, tuple[float, dict]] = {}
        self._cancelled: dict[str, float] = {}  # request id -> when the ingress gave up
        self.num_puts = 0
        self.num_ref_requests = 0
        self.num_restored = 0
        self.num_resolved = 0
        self.num_kv_writes = 0  # checkpoint keys written or deleted
        self._kv_prefix = _checkpoint_prefix() if checkpoint else None
        self._preload = dict(preload)
        self._reserved = 0  # versions below this are reserved in the checkpoint's meta key
        if not self._restore():
            self._kv_clear()
            self._kv_put_meta(self._peek_version() + VERSION_BLOCK)
            for name, path in preload.items():  # the operator's config: trusted, no roots
                self._insert(self._load(name, path))

    # -- mutations -----------------------------------------------------------------------------

    async def register(
        self, name: str, path: str, inplace: bool = False, roots: list[str] | None = None
    ) -> AdapterInfo:
        """Validate, convert and put `path` under `name`. Nothing is registered on error.

        `inplace` replaces a live `name` with a new version in one step (vLLM's
        load_inplace): requests resolved before it finish on the old version, later ones
        get the new one, and no request in between finds the name missing. `roots`: a
        tenant's own directories, each inside the adapter roots, that `path` must lie in."""
        async with self._name_lock(name):
            if name in self._adapters and not inplace:
                raise BadRequestError(
                    f"adapter {name!r} is already registered; unload it first, or load it "
                    "with load_inplace: true to replace it"
                )
            resolved = self._check_path(path, None if roots is None else self._own_roots(roots))
            return self._insert(await self._load_async(name, resolved))

    async def unregister(self, name: str) -> AdapterInfo:
        """Remove `name` for new requests at once; replicas drop their copies when unused."""
        async with self._name_lock(name):
            entry = self._adapters.pop(name, None)
            if entry is None:
                raise NotFoundError(self._not_found(name))
            self._changed()
            self._retire(*entry)
            self._kv_delete(name)
            return entry[0]

    # -- reads ---------------------------------------------------------------------------------
    # Every method is async: Serve runs a deployment's sync methods on a thread pool, where
    # they would read the registry while a mutation on the event loop changes it.

    async def resolve(self, name: str) -> AdapterInfo:
        """The registered adapter `name`; one nobody registered is looked up by the
        resolvers (concurrent calls for it share one lookup). NotFoundError says why."""
        entry = self._adapters.get(name)
        if entry is not None:
            return entry[0]
        if not self.resolvers:
            raise NotFoundError(self._not_found(name))
        pending = self._resolving.get(name)
        if pending is None:
            pending = asyncio.ensure_future(self._resolve_new(name))
            self._resolving[name] = pending
            pending.add_done_callback(lambda f: self._resolved(name, f))
        # a caller that gives up (its request's deadline) leaves the lookup to the others
        return await asyncio.shield(pending)

    async def get_ref(self, name: str, version: int) -> list[Any]:
        """[the weights of one version, its rank]: the reference in a list so Ray hands it
        over, not the value; the rank so a replica reserves exactly its rows before
        fetching. Raises NotFoundError if that version is gone (unloaded)."""
        self.num_ref_requests += 1
        entry = self._adapters.get(name)
        if entry is not None and entry[0].version == version:
            if entry[1] is None:
                entry = await self._reload(name, version)
            return [entry[1], entry[0].rank]
        self._prune_retired()
        retired = self._retired.get((name, version))
        if retired is None or retired[0] is None:  # None: restored, unloaded before any use
            raise NotFoundError(f"adapter {name!r} version {version} is no longer registered")
        return [retired[0], retired[2]]

    async def list(self) -> list[AdapterInfo]:
        """Every registered adapter, sorted by name (once per change, not once per call)."""
        if self._listing is None:
            self._listing = sorted((i for i, _ in self._adapters.values()), key=lambda i: i.name)
        return self._listing

    async def listing(
        self, known: tuple[str, int] | None = None
    ) -> tuple[tuple[str, int], list[AdapterInfo] | None]:
        """(tag, list()), or (tag, None) when `known` is the tag already: a caller that
        keeps its last answer moves the registry only when it changed, so GET /v1/models
        with 10,000 adapters costs a call, not 10,000 entries pickled and rendered."""
        tag = (self.incarnation, self._changes)
        return tag, (None if known == tag else await self.list())

    async def live_versions(self) -> dict[str, int]:
        return self._live_versions()

    async def stats(self) -> dict[str, Any]:
        return {
            "num_adapters": len(self._adapters),
            "num_puts": self.num_puts,
            "num_ref_requests": self.num_ref_requests,
            "num_restored": self.num_restored,
            "num_resolved": self.num_resolved,
            "num_kv_writes": self.num_kv_writes,
        }

    # -- replica reports (for `lorafleet bench` and operators) ----------------------------------

    async def report_replica(
        self, replica_id: str, stats: dict, seen: tuple[str, int] | None = None
    ) -> dict[str, Any]:
        """A replica's periodic report. `seen` is the `epoch` of the previous answer it
        got (None at first). Answers with the new `epoch`, the adapter versions removed
        since `seen` (`removed`: [name, version] pairs; unloads and in-place
        replacements), and the requests the ingress gave up on. When `seen` is from
        another incarnation of the store or older than the change log, `live` (name ->
        version) lists every live version instead, and `removed` those removed versions
        that are still fetchable (a fetch of one may cross this answer)."""
        self._replica_stats[replica_id] = (time.time(), stats)
        answer: dict[str, Any] = {
            "epoch": (self.incarnation, self._epoch),
            "cancelled": list(self._cancelled),
        }
        removed = self._removed_since(seen)
        if removed is None:
            self._prune_retired()
            answer["live"] = self._live_versions()
            removed = list(self._retired)
        answer["removed"] = removed
        return answer

    async def cancel_requests(self, request_ids: list[str]) -> None:
        """Requests whose client left or whose deadline passed. Serve's own cancellation
        does not always reach the replica's generator; this reaches it within a stats
        period, whatever state the request was in."""
        now = time.time()
        self._cancelled = {r: t for r, t in self._cancelled.items() if now - t < CANCEL_TTL_S}
        self._cancelled.update(dict.fromkeys(request_ids, now))

    async def replica_stats(self) -> dict[str, dict]:
        now = time.time()
        return {
            rid: {**s, "age_s": round(now - t, 3)} for rid, (t, s) in self._replica_stats.items()
        }

    # -- internals -----------------------------------------------------------------------------

    def _changed(self) -> None:
        self._listing = None
        self._changes += 1

    def _live_versions(self) -> dict[str, int]:
        return {name: info.version for name, (info, _) in self._adapters.items()}

    def _load(self, name: str, path: str | Path, source: str | None = None) -> _Loaded:
        """Validate and convert `path`, put the weights in the object store (blocking)."""
        if name in self.reserved:
            raise BadRequestError(f"adapter name {name!r} is reserved (the base model's name)")
        self._check_size(Path(path))
        try:
            weights = load_peft_adapter(
                path, self.spec, self.max_lora_rank, name, self.lora_embeddings
            )
        except AdapterFormatError as e:
            raise BadRequestError(str(e)) from None
        ref = ray.put(pack_adapter(weights))
        return _Loaded(
            name, str(path), weights.rank, weights.target_modules, weights.nbytes, ref, source
        )

    async def _load_async(self, name: str, path: Path, source: str | None = None) -> _Loaded:
        async with self._loads:
            return await asyncio.to_thread(self._load, name, path, source)

    async def _reload(self, name: str, version: int) -> tuple[AdapterInfo, ray.ObjectRef]:
        """Read, check and put a restored adapter on its first use (one read however many
        replicas ask at once); one that no longer checks out is dropped, with the reason."""
        async with self._name_lock(name):
            entry = self._adapters.get(name)
            if entry is None or entry[0].version != version:  # unloaded or replaced meanwhile
                raise NotFoundError(f"adapter {name!r} version {version} is no longer registered")
            if entry[1] is not None:  # another caller read it meanwhile
                return entry
            info = entry[0]
            try:
                async with self._loads:
                    loaded = await asyncio.to_thread(
                        self._restore_one, name, info.path, info.source
                    )
            except Exception as e:  # gone or changed on disk since it was registered
                log.warning("adapter %r not restored from %s: %s", name, info.path, e)
                del self._adapters[name]
                self._changed()
                self._retire(info, None)  # replicas still holding a copy drop it
                self._kv_delete(name)
                raise NotFoundError(
                    f"adapter {name!r} was registered, but after the store's restart its "
                    f"files no longer check out: {getattr(e, 'message', e)}"
                ) from None
            entry = self._adapters[name] = (self._info(loaded, version, info.created), loaded.ref)
            self.num_puts += 1
            if entry[0] != info:  # the same directory, other weights now
                self._changed()
                self._kv_put(entry[0])
            return entry

    def _info(self, loaded: _Loaded, version: int, created: int | None = None) -> AdapterInfo:
        return AdapterInfo(
            name=loaded.name,
            version=version,
            path=loaded.path,
            rank=loaded.rank,
            target_modules=loaded.target_modules,
            nbytes=loaded.nbytes,
            created=int(time.time()) if created is None else created,
            source=loaded.source,
        )

    def _insert(self, loaded: _Loaded, version: int | None = None) -> AdapterInfo:
        """Register a loaded adapter under a new version (or `version`, restoring),
        retiring the one it replaces. Synchronous: no request sees a half-done change."""
        info = self._info(loaded, next(self._versions) if version is None else version)
        old = self._adapters.get(info.name)
        self._adapters[info.name] = (info, loaded.ref)
        self.num_puts += 1  # counted here, in the event loop: loads run on threads
        self._changed()
        if old is not None:
            self._retire(*old)
        if version is None:
            self._kv_put(info)
        return info

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
        async with self._name_lock(name):
            entry = self._adapters.get(name)
            if entry is not None:  # registered explicitly meanwhile
                return entry[0]
            try:
                path = self._check_path(str(found.path), found.roots)
                loaded = await self._load_async(name, path, found.source)
            except BadRequestError as e:
                raise NotFoundError(
                    f"adapter {name!r} is not registered, and what the {found.source} "
                    f"resolver found is not a valid adapter: {e.message}"
                ) from None
            info = self._insert(loaded)
            self.num_resolved += 1
            log.info("adapter %r resolved by %s: %s (v%d)", name, found.source, path, info.version)
            return info

    def _resolved(self, name: str, future: asyncio.Future) -> None:
        self._resolving.pop(name, None)
        if not future.cancelled():
            future.exception()  # retrieved: every caller may have gone

    @contextlib.asynccontextmanager
    async def _name_lock(self, name: str) -> AsyncIterator[None]:
        """Serialize mutations of one name; other names go on meanwhile. The lock goes
        when nobody holds or waits for it: thousands of names leave nothing behind."""
        lock, users = self._name_locks.get(name, (asyncio.Lock(), 0))
        self._name_locks[name] = (lock, users + 1)
        try:
            async with lock:
                yield
        finally:
            lock, users = self._name_locks[name]
            if users == 1:
                del self._name_locks[name]
            else:
                self._name_locks[name] = (lock, users - 1)

    def _check_path(self, path: str, roots: Sequence[Path] | None = None) -> Path:
        """`path` and the files read from it must lie inside one of `roots` (default: the
        adapter roots), symlinks resolved (no traversal, no symlink escape)."""
        if roots is None:
            roots = self.roots
            if not roots:
                raise BadRequestError(
                    "loading adapters at runtime is disabled: no adapter_roots are configured"
                )
        try:
            resolved = Path(path).resolve(strict=True)
        except (OSError, RuntimeError, ValueError):  # ValueError: a NUL byte in the path
            raise BadRequestError(f"adapter path {path!r} does not exist") from None
        files = [resolved / "adapter_config.json", *(resolved / f for f in WEIGHTS_FILES)]
        for p in [resolved, *(f.resolve() for f in files if f.exists())]:
            if not any(p.is_relative_to(root) for root in roots):
                shown = ", ".join(str(r) for r in roots)
                raise BadRequestError(
                    f"adapter path {path!r} is outside the configured adapter roots ({shown})"
                )
        return resolved

    def _own_roots(self, roots: list[str]) -> list[Path]:
        """A tenant's roots, resolved; each must lie inside the adapter roots."""
        if not self.roots:
            raise BadRequestError(
                "loading adapters at runtime is disabled: no adapter_roots are configured"
            )
        own = [Path(r).resolve() for r in roots]
        for root in own:
            if not any(root.is_relative_to(r) for r in self.roots):
                raise BadRequestError(f"tenant adapter root {str(root)!r} is outside adapter_roots")
        return own

    def _check_size(self, path: Path) -> None:
        """Refuse weights over max_adapter_bytes before reading them."""
        weights = adapter_weights_file(path)
        if self.max_adapter_bytes is None or weights is None:
            return  # the format check names a missing file
        size = weights.stat().st_size
        if size > self.max_adapter_bytes:
            raise BadRequestError(
                f"adapter {path.name!r}: {weights.name} is {size} bytes, over the "
                f"limit of {self.max_adapter_bytes} (max_adapter_bytes)"
            )

    def _not_found(self, name: str) -> str:
        return f"adapter {name!r} is not registered"  # not every name: there may be thousands

    def _retire(self, info: AdapterInfo, ref: ray.ObjectRef | None) -> None:
        """Keep a version that left the registry fetchable for RETIRED_TTL_S, and tell
        replicas (next report) to drop their copies once unused."""
        self._prune_retired()
        self._retired[(info.name, info.version)] = (ref, time.monotonic(), info.rank)
        self._epoch += 1
        self._removals.append((self._epoch, info.name, info.version))

    def _prune_retired(self) -> None:
        now = time.monotonic()
        self._retired = {k: v for k, v in self._retired.items() if now - v[1] < RETIRED_TTL_S}

    def _removed_since(self, seen: tuple[str, int] | None) -> list[tuple[str, int]] | None:
        """[name, version] removed after epoch `seen`; None when the log cannot tell."""
        if seen is None or seen[0] != self.incarnation or seen[1] > self._epoch:
            return None
        oldest = self._removals[0][0] if self._removals else self._epoch + 1
        if seen[1] < oldest - 1:  # removals between seen and the log's start were dropped
            return None
        return [(name, version) for epoch, name, version in self._removals if epoch > seen[1]]

    # -- checkpoint in the GCS key-value store -------------------------------------------------

    def _kv_put(self, info: AdapterInfo) -> None:
        """Checkpoint one registration: its own key (and, once per VERSION_BLOCK
        versions, the meta key reserving the next block)."""
        if self._kv_prefix is None:
            return
        from ray.experimental import internal_kv

        if info.version >= self._reserved:  # reserved before it is handed out: no reuse
            self._kv_put_meta(info.version + VERSION_BLOCK)
        entry = {
            "name": info.name,
            "path": info.path,
            "version": info.version,
            "rank": info.rank,
            "target_modules": list(info.target_modules),
            "nbytes": info.nbytes,
            "created": info.created,
        }
        if info.source is not None:
            entry["source"] = info.source
        internal_kv._internal_kv_put(
            self._adapter_key(info.name), json.dumps(entry), overwrite=True, namespace=KV_NAMESPACE
        )
        self.num_kv_writes += 1

    def _kv_put_meta(self, reserved: int) -> None:
        """The preload list the checkpoint belongs to, and the versions handed out so far
        (all below `reserved`): a restored store starts there."""
        if self._kv_prefix is None:
            return
        from ray.experimental import internal_kv

        meta = {"preload": self._preload, "next": reserved}
        internal_kv._internal_kv_put(
            self._kv_prefix + "meta", json.dumps(meta), overwrite=True, namespace=KV_NAMESPACE
        )
        self._reserved = reserved
        self.num_kv_writes += 1

    def _kv_delete(self, name: str) -> None:
        if self._kv_prefix is None:
            return
        from ray.experimental import internal_kv

        internal_kv._internal_kv_del(self._adapter_key(name), namespace=KV_NAMESPACE)
        self.num_kv_writes += 1

    def _kv_clear(self) -> None:
        """Drop a checkpoint this store will not restore (another config's, or none)."""
        if self._kv_prefix is None:
            return
        from ray.experimental import internal_kv

        internal_kv._internal_kv_del(self._kv_prefix, del_by_prefix=True, namespace=KV_NAMESPACE)

    def _adapter_key(self, name: str) -> str:
        assert self._kv_prefix is not None
        return f"{self._kv_prefix}adapter/{name}"

    def _restore(self) -> bool:
        """Rebuild the registry from the checkpoint; False if there is none for this config."""
        if self._kv_prefix is None:
            return False
        from ray.experimental import internal_kv

        raw = internal_kv._internal_kv_get(self._kv_prefix + "meta", namespace=KV_NAMESPACE)
        if raw is None:
            return False
        meta = json.loads(raw)
        if meta.get("preload") != self._preload:
            return False
        keys = internal_kv._internal_kv_list(self._kv_prefix + "adapter/", namespace=KV_NAMESPACE)
        entries = [json.loads(v) for v in _kv_multi_get(keys).values() if v is not None]
        last = 0
        for entry in sorted(entries, key=lambda e: e["version"]):
            name, path, version = entry["name"], entry["path"], entry["version"]
            last = max(last, version)
            source = entry.get("source")
            if source is not None and not any(r.kind == source for r in self.resolvers):
                log.warning("adapter %r not restored: the %s resolver is gone", name, source)
                self._kv_delete(name)
                continue
            info = _listed(entry)
            if info is not None:
                self._adapters[name] = (info, None)  # read again on first use (_reload)
                self.num_restored += 1
                continue
            try:  # an entry from before checkpoints recorded the listing: read it now
                self._kv_put(self._insert(self._restore_one(name, path, source), version))
                self.num_restored += 1
            except Exception as e:  # gone or changed on disk since: drop it
                log.warning("adapter %r not restored from %s: %s", name, path, e)
                self._kv_delete(name)
        # past every version handed out before (some were unloaded since: not in `last`)
        self._versions = itertools.count(max(meta["next"], last + 1))
        return True

    def _restore_one(self, name: str, path: str, source: str | None) -> _Loaded:
        """Load a checkpointed adapter under the checks its first load passed."""
        if source is not None:  # found by a resolver: it must still find the same directory
            resolver = next((r for r in self.resolvers if r.kind == source), None)
            if resolver is None:
                raise ValueError(f"the {source} resolver is no longer configured")
            found = resolver.find(name)
            if str(found.path) != path:
                raise ValueError(f"{name!r} now resolves to {found.path}")
            return self._load(name, self._check_path(path, found.roots), source)
        if self._preload.get(name) != path:  # loaded at runtime: the roots apply
            path = str(self._check_path(path))
        return self._load(name, path)

    def _peek_version(self) -> int:
        """The next version `_versions` will hand out, without consuming it."""
        nxt = next(self._versions)
        self._versions = itertools.count(nxt)
        return nxt


def _listed(entry: dict[str, Any]) -> AdapterInfo | None:
    """The AdapterInfo a checkpoint entry records; None for an entry from before it did."""
    if not {"rank", "target_modules", "nbytes", "created"} <= entry.keys():
        return None
    return AdapterInfo(
        name=entry["name"],
        version=int(entry["version"]),
        path=entry["path"],
        rank=int(entry["rank"]),
        target_modules=tuple(entry["target_modules"]),
        nbytes=int(entry["nbytes"]),
        created=int(entry["created"]),
        source=entry.get("source"),
    )


def _kv_multi_get(keys: list[bytes]) -> dict[bytes, bytes | None]:
    """Values of `keys` in one GCS round trip (Ray's GcsClient), else one call per key."""
    from ray.experimental import internal_kv

    client = internal_kv.global_gcs_client
    multi_get = getattr(client, "internal_kv_multi_get", None)
    if multi_get is not None and keys:
        return multi_get(keys, KV_NAMESPACE.encode())
    return {k: internal_kv._internal_kv_get(k, namespace=KV_NAMESPACE) for k in keys}


def _checkpoint_prefix() -> str:
    from ray import serve

    return f"adapter-registry/{serve.get_replica_context().app_name}/"
