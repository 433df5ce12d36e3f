"""Fakes the tests share: the AdapterStore's and the LoRAReplicas' Serve handles, as the
Ingress calls them (`.remote()` awaited, a reply stream iterated); CUDA graphs that replay
a step on the CPU; a Hugging Face hub cache laid out by hand. (The recording torch.cuda is
tests/replica/fake_cuda.py.)"""

from __future__ import annotations

import hashlib
import inspect
import os
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from ray.exceptions import RayTaskError

from cluster.resolvers import ADAPTER_FILES
from replica.executor.static_decode import CudaGraphs
from replica.wire import AdapterInfo, GenerateRequest, Listing, Reply
from router.errors import NotFoundError


def registered(name: str, version: int, path: str, created: int = 1700000000) -> AdapterInfo:
    """An AdapterInfo as the store answers it (a rank-8 q/v adapter)."""
    return AdapterInfo(name, version, {"qkv_proj": 8}, path, ("q_proj", "v_proj"), 0, created)


class _Call:
    """What a handle's .remote() returns: awaitable once, and harmless if never awaited."""

    def __init__(self, fn: Callable[..., Any], args: tuple) -> None:
        self.fn, self.args = fn, args

    def __await__(self):
        async def run() -> Any:
            result = self.fn(*self.args)
            return await result if inspect.isawaitable(result) else result

        return run().__await__()


class _Method:
    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn

    def remote(self, *args: Any) -> _Call:
        return _Call(self.fn, args)


@dataclass
class FakeStore:
    """The AdapterStore's handle; counts the calls of each method (`calls`)."""

    adapters: dict[str, AdapterInfo] = field(default_factory=dict)
    reports: dict[str, dict] = field(default_factory=lambda: {"r1": {"age_s": 0.2}})
    fail: Exception | None = None  # raised by every call
    listings_sent: int = 0
    calls: Counter[str] = field(default_factory=Counter)

    def __getattr__(self, name: str) -> _Method:
        method = getattr(self, f"_{name}")

        def counted(*args: Any) -> Any:
            self.calls[name] += 1
            return method(*args)

        return _Method(counted)

    def _check(self) -> None:
        if self.fail is not None:
            raise self.fail

    def _listing(self, known: str | None = None) -> Listing:
        """AdapterStore.listing: the list only when the registry changed since `known`."""
        self._check()
        tag = repr(sorted((a.name, a.version) for a in self.adapters.values()))
        if known == tag:
            return Listing(tag, None)
        self.listings_sent += 1
        return Listing(tag, tuple(sorted(self.adapters.values(), key=lambda a: a.name)))

    def _resolve(self, name: str) -> AdapterInfo:
        self._check()
        if name not in self.adapters:
            raise NotFoundError(f"adapter {name!r} is not registered")
        return self.adapters[name]

    def _replica_stats(self) -> dict[str, dict]:
        self._check()
        return self.reports

    def _stats(self) -> dict[str, Any]:
        return {}


def as_ray_delivers(error: Exception) -> Exception:
    """An exception raised in a replica's generator as the caller receives it: a
    RayTaskError that is also an instance of the class raised (its `cause`)."""
    return RayTaskError("generate", f"Traceback: {error!r}", error, "replica", 1, "127.0.0.1")


class _Stream:
    """A replica's reply stream (DeploymentResponseGenerator's async iteration): each
    Reply of the script a message of its own, an exception raised as Ray delivers it."""

    def __init__(self, replies: list[Reply | Exception]) -> None:
        self.replies = iter(replies)
        self.cancelled = False

    def __aiter__(self) -> _Stream:
        return self

    async def __anext__(self) -> list[Reply]:
        try:
            item = next(self.replies)
        except StopIteration:
            raise StopAsyncIteration from None
        if isinstance(item, Exception):
            raise as_ray_delivers(item).as_instanceof_cause()
        return [item]

    def cancel(self) -> None:
        self.cancelled = True


@dataclass
class FakeReplicas:
    """Answers every generation with `script(request)`'s replies; keeps the requests."""

    script: Callable[[GenerateRequest], list[Reply | Exception]] = lambda r: [
        Reply((5, 6), "length", num_prompt_tokens=len(r.prompt_ids))
    ]
    requests: list[GenerateRequest] = field(default_factory=list)
    streams: list[_Stream] = field(default_factory=list)

    def options(self, **_: Any) -> FakeReplicas:
        return self

    @property
    def generate(self) -> _Method:
        def start(request: GenerateRequest) -> _Stream:
            self.requests.append(request)
            self.streams.append(_Stream(self.script(request)))
            return self.streams[-1]

        return SimpleNamespace(remote=start)  # type: ignore[return-value]


class FakeGraph:
    def __init__(self, step: Callable[[], None], log: list) -> None:
        self.step, self.log = step, log

    def replay(self) -> None:
        self.log.append("replay")
        self.step()


class FakeGraphs(CudaGraphs):
    """Capture runs the step once (as a capture issues its work; not with run=False) and
    keeps it; `fail` is raised instead from the capture numbered `fail_at`."""

    def __init__(
        self, fail: BaseException | None = None, fail_at: int = 0, run: bool = True
    ) -> None:
        super().__init__(torch.device("cpu"))
        self.fail, self.fail_at, self.run = fail, fail_at, run
        self.captures: list[tuple[int, ...]] = []
        self.log: list[Any] = []

    def pool(self) -> str:
        return "pool"

    def capture(self, step: Callable[[], None], pool: Any) -> FakeGraph:
        assert pool == "pool"
        if self.fail is not None and len(self.captures) == self.fail_at:
            raise self.fail
        self.captures.append(())
        if self.run:
            step()
        return FakeGraph(step, self.log)

    def synchronize(self) -> None:
        pass

    def free_bytes(self) -> int:
        return 123_456_789

    def allocated_bytes(self) -> int:
        return 0


COMMIT = "0123456789abcdef0123456789abcdef01234567"


def fake_hf_cache(cache: Path, repo_id: str, adapter: Path, commit: str = COMMIT) -> Path:
    """Lay `adapter`'s files out as huggingface_hub's cache does: blobs named by content
    hash, a snapshot of symlinks into them, refs/main naming the commit. The snapshot."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True)
    for name in ADAPTER_FILES:  # the files this adapter has (one weights file)
        if not (adapter / name).is_file():
            continue
        data = (adapter / name).read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / name).symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    return snapshot
