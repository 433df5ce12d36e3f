"""AdapterStore: the cluster's registry of LoRA adapters, weights kept in Ray's object store.

One per application (a Serve deployment of one replica, so the controller
health-checks and restarts it). `register` validates a PEFT directory against
the base model and the limits, converts it once with the engine's conversion
and `ray.put`s it: weights enter the object store once per cluster, however
many replicas use them. Replicas ask for the ObjectRef of the version a request
names and map it zero-copy. Mutations are serialized; reads never wait on them.

Every mutation checkpoints the registry (name -> path, version) in Ray's GCS key-value
store, which outlives actors: a store that Serve restarts after a crash re-registers the
same adapters under the same versions (replicas keep their copies). A checkpoint made
under another preload list (the config changed) is ignored: the config wins.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray

from replica.adapters.packing import pack_adapter
from replica.model.adapter_weights import AdapterFormatError, load_peft_adapter
from replica.model.spec import load_model_spec
from router.errors import BadRequestError, NotFoundError

log = logging.getLogger(__name__)

KV_NAMESPACE = "lorafleet"
CANCEL_TTL_S = 120.0  # how long a cancelled request id is passed on to replicas
# How long a replaced or unloaded version's weights stay fetchable: requests the ingress
# resolved to it just before may still reach a replica that has no copy yet.
RETIRED_TTL_S = 60.0


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
    ) -> None:
        """`checkpoint`: keep the registry in Ray's GCS key-value store, under the Serve
        application's name (off: a restart loses runtime loads)."""
        self.spec = load_model_spec(model)
        self.max_lora_rank = max_lora_rank
        self.roots = [Path(r).resolve() for r in adapter_roots]
        self.reserved = set(reserved_names)
        self.max_adapter_bytes = max_adapter_bytes
        self._adapters: dict[str, tuple[AdapterInfo, ray.ObjectRef]] = {}
        self._versions = itertools.count(1)
        self._retired: dict[tuple[str, int], tuple[ray.ObjectRef, float]] = {}
        self._lock = asyncio.Lock()
        self._replica_stats: dict[str, tuple[float, dict]] = {}
        self._cancelled: dict[str, float] = {}  # request id -> when the ingress gave up
        self.num_puts = 0
        self.num_ref_requests = 0
        self.num_restored = 0
        self._checkpoint_key = _checkpoint_key() if checkpoint else None
        self._preload = dict(preload)
        if not self._restore():
            for name, path in preload.items():  # the operator's config: trusted, no roots
                self._add(name, path)
            self._checkpoint()

    # -- mutations -----------------------------------------------------------------------------

    async def register(self, name: str, path: str, inplace: bool = False) -> AdapterInfo:
        """Validate, convert and put `path` under `name`. Nothing is registered on error.

        `inplace` replaces a live `name` with a new version in one step (vLLM's
        load_inplace): requests resolved before it finish on the old version, later ones
        get the new one, and no request in between finds the name missing."""
        async with self._lock:
            old = self._adapters.get(name)
            if old is not None and not inplace:
                raise BadRequestError(
                    f"adapter {name!r} is already registered; unload it first, or load it "
                    "with load_inplace: true to replace it"
                )
            resolved = self._check_path(path)
            info = await asyncio.to_thread(self._add, name, resolved)
            if old is not None:
                self._retire(*old)
            self._checkpoint()
            return info

    async def unregister(self, name: str) -> AdapterInfo:
        """Remove `name` for new requests at once; replicas drop their copies when unused."""
        async with self._lock:
            entry = self._adapters.pop(name, None)
            if entry is None:
                raise NotFoundError(self._not_found(name))
            self._retire(*entry)
            self._checkpoint()
            return entry[0]

    # -- reads ---------------------------------------------------------------------------------

    def resolve(self, name: str) -> AdapterInfo:
        entry = self._adapters.get(name)
        if entry is None:
            raise NotFoundError(self._not_found(name))
        return entry[0]

    def get_ref(self, name: str, version: int) -> list[ray.ObjectRef]:
        """The weights of one version, wrapped in a list so Ray hands over the reference,
        not the value. Raises NotFoundError if that version is gone (unloaded)."""
        self.num_ref_requests += 1
        entry = self._adapters.get(name)
        if entry is not None and entry[0].version == version:
            return [entry[1]]
        self._prune_retired()
        retired = self._retired.get((name, version))
        if retired is None:
            raise NotFoundError(f"adapter {name!r} version {version} is no longer registered")
        return [retired[0]]

    def list(self) -> list[AdapterInfo]:
        return sorted((info for info, _ in self._adapters.values()), key=lambda i: i.name)

    def live_versions(self) -> dict[str, int]:
        return {name: info.version for name, (info, _) in self._adapters.items()}

    def stats(self) -> dict[str, Any]:
        return {
            "num_adapters": len(self._adapters),
            "num_puts": self.num_puts,
            "num_ref_requests": self.num_ref_requests,
            "num_restored": self.num_restored,
        }

    # -- replica reports (for `lorafleet bench` and operators) ----------------------------------

    def report_replica(self, replica_id: str, stats: dict) -> dict[str, Any]:
        """A replica's periodic report; answers with the live versions (so it can drop
        references to unloaded adapters) and the requests the ingress gave up on."""
        self._replica_stats[replica_id] = (time.time(), stats)
        return {"live": self.live_versions(), "cancelled": list(self._cancelled)}

    def cancel_requests(self, request_ids: list[str]) -> None:
        """Requests whose client left or whose deadline passed. Serve's own cancellation
        does not always reach the replica's generator; this reaches it within a stats
        period, whatever state the request was in."""
        now = time.time()
        self._cancelled = {r: t for r, t in self._cancelled.items() if now - t < CANCEL_TTL_S}
        self._cancelled.update(dict.fromkeys(request_ids, now))

    def replica_stats(self) -> dict[str, dict]:
        now = time.time()
        return {
            rid: {**s, "age_s": round(now - t, 3)} for rid, (t, s) in self._replica_stats.items()
        }

    # -- internals -----------------------------------------------------------------------------

    def _add(self, name: str, path: str | Path, version: int | None = None) -> AdapterInfo:
        if name in self.reserved:
            raise BadRequestError(f"adapter name {name!r} is reserved (the base model's name)")
        self._check_size(Path(path))
        try:
            weights = load_peft_adapter(path, self.spec, self.max_lora_rank, name)
        except AdapterFormatError as e:
            raise BadRequestError(str(e)) from None
        info = AdapterInfo(
            name=name,
            version=next(self._versions) if version is None else version,
            path=str(path),
            rank=weights.rank,
            target_modules=weights.target_modules,
            nbytes=weights.nbytes,
            created=int(time.time()),
        )
        self._adapters[name] = (info, ray.put(pack_adapter(weights)))
        self.num_puts += 1
        return info

    def _check_path(self, path: str) -> Path:
        """`path` and the files read from it must lie inside an adapter root, symlinks
        resolved (no traversal, no symlink escape)."""
        if not self.roots:
            raise BadRequestError(
                "loading adapters at runtime is disabled: no adapter_roots are configured"
            )
        try:
            resolved = Path(path).resolve(strict=True)
        except (OSError, RuntimeError, ValueError):  # ValueError: a NUL byte in the path
            raise BadRequestError(f"adapter path {path!r} does not exist") from None
        files = [resolved / "adapter_config.json", resolved / "adapter_model.safetensors"]
        for p in [resolved, *(f.resolve() for f in files if f.exists())]:
            if not any(p.is_relative_to(root) for root in self.roots):
                roots = ", ".join(str(r) for r in self.roots)
                raise BadRequestError(
                    f"adapter path {path!r} is outside the configured adapter roots ({roots})"
                )
        return resolved

    def _check_size(self, path: Path) -> None:
        """Refuse weights over max_adapter_bytes before reading them."""
        weights = path / "adapter_model.safetensors"
        if self.max_adapter_bytes is None or not weights.is_file():
            return  # the format check names a missing file
        size = weights.stat().st_size
        if size > self.max_adapter_bytes:
            raise BadRequestError(
                f"adapter {path.name!r}: adapter_model.safetensors is {size} bytes, over the "
                f"limit of {self.max_adapter_bytes} (max_adapter_bytes)"
            )

    # -- checkpoint in the GCS key-value store -------------------------------------------------

    def _checkpoint(self) -> None:
        if self._checkpoint_key is None:
            return
        from ray.experimental import internal_kv

        registry = {n: [info.path, info.version] for n, (info, _) in self._adapters.items()}
        state = {"preload": self._preload, "registry": registry, "next": self._peek_version()}
        internal_kv._internal_kv_put(
            self._checkpoint_key, json.dumps(state), overwrite=True, namespace=KV_NAMESPACE
        )

    def _restore(self) -> bool:
        """Rebuild the registry from the checkpoint; False if there is none for this config."""
        if self._checkpoint_key is None:
            return False
        from ray.experimental import internal_kv

        raw = internal_kv._internal_kv_get(self._checkpoint_key, namespace=KV_NAMESPACE)
        if raw is None:
            return False
        state = json.loads(raw)
        if state.get("preload") != self._preload:
            return False
        for name, (path, version) in sorted(state["registry"].items(), key=lambda kv: kv[1][1]):
            try:
                if self._preload.get(name) != path:  # loaded at runtime: the roots apply
                    path = self._check_path(path)
                self._add(name, path, version)
                self.num_restored += 1
            except Exception as e:  # gone or changed on disk since: drop it, keep the rest
                log.warning("adapter %r not restored from %s: %s", name, path, e)
        self._versions = itertools.count(state["next"])
        self._checkpoint()
        return True

    def _peek_version(self) -> int:
        """The next version `_versions` will hand out, without consuming it."""
        nxt = next(self._versions)
        self._versions = itertools.count(nxt)
        return nxt

    def _not_found(self, name: str) -> str:
        return f"adapter {name!r} is not registered"  # not every name: there may be thousands

    def _retire(self, info: AdapterInfo, ref: ray.ObjectRef) -> None:
        """Keep a version that left the registry fetchable for RETIRED_TTL_S."""
        self._prune_retired()
        self._retired[(info.name, info.version)] = (ref, time.monotonic())

    def _prune_retired(self) -> None:
        now = time.monotonic()
        self._retired = {
            k: (ref, t) for k, (ref, t) in self._retired.items() if now - t < RETIRED_TTL_S
        }


def _checkpoint_key() -> str:
    from ray import serve

    return f"adapter-registry/{serve.get_replica_context().app_name}"
