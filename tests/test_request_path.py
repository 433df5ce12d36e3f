"""One non-streaming completion on a resident adapter, traced from its HTTP request to its
response: the Ingress app, a LoRAReplica and its engine thread, in one process (the
handle between them runs the replica's generator and delivers its messages and errors
as Serve does). It makes no call to the adapter store, and crosses few of our files.

Traced with sys.setprofile in every thread that serves the request (the app's event loop,
the engine's loop thread, this one), after two warm-up requests (imports, the adapter's
load, the ingress's catalog): a file counts when a function of it is called.
"""

from __future__ import annotations

import asyncio
import sys
import threading
from collections import defaultdict
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from replica.config import EngineConfig
from replica.engine.engine import LLMEngine
from replica.serve.async_engine import AsyncLLMEngine
from replica.serve.deployment import LoRAReplica
from replica.wire import AdapterKey, GenerateRequest
from tests.conftest import tiny_assets
from tests.fakes import FakeStore, as_ray_delivers, registered
from tests.router.client import ingress_client

ROOT = Path(__file__).resolve().parents[1]
OURS = ("cluster", "router", "replica", "kernels")
# What a completion on a resident adapter may cross (issue 39 asked for 30): a budget that
# a new file on the path has to argue for, and that files leaving it lower.
MAX_FILES = 30

_END = object()


class ServeCall:
    """A handle call as Serve makes it: the replica's generator runs to its end in a task
    of its own, whatever the reader does; each item is a message; an exception arrives
    as Ray delivers it; cancel() raises CancelledError in the generator."""

    def __init__(self, messages: AsyncIterator[Any]) -> None:
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        self._task = asyncio.ensure_future(self._run(messages))

    async def _run(self, messages: AsyncIterator[Any]) -> None:
        try:
            async for message in messages:
                self._queue.put_nowait(message)
        except Exception as e:
            self._queue.put_nowait(as_ray_delivers(e).as_instanceof_cause())
        self._queue.put_nowait(_END)

    def __aiter__(self) -> ServeCall:
        return self

    async def __anext__(self) -> Any:
        item = await self._queue.get()
        if item is _END:
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            raise item
        return item

    def cancel(self) -> None:
        self._task.cancel()


class ReplicaHandle:
    """The LoRAReplica deployment's handle, on one replica object in this process."""

    def __init__(self, replica: Any) -> None:
        self.replica = replica
        self.generate = SimpleNamespace(remote=self._generate)

    def options(self, **_: Any) -> ReplicaHandle:
        return self

    def _generate(self, request: GenerateRequest) -> ServeCall:
        return ServeCall(self.replica.generate(request))


class NoStore:
    """The replica's AdapterStore handle: any call fails the test."""

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"the replica called the adapter store: {name}")


@pytest.fixture(scope="module")
def traced() -> dict[str, set[str]]:
    """Per file of ours, the functions one warm completion called."""
    tiny = tiny_assets("llama")
    engine = LLMEngine(EngineConfig(model=str(tiny.model_dir), device="cpu"))
    engine.load_adapter(str(AdapterKey("adapter-00", 1)), tiny.adapters["adapter-00"])
    replica = LoRAReplica.__new__(LoRAReplica)
    replica.engine, replica.aengine = engine, AsyncLLMEngine(engine)
    replica.source, replica.store, replica._fetching = engine.adapters.source, NoStore(), {}
    store = FakeStore({"adapter-00": registered("adapter-00", 1, "/adapters/adapter-00")})
    body = {"model": "adapter-00", "prompt": "hello there", "max_tokens": 4}
    called: set[tuple[str, str]] = set()

    def profile(frame: Any, event: str, _: Any) -> None:
        if event == "call":
            called.add((frame.f_code.co_filename, frame.f_code.co_qualname))

    def on_engine_thread(fn: Any) -> None:
        done = threading.Event()
        replica.aengine._submit(lambda: (fn(), done.set()))
        done.wait(60)

    try:
        with ingress_client(str(tiny.model_dir), store, ReplicaHandle(replica)) as (client, _):
            for _ in range(2):  # the adapter's load, the catalog's listing, lazy imports
                assert client.post("/v1/completions", json=body).status_code == 200
            calls = dict(store.calls)
            on_engine_thread(lambda: sys.setprofile(profile))
            client.portal.call(sys.setprofile, profile)
            sys.setprofile(profile)
            try:
                r = client.post("/v1/completions", json=body)
            finally:
                sys.setprofile(None)
                client.portal.call(sys.setprofile, None)
                on_engine_thread(lambda: sys.setprofile(None))
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 4
            assert dict(store.calls) == calls  # no store RPC from the ingress either
    finally:
        replica.aengine.shutdown()
    files: dict[str, set[str]] = defaultdict(set)
    for filename, function in called:
        path = Path(filename)
        if path.is_relative_to(ROOT) and path.relative_to(ROOT).parts[0] in OURS:
            files[str(path.relative_to(ROOT))].add(function)
    return dict(files)


def _report(files: dict[str, set[str]]) -> None:
    functions = sum(len(f) for f in files.values())
    print(f"\n{len(files)} files, {functions} functions:")
    for name in sorted(files):
        print(f"  {name}: {len(files[name])}")


def test_a_completion_on_a_resident_adapter_stays_within_its_file_budget(traced):
    _report(traced)
    assert any(f.startswith("replica/engine/") for f in traced)  # the engine thread traced
    assert "router/ingress.py" in traced and "replica/serve/deployment.py" in traced
    assert len(traced) <= MAX_FILES, sorted(traced)
