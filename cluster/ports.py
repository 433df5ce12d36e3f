"""One server per port, and whether a Ray address is this machine's. Serve's HTTP proxies
bind with SO_REUSEPORT, so a second server on a served port would share it silently, not
fail: a command claims its port first, refused while something there accepts connections
or another lorafleet command holds the port's lock file ($TMPDIR/lorafleet-UID/port-N.lock,
held until it releases the port or exits)."""

from __future__ import annotations

import os
import re
import socket
import tempfile
from pathlib import Path
from typing import Any

import ray

from cluster.errors import ServeConfigError


def is_local_address(address: str | None) -> bool:
    """Whether the Ray cluster at `address` runs on this machine (so that its processes read
    this machine's files): None and 'local' (a Ray started here), 'auto' (unless
    RAY_ADDRESS names another machine), or an address of this machine."""
    if address in (None, "local"):
        return True
    if address == "auto":
        address = os.environ.get("RAY_ADDRESS") or "127.0.0.1"
        if address in ("auto", "local"):
            return True
    host = re.sub(r"^[a-z]+://", "", address).rsplit(":", 1)[0].strip("[]")
    try:
        ips = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except (OSError, UnicodeError):
        return False
    return any(ip.startswith("127.") or ip in _own_ips() for ip in ips)


def _own_ips() -> set[str]:
    ips = {"::1"}
    try:
        ips |= set(socket.gethostbyname_ex(socket.gethostname())[2])
    except OSError:
        pass
    try:  # the address of the default route (a UDP connect sends nothing)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("8.8.8.8", 80))
            ips.add(s.getsockname()[0])
    except OSError:
        pass
    return ips


_claimed: dict[int, Any] = {}  # port -> the lock file this process holds for it


def claim_port(host: str, port: int) -> bool:
    """Refuse (ServeConfigError) to start a server on `host:port` when something there
    already accepts connections, or another lorafleet command of this machine is starting
    a server on that port; otherwise hold the port's lock until release_port or this
    process's exit, so that no lorafleet command started meanwhile binds it too (Serve's
    proxies bind with SO_REUSEPORT: a second one would share the port silently). False
    when this process holds it already."""
    if port in _claimed:
        return False
    lock = _lock_path(port)
    handle = open(lock, "a+")  # held open: the lock lives as long as the file is
    try:
        import fcntl

        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "?"
        handle.close()
        raise ServeConfigError(
            f"port {port} is taken: another lorafleet command on this machine ({holder}) "
            "is serving on it; stop that one, or choose another port (--port)"
        ) from None
    except ImportError:  # no fcntl (Windows): the connection probe below only
        pass
    if _accepts_connections(host, port):
        handle.close()
        raise ServeConfigError(
            f"http://{_client_host(host)}:{port} already accepts connections: another "
            "server listens on that port; stop it, or choose another port (--port)"
        )
    handle.seek(0)
    handle.truncate()
    handle.write(f"pid {os.getpid()}")
    handle.flush()
    _claimed[port] = handle
    return True


def release_port(port: int) -> None:
    handle = _claimed.pop(port, None)
    if handle is not None:
        handle.close()


def _lock_path(port: int) -> Path:
    folder = Path(tempfile.gettempdir()) / f"lorafleet-{os.getuid()}"
    folder.mkdir(mode=0o700, exist_ok=True)
    return folder / f"port-{port}.lock"


def _client_host(host: str) -> str:
    return {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)


def _accepts_connections(host: str, port: int) -> bool:
    try:
        with socket.create_connection((_client_host(host), port), timeout=1.0):
            return True
    except OSError:
        return False


def proxy_here(location: str) -> bool:
    """Whether Serve's HTTP proxy would bind on this machine: the head node's (or, with
    EveryNode, any node's) address is one of this machine's."""
    if not ray.is_initialized():
        return True
    if "Disabled" in location:
        return False
    here = ray.util.get_node_ip_address()
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    if "EveryNode" not in location:
        nodes = [n for n in nodes if "node:__internal_head__" in n.get("Resources", {})] or nodes
    return any(n.get("NodeManagerAddress") == here for n in nodes)
