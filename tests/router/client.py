"""The Ingress served in-process: a TestClient on its FastAPI app, its routes bound to an
Ingress object built with the fake handles of tests/fakes.py, and the requests the router
tests send it."""

from __future__ import annotations

import contextlib
import functools
import json
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from fastapi.testclient import TestClient
from ray import cloudpickle, serve

from router import ingress
from router.options import IngressOptions
from tests.fakes import FakeReplicas, FakeStore

BASE = "tiny-base"
KEY = "secret-key-123"  # the admin API key of ingress_client(..., api_key=KEY)
COMPLETION = {"model": BASE, "prompt": "hello there", "max_tokens": 2}
CHAT = {"model": BASE, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@contextlib.contextmanager
def ingress_client(
    model_dir: str,
    store: FakeStore | None = None,
    replicas: FakeReplicas | None = None,
    ledger: Any = None,
    listing_period_s: float = 1.0,
    **options: Any,
) -> Iterator[tuple[TestClient, Any]]:
    """A TestClient on the ingress's app, its routes bound to a fresh Ingress object (as
    Serve binds them to the replica's: its replica context's servable object), and that
    object. `ledger`: a TenantLedger handle to share (default: the Ingress makes its own
    when tenants are configured)."""
    obj = ingress.Ingress(
        replicas or FakeReplicas(),
        store or FakeStore(),
        model_dir,
        BASE,
        IngressOptions(**options),
        ledger,
        listing_period_s=listing_period_s,
    )
    context = SimpleNamespace(servable_object=obj)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(serve, "get_replica_context", lambda: context)
        with TestClient(served_app()) as client:
            yield client, obj


@functools.cache
def served_app() -> Any:
    """The app as a Serve replica gets it: serve.ingress pickles it with cloudpickle, which
    copies the routes' functions with only the module globals their code names (so an
    annotation naming a class that no code uses would not resolve there)."""
    return cloudpickle.loads(cloudpickle.dumps(ingress.app))


def streamed(client: TestClient, path: str, body: dict[str, Any]) -> tuple[str, list[dict]]:
    """(the concatenated text, the chunks) of a streamed request."""
    r = client.post(path, json={**body, "stream": True})
    assert r.status_code == 200, r.text
    events = [line.removeprefix("data: ") for line in r.text.splitlines() if line]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all("error" not in c for c in chunks), chunks
    choices = [c["choices"][0] for c in chunks if c["choices"]]
    if path.endswith("chat/completions"):
        return "".join(c["delta"].get("content") or "" for c in choices), chunks
    return "".join(c["text"] for c in choices), chunks
