"""LoRAReplica.generate refuses by raising (replica/errors.py), never with a reply: the
deadline it owns (DeadlineExceeded, the request aborted at once), an adapter version the
store no longer has (NotFound, as the store's own NotFoundError arrives wrapped by Ray),
a store it cannot reach (Unavailable), a request the engine cannot serve (RequestError)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from ray.exceptions import RayTaskError

from replica.adapters.object_store import ObjectStoreSource
from replica.errors import DeadlineExceeded, NotFound, RequestError, Unavailable
from replica.wire import AdapterKey, GenerateRequest, SamplingParams
from router.errors import NotFoundError
from tests.replica.serve.replicas import LONG, replica


def run(r: Any, request: GenerateRequest) -> list:
    async def main() -> list:
        return [replies async for replies in r.generate(request)]

    return asyncio.run(asyncio.wait_for(main(), 60))


def test_a_request_past_its_deadline_raises_and_is_aborted_at_once(engine):
    r = replica(engine)

    async def main() -> dict:
        with pytest.raises(DeadlineExceeded, match="time limit"):
            async for _ in r.generate(GenerateRequest([5, 6, 7], LONG, timeout_s=0.2)):
                pass
        return await r.aengine.call(engine.residency)  # after the abort

    try:
        after = asyncio.run(asyncio.wait_for(main(), 60))
    finally:
        r.aengine.shutdown()
    assert after["aborted"] == 1 and after["num_running"] == after["num_waiting"] == 0
    assert after["kv_blocks_free"] == after["kv_blocks_total"]


def test_a_request_the_engine_cannot_serve_raises_request_error(engine):
    r = replica(engine)
    try:
        with pytest.raises(RequestError, match="maximum model length"):
            run(r, GenerateRequest([5] * 10_000, SamplingParams(max_tokens=4)))
    finally:
        r.aengine.shutdown()


class Store:
    """The AdapterStore's handle: get_weights raises `error` as Ray delivers it."""

    def __init__(self, error: Exception) -> None:
        self.get_weights = self  # store.get_weights.remote(key), as on a handle
        self.error = error

    def remote(self, key: AdapterKey) -> Any:
        async def call() -> Any:
            wrapped = RayTaskError("get_weights", "tb", self.error, "store", 1, "127.0.0.1")
            raise wrapped.as_instanceof_cause()

        return call()


@pytest.mark.parametrize(
    "raised, refusal, message",
    [
        (NotFoundError("adapter 'a' version 2 is no longer registered"), NotFound,
         "no longer registered"),
        (RuntimeError("store restarting"), Unavailable, "store restarting"),
    ],
)  # fmt: skip
def test_the_stores_answer_for_a_missing_version_is_the_replicas_refusal(raised, refusal, message):
    r = replica()
    r.source, r._fetching = ObjectStoreSource(), {}
    r.store = Store(raised)
    with pytest.raises(refusal, match=message) as info:
        run(r, GenerateRequest([5, 6], LONG, AdapterKey("a", 2)))
    assert not isinstance(info.value, RayTaskError)  # unwrapped: one layer of Ray at most
