"""LISTEN for outbox NOTIFYs on PostgreSQL, so relays wake as soon as a row commits.

NOTIFY is only a hint: it is delivered after commit and lost while the listener is
disconnected, so the relay polls as well. A listener that cannot connect logs once and
retries in the background; the relay keeps working on polling alone meanwhile. On SQLite
this is a no-op (writers in the same process wake the relay through ``Store``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from types import TracebackType
from typing import Any

import asyncpg
from sqlalchemy.ext.asyncio import AsyncEngine

from jobrelay.storage.capabilities import capabilities_of, session_dsn
from jobrelay.storage.store import NOTIFY_CHANNEL

log = logging.getLogger("jobrelay.notify")
_RECONNECT_SECONDS = 5.0


class OutboxListener:
    def __init__(self, engine: AsyncEngine, wake: asyncio.Event) -> None:
        self.wake = wake
        self.enabled = capabilities_of(engine).listens
        self.dsn = session_dsn(engine)
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> OutboxListener:
        if self.enabled:
            self._task = asyncio.create_task(self._listen())
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def _on_notify(self, *_: Any) -> None:
        self.wake.set()

    async def _listen(self) -> None:
        while True:
            conn = None
            try:
                conn = await asyncpg.connect(self.dsn)
                await conn.add_listener(NOTIFY_CHANNEL, self._on_notify)
                closed = asyncio.Event()
                conn.add_termination_listener(_setter(closed))
                self.wake.set()  # anything committed while we were not listening
                await closed.wait()
                log.warning("outbox listener disconnected", extra={"event": "listen_lost"})
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning(
                    "outbox LISTEN unavailable, polling only: %s",
                    exc,
                    extra={"event": "listen_failed"},
                )
            finally:
                if conn is not None and not conn.is_closed():
                    with contextlib.suppress(Exception):
                        await asyncio.shield(conn.close())
            await asyncio.sleep(_RECONNECT_SECONDS)


def _setter(event: asyncio.Event) -> Any:
    return lambda *_: event.set()
