"""A resource the roles of one process share: opened by its first holder, closed by its last.

``jobrelay up`` runs a worker and a relay in one process; each holds the store's hot connections
while it runs (``drivers.pg_pool.HotPool``: asyncpg connections; ``drivers.sqlite_conn.SqliteHot``:
one ``sqlite3`` connection and its thread). Whoever comes first opens them, and they close when the
last holder lets go, not while another still runs.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class Shared(Generic[T]):
    def __init__(
        self, open_: Callable[[], Awaitable[T | None]], close: Callable[[T], Awaitable[None]]
    ) -> None:
        # ``open_`` may give None: nothing to hold (an in-memory SQLite database).
        self._open = open_
        self._close = close
        self.value: T | None = None
        self._holders = 0
        self._lock = asyncio.Lock()

    @contextlib.asynccontextmanager
    async def held(self) -> AsyncIterator[None]:
        """Open the resource (now, not in the first burst of work) for the block."""
        async with self._lock:
            if self.value is None:
                self.value = await self._open()
            self._holders += 1
        try:
            yield
        finally:
            async with self._lock:
                self._holders -= 1
                value = self.value if self._holders == 0 else None
                if value is not None:
                    self.value = None
            if value is not None:
                await self._close(value)


__all__ = ["Shared"]
