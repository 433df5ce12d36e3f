"""The ingress resolves adapter names from its Catalog of the registry: no store call per
request on a name the listing holds, a listing refreshed once per stats period (crossing
only when its tag changed), the store asked on a miss, and this ingress's own unloads
applied at once, even against a listing fetched across them."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest

from replica.wire import Listing
from router import adapter_routes as catalog_module
from router.adapter_routes import Catalog
from router.errors import NotFoundError
from tests.fakes import FakeStore, registered
from tests.router.client import COMPLETION, ingress_client


class Clock:
    """time.monotonic for router.adapter_routes, moved by hand."""

    def __init__(self, monkeypatch) -> None:
        self.now = 1000.0
        monkeypatch.setattr(catalog_module.time, "monotonic", lambda: self.now)


async def settle() -> None:
    """Let background refreshes (each a few awaits on the fake store) finish."""
    for _ in range(10):
        await asyncio.sleep(0)


def test_a_request_on_a_listed_adapter_makes_no_store_call(model_dir):
    store = FakeStore({"ad-1": registered("ad-1", 3, "/adapters/ad-1")})
    body = {**COMPLETION, "model": "ad-1"}
    with ingress_client(model_dir, store, listing_period_s=3600) as (client, _):
        assert client.post("/v1/completions", json=body).status_code == 200
        assert store.calls["resolve"] == 1  # a cold catalog: asked, and a listing started
        for _ in range(5):
            assert client.post("/v1/completions", json=body).status_code == 200
        assert dict(store.calls) == {"resolve": 1, "listing": 1}  # none per request on a hit


def test_the_listing_is_refreshed_once_per_period_and_crosses_only_when_changed(monkeypatch):
    clock = Clock(monkeypatch)
    store = FakeStore({"a": registered("a", 1, "/a")})
    catalog = Catalog(store, refresh_s=1.0)

    async def main():
        assert catalog.cached("a") is None  # cold: starts a refresh
        await settle()
        assert catalog.cached("a") == store.adapters["a"]
        for _ in range(100):  # within the period: no store call at all
            catalog.cached("a")
        await settle()
        assert store.calls["listing"] == 1
        store.adapters["b"] = registered("b", 2, "/b")  # another ingress loads b
        del store.adapters["a"]  # and unloads a
        clock.now += 1.0
        assert catalog.cached("a") is not None  # still the old listing; refresh starts
        await settle()
        assert catalog.cached("a") is None and catalog.cached("b") == store.adapters["b"]
        clock.now += 1.0
        catalog.cached("b")
        await settle()
        assert store.calls["listing"] == 3 and store.listings_sent == 2  # the last: the tag

    asyncio.run(main())


def test_a_miss_asks_the_store_once_and_keeps_its_answer(monkeypatch):
    Clock(monkeypatch)
    store = FakeStore()
    catalog = Catalog(store, refresh_s=1.0)

    async def main():
        catalog.cached("x")
        await settle()  # the listing, empty
        store.adapters["new"] = registered("new", 1, "/new")  # registered since
        assert catalog.cached("new") is None
        assert await catalog.ask_store("new") == store.adapters["new"]
        assert catalog.cached("new") == store.adapters["new"] and store.calls["resolve"] == 1
        with pytest.raises(NotFoundError):
            await catalog.ask_store("ghost")

    asyncio.run(main())


@dataclass
class SlowListing(FakeStore):
    """A store whose listing answers only once `release` is set."""

    release: asyncio.Event | None = None

    async def _listing(self, known: str | None = None) -> Listing:
        await self.release.wait()
        return super()._listing(known)


def test_an_unload_here_wins_over_a_listing_fetched_across_it(monkeypatch):
    Clock(monkeypatch)
    store = SlowListing({"a": registered("a", 1, "/a")})
    catalog = Catalog(store, refresh_s=1.0)

    async def main():
        store.release = asyncio.Event()
        catalog.learned(store.adapters["a"])  # loaded through this ingress
        assert catalog.cached("a") is not None  # and a refresh starts, answering later
        await settle()
        catalog.forgot("a")  # unloaded through this ingress meanwhile...
        store.release.set()  # ...the listing, taken before the unload, lists it still
        await settle()
        assert catalog.cached("a") is None

    asyncio.run(main())


def test_an_unload_through_this_ingress_is_a_404_at_once(model_dir):
    store = FakeStore({"ad-1": registered("ad-1", 3, "/adapters/ad-1")})
    store._unregister = lambda name: store.adapters.pop(name)
    body = {**COMPLETION, "model": "ad-1"}
    with ingress_client(model_dir, store, listing_period_s=3600) as (client, _):
        assert client.post("/v1/completions", json=body).status_code == 200
        r = client.post("/v1/unload_lora_adapter", json={"lora_name": "ad-1"})
        assert r.status_code == 200
        assert client.post("/v1/completions", json=body).status_code == 404
