"""Network helpers the tests share: a free local port, a FastAPI app served on a thread, and
the check of an OpenAI error body."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import uvicorn
from fastapi import FastAPI


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that nothing listens on now.

    Each test that serves HTTP takes its own port, so that tests in parallel workers (and a
    server someone runs on 8000) never meet on one.
    """
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def serving(app: FastAPI) -> Iterator[str]:
    """Yield the base URL of `app`, served by uvicorn on a thread on a free port until the
    block ends."""
    port = free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                            timeout_graceful_shutdown=1)  # fmt: skip
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    for _ in range(500):  # bounded: 5 s
        if server.started:
            break
        time.sleep(0.01)
    assert server.started, "the fake server did not start"
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=5)


def assert_openai_error(r: Any, status: int | None = None, param: str | None = None) -> dict:
    """Return the "error" object of `r`, after checking the body is OpenAI's error and nothing
    else: {"error": {"message", "type", "param", "code"}}, `code` the response's status.

    `r`: an httpx or TestClient response. `status`, `param`: the values expected, when given.
    """
    if status is not None:
        assert r.status_code == status, r.text
    assert r.headers.get("content-type") == "application/json", (r.status_code, r.text)
    body = r.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["code"] == r.status_code and error["message"] and error["type"], error
    if param is not None:
        assert error["param"] == param, error
    return error
