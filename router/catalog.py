"""The adapters this ingress resolves names to: the store's registry as last listed.

Resolving a request's `model` is a dict lookup here, not a call to the AdapterStore. The
listing is refreshed in the background at most once per stats period (while requests
come), and crosses from the store only when its tag changed. A name the listing lacks
(registered since, or one the store's resolvers may find) is asked of the store, and its
answer kept. This ingress's own loads and unloads apply at once; another ingress's reach
it within a period, meanwhile its requests run on the version it resolved (replicas can
still fetch a removed version for a while: cluster/store/registry.py, RETIRED_TTL_S).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time

from ray.serve.handle import DeploymentHandle

from replica.wire import AdapterInfo, Listing

log = logging.getLogger(__name__)


class Catalog:
    def __init__(self, store: DeploymentHandle, refresh_s: float) -> None:
        """`store`: the AdapterStore's handle; `refresh_s`: the stats period."""
        self.store, self.refresh_s = store, refresh_s
        self._tag: str | None = None  # of the last listing taken
        self._listed: tuple[AdapterInfo, ...] = ()
        self._names: dict[str, AdapterInfo] = {}  # the listing, and what was learned since
        self._edits = 0  # local changes: a listing fetched across one may predate it
        self._refreshed = -math.inf  # time.monotonic() of the last refresh started
        self._refreshing: asyncio.Future[Listing] | None = None

    async def listing(self) -> tuple[str, tuple[AdapterInfo, ...]]:
        """(tag, every adapter) as the store has them now: one call, the list crossing
        only when its tag changed (GET /v1/models)."""
        fresh = await self._refresh()
        if fresh.adapters is None:
            return fresh.tag, self._listed
        return fresh.tag, fresh.adapters

    def cached(self, name: str) -> AdapterInfo | None:
        """`name`'s version as last listed or learned, without a store call; the listing
        is refreshed in the background once it is a period old."""
        if self._refreshing is None and time.monotonic() - self._refreshed >= self.refresh_s:
            self._refreshing = asyncio.ensure_future(self._refresh())
            self._refreshing.add_done_callback(self._refreshed_in_background)
        return self._names.get(name)

    async def ask_store(self, name: str) -> AdapterInfo:
        """The store's answer for a name the listing lacks (its resolvers may register it
        first), kept unless a local change crossed it; the store's NotFoundError else."""
        edits = self._edits
        info: AdapterInfo = await self.store.resolve.remote(name)
        if edits == self._edits:  # an unload here meanwhile may have removed this version
            self.learned(info)
        return info

    def learned(self, info: AdapterInfo) -> None:
        """A registration this ingress made or was told of: resolved from now on."""
        self._names[info.name] = info
        self._edits += 1

    def forgot(self, name: str) -> None:
        """An unload this ingress made: `name` is asked of the store from now on."""
        self._names.pop(name, None)
        self._edits += 1

    async def _refresh(self) -> Listing:
        edits = self._edits
        self._refreshed = time.monotonic()
        listing: Listing = await self.store.listing.remote(self._tag)
        if listing.adapters is not None and edits == self._edits:
            self._tag, self._listed = listing.tag, listing.adapters
            self._names = {info.name: info for info in listing.adapters}
        return listing  # across a local edit: kept, but not taken as the names (_tag stays)

    def _refreshed_in_background(self, task: asyncio.Future[Listing]) -> None:
        self._refreshing = None
        if not task.cancelled() and task.exception() is not None:  # the store restarting
            log.warning("adapter listing not refreshed: %r", task.exception())
