"""The ingress's model catalogue: which models a caller sees (/v1/models), what a request's
`model` names (from this ingress's Catalog of the registry; a name it lacks goes to the
AdapterStore, its resolvers included), and vLLM's load/unload endpoints. A tenant's scope
filters every one of them alike: a name outside it is answered exactly as a name that
does not exist, and is never sent to a resolver."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from typing import Any

from fastapi.responses import Response
from ray.serve.handle import DeploymentHandle

from replica.wire import AdapterInfo, AdapterKey, Listing
from router import protocol as p
from router.errors import BadRequestError, ForbiddenError, GatewayTimeoutError, NotFoundError
from router.http_app import AUTHORIZATION, app, refuse_invalid_unicode
from router.options import IngressOptions
from router.tenancy import Caller, Tenancy, unknown_model
from router.tools.template import ChatTemplate


class AdapterRoutes:
    """Mixed into Ingress (Serve's class-based views take routes from every base class);
    Ingress.__init__ sets what these methods read."""

    store: DeploymentHandle  # the AdapterStore's
    catalog: Catalog
    model_name: str
    model_dir: str
    created: int
    options: IngressOptions
    tenancy: Tenancy
    # the /v1/models bodies rendered from the listing of tag _models_tag, per scope (a
    # tenant's name; None: everything)
    _models_tag: str | None
    _models_bodies: dict[str | None, bytes]
    _template: Callable[[AdapterInfo | None], ChatTemplate]  # Ingress's

    @app.get("/v1/models", response_model=p.ModelList)
    async def models(self, authorization: str | None = AUTHORIZATION) -> Response:
        """The base model and every adapter the caller may use. Each body is rendered once
        per registry change (the store's listing tag) and kept: with thousands of adapters
        a GET costs one small store call, not a list pickled, validated and rendered."""
        caller = self.tenancy.identify(authorization)
        tag, infos = await self.catalog.listing()
        if tag != self._models_tag:
            self._models_tag, self._models_bodies = tag, {}
        body = self._models_bodies.get(caller.name)
        if body is None:
            base = [self._base_card()] if caller.may_use(self.model_name, self.model_name) else []
            cards = [
                self._adapter_card(info)
                for info in infos
                if caller.may_use(info.name, self.model_name)
            ]
            body = p.ModelList(data=[*base, *cards]).model_dump_json().encode()
            self._models_bodies[caller.name] = body
        return Response(body, media_type="application/json")

    @app.get("/v1/models/{model_id:path}")
    async def model(self, model_id: str, authorization: str | None = AUTHORIZATION) -> p.ModelCard:
        """One ModelCard: the base model's or an adapter's (ids may hold slashes)."""
        caller = self.tenancy.identify(authorization)
        info = await self._resolve_info(model_id, caller)
        card = self._base_card() if info is None else self._adapter_card(info)
        return card.model_copy(update=self._template(info).card())

    def _base_card(self) -> p.ModelCard:
        return p.ModelCard(id=self.model_name, created=self.created, root=self.model_dir)

    def _adapter_card(self, info: AdapterInfo) -> p.ModelCard:
        """An AdapterInfo as a ModelCard."""
        return p.ModelCard(
            id=info.name, created=info.created, root=info.path, parent=self.model_name
        )

    # -- adapters (vLLM's endpoints) -----------------------------------------------------------

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(
        self, body: p.LoadLoRAAdapterRequest, authorization: str | None = AUTHORIZATION
    ) -> dict[str, Any]:
        caller = self.tenancy.manager(authorization)
        refuse_invalid_unicode(body)
        if body.lora_name == self.model_name:
            raise BadRequestError(f"{body.lora_name!r} is the base model's name", "lora_name")
        if not caller.may_use(body.lora_name, self.model_name):
            patterns = ", ".join(caller.tenant.adapters) if caller.tenant else ""
            raise ForbiddenError(
                f"tenant {caller.name!r} may load only adapters named like {patterns or '(none)'}",
                "lora_name",
            )
        roots = None if caller.tenant is None else caller.tenant.adapter_roots
        info: AdapterInfo = await self.store.register.remote(
            body.lora_name, body.lora_path, body.load_inplace, roots
        )
        self.catalog.learned(info)
        return {
            "status": "ok",
            "lora_name": info.name,
            "version": info.version,
            "applied": dict(info.applied),  # module -> layers: nothing silently left out
        }

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(
        self, body: p.UnloadLoRAAdapterRequest, authorization: str | None = AUTHORIZATION
    ) -> dict[str, Any]:
        caller = self.tenancy.manager(authorization)
        refuse_invalid_unicode(body)
        if not caller.may_use(body.lora_name, self.model_name):
            raise unknown_model(body.lora_name)
        try:
            info: AdapterInfo = await self.store.unregister.remote(body.lora_name)
        except NotFoundError:
            if caller.tenant is None:
                raise
            raise unknown_model(body.lora_name) from None
        finally:  # from the store's answer on, whatever it was
            self.catalog.forgot(body.lora_name)
        return {"status": "ok", "lora_name": info.name}

    # -- resolution ----------------------------------------------------------------------------

    async def _resolve(
        self, model: str, caller: Caller, deadline: float | None = None
    ) -> AdapterKey | None:
        """The adapter version `model` names; None for the base model."""
        info = await self._resolve_info(model, caller, deadline)
        return None if info is None else AdapterKey(info.name, info.version)

    async def _resolve_info(
        self, model: str, caller: Caller, deadline: float | None = None
    ) -> AdapterInfo | None:
        """The AdapterInfo `model` names; None for the base model."""
        if not caller.may_use(model, self.model_name):
            raise unknown_model(model)
        if model == self.model_name:
            return None
        return await self._adapter_info(model, caller, deadline)

    async def _adapter_info(
        self, model: str, caller: Caller, deadline: float | None = None
    ) -> AdapterInfo:
        """The AdapterInfo of `model`: from the catalog, without a store call, when it
        lists the name; else the store's answer, which may have to find and load it first
        (adapter_resolvers): that wait ends at `deadline` (perf_counter; default: the
        request time limit from now)."""
        info = self.catalog.cached(model)
        if info is not None:
            return info
        if deadline is None:
            deadline = time.perf_counter() + self.options.request_timeout_s
        try:
            return await asyncio.wait_for(
                self.catalog.ask_store(model), max(0.0, deadline - time.perf_counter())
            )
        except NotFoundError as e:
            if caller.tenant is not None:  # the same bytes as a name out of its scope
                raise unknown_model(model) from None
            # the store's reason, not the whole list: with thousands of adapters every 404
            # would carry it
            raise NotFoundError(
                f"model {model!r} does not exist ({e.message}); GET /v1/models lists the "
                "available ones",
                "model",
            ) from None
        except asyncio.TimeoutError:
            raise GatewayTimeoutError(
                f"model {model!r}: finding and loading the adapter took longer than the "
                "request's time limit"
            ) from None


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
