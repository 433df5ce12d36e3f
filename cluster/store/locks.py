"""One asyncio lock per adapter name, for as long as someone holds or waits for it."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field


@dataclass
class _Lock:
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    users: int = 0  # holders and waiters


class NameLocks:
    """Serializes the changes of one name while other names go on; a name's lock goes when
    nobody holds or waits for it, so thousands of names leave nothing behind."""

    def __init__(self) -> None:
        self._locks: dict[str, _Lock] = {}

    @contextlib.asynccontextmanager
    async def hold(self, name: str) -> AsyncIterator[None]:
        entry = self._locks.setdefault(name, _Lock())
        entry.users += 1
        try:
            async with entry.lock:
                yield
        finally:
            entry.users -= 1
            if not entry.users:
                del self._locks[name]
