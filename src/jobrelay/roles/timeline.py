"""The events a worker records after it settled a delivery, written in batches.

``ack_sent``, ``rejected`` and ``settle_lost`` say what the broker was told once the outcome
had committed. They decide nothing and nobody waits for them, so they need not cost each
job a transaction of its own: they are gathered for a few milliseconds and written in one
statement. A process killed inside that window loses those lines of the timeline, exactly
as a kill between the settle and a write of its own would; the outcome they follow is
committed either way. A database outage keeps them (up to ``limit``) and retries.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from datetime import datetime
from typing import Any

from jobrelay.errors import StoreError
from jobrelay.storage.store import PendingEvent, Store

log = logging.getLogger(__name__)

_MAX_BACKOFF_SECONDS = 5.0


class TimelineWriter:
    def __init__(self, store: Store, *, window: float = 0.005, limit: int = 10_000) -> None:
        self._store = store
        self._window = window
        self._limit = limit
        self._pending: list[PendingEvent] = []
        self._writing: asyncio.Task[None] | None = None
        self._batching = False

    def start_batching(self) -> None:
        """From now on (a worker's consume loop) events are batched; ``close`` ends it.

        Before (one delivery handled on its own) each event is written at once.
        """
        self._batching = True

    async def record(self, job_id: str, kind: str, at: datetime, **detail: Any) -> None:
        if self._batching:
            self.add(job_id, kind, at, **detail)
            return
        with contextlib.suppress(StoreError):
            await self._store.record_events([PendingEvent(job_id, kind, at, detail)])

    def add(self, job_id: str, kind: str, at: datetime, **detail: Any) -> None:
        if len(self._pending) >= self._limit:
            dropped = self._pending.pop(0)
            log.warning(
                "timeline buffer full, an event was not recorded",
                extra={"event": "event_dropped", "jobId": dropped.job_id, "kind": dropped.kind},
            )
        self._pending.append(PendingEvent(job_id, kind, at, detail))
        if self._writing is None or self._writing.done():
            self._writing = asyncio.get_running_loop().create_task(self._write_soon())

    async def _write_soon(self) -> None:
        wait = self._window
        while self._pending:
            await asyncio.sleep(wait)  # the batching window: let other settles join
            batch, self._pending = self._pending, []
            try:
                await self._store.record_events(batch)
                wait = self._window
            except StoreError as exc:
                self._pending[:0] = batch[-self._limit :]
                wait = min(max(wait * 2, 0.25), _MAX_BACKOFF_SECONDS)
                log.warning(
                    "timeline events not written, retrying: %s",
                    exc,
                    extra={"event": "events_held", "count": len(batch)},
                )

    async def close(self, timeout: float = 5.0) -> None:
        """Write what is pending; after ``timeout`` (the database is down) give up on it."""
        self._batching = False
        if self._writing is None:
            return
        try:
            async with asyncio.timeout(timeout):
                await asyncio.shield(self._writing)
        except TimeoutError:
            log.warning(
                "timeline events not written before shutdown",
                extra={"event": "events_dropped", "count": len(self._pending)},
            )
            self._writing.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._writing
