"""The events a worker records after it settled a delivery, written in batches.

``ack_sent``, ``rejected`` and ``settle_lost`` say what the broker was told once the outcome
had committed. They decide nothing and nobody waits for them, so they need not cost each
job a transaction of its own: they are gathered for a few milliseconds and written in one
statement, or, when the worker claims its next deliveries within those milliseconds (a busy
worker does), in the claim's own statement (``take``): no commit of their own at all. A
process killed inside that window loses those lines of the timeline, exactly as a kill
between the settle and a write of its own would; the outcome they follow is committed
either way. A database outage keeps them (up to ``limit``) and retries.

The writer also gives the operator the worker's progress at INFO: one line per second of
settles (``"event": "settled"``, how many acked, rejected and lost, the first and last job),
instead of a line per job. The lines of each job (``claimed``, ``result_saved``,
``ack_sent``) are DEBUG (``JOBRELAY_LOG_LEVEL=DEBUG``); its timeline has them all anyway.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
from collections import Counter
from datetime import datetime
from typing import Any

from jobrelay.errors import StoreDataError, StoreError
from jobrelay.observe import tracing
from jobrelay.storage.port import StorePort
from jobrelay.storage.store import PendingEvent

log = logging.getLogger(__name__)
# The summary is the worker's line, with its lines per job: one logger to follow.
progress_log = logging.getLogger("jobrelay.worker")

_MAX_BACKOFF_SECONDS = 5.0
# Settles counted in one INFO line: a second's worth.
SUMMARY_SECONDS = 1.0
# What the summary calls each kind of settle.
_SUMMARY_FIELDS = {"ack_sent": "acked", "rejected": "rejected", "settle_lost": "settleLost"}


class TimelineWriter:
    def __init__(self, store: StorePort, *, window: float = 0.005, limit: int = 10_000) -> None:
        self._store = store
        self._window = window
        self._limit = limit
        self._pending: list[PendingEvent] = []
        # Events a statement that took them could not write: written by a statement of their
        # own (a bad one must not fail claims again and again), not taken again.
        self._returned = False
        self._writing: asyncio.Task[None] | None = None
        self._batching = False
        self._tally: Counter[str] = Counter()
        self._first_job: str | None = None
        self._last_job: str | None = None
        self._summary_due: asyncio.TimerHandle | None = None

    @property
    def idle(self) -> bool:
        """Nothing waits to be written (a test's drain reads the timeline after it)."""
        return not self._pending and (self._writing is None or self._writing.done())

    def start_batching(self) -> None:
        """From now on (a worker's consume loop) events are batched; ``close`` ends it.

        Before (one delivery handled on its own) each event is written at once.
        """
        self._batching = True

    async def record(self, job_id: str, kind: str, at: datetime, **detail: Any) -> None:
        self._count(job_id, kind)
        tracing.event(kind, at, detail)  # on the job's run span, which is current here
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
        self._start_writer()

    def take(self) -> list[PendingEvent]:
        """The events pending, for a statement about to be sent that writes them (a claim);
        ``give_back`` them if it fails. None while events given back wait for their own."""
        if self._returned or not self._pending:
            return []
        taken, self._pending = self._pending, []
        return taken

    def give_back(self, events: list[PendingEvent]) -> None:
        """``take``'s events, whose statement failed: before what was added since, and
        written by the writer's own statement. (A statement whose answer was lost after its
        commit wrote them already: they are written twice, as a write of their own retried
        after a lost answer would be.)"""
        if not events:
            return
        self._pending[:0] = events
        self._returned = True
        self._start_writer()

    def _start_writer(self) -> None:
        if self._writing is None or self._writing.done():
            # In a context of its own: the writer is no one job's (its lines, its spans).
            self._writing = asyncio.get_running_loop().create_task(
                self._write_soon(), context=contextvars.Context()
            )

    def _count(self, job_id: str, kind: str) -> None:
        """Count a settle for the next summary line; the first one starts its second."""
        self._tally[kind] += 1
        if self._first_job is None:
            self._first_job = job_id
        self._last_job = job_id
        if self._summary_due is None:
            loop = asyncio.get_running_loop()
            self._summary_due = loop.call_later(SUMMARY_SECONDS, self.log_summary)

    def log_summary(self) -> None:
        """One INFO line for the settles counted since the last one (none: no line)."""
        if self._summary_due is not None:
            self._summary_due.cancel()
            self._summary_due = None
        tally, self._tally = self._tally, Counter()
        if not tally:
            return
        counts = {field: tally[kind] for kind, field in _SUMMARY_FIELDS.items()}
        progress_log.info(
            "settled %d deliveries: %d acked, %d rejected, %d lost",
            tally.total(),
            *counts.values(),
            extra={
                "event": "settled",
                "count": tally.total(),
                **counts,
                "firstJobId": self._first_job,
                "lastJobId": self._last_job,
            },
        )
        self._first_job = self._last_job = None

    async def _write_soon(self) -> None:
        wait = self._window
        while self._pending:
            await asyncio.sleep(wait)  # the batching window: let other settles join
            batch, self._pending = self._pending, []
            if not batch:
                return  # a claim took them meanwhile
            # Given-back events are at the head of what is pending: this batch holds them
            # exactly when they were given back before it was taken.
            holds_returned = self._returned
            try:
                await self._write(batch)
                if holds_returned:
                    self._returned = False
                wait = self._window
            except _Unwritten as unwritten:
                exc, batch = unwritten.cause, unwritten.left
                self._pending[:0] = batch[-self._limit :]
                wait = min(max(wait * 2, 0.25), _MAX_BACKOFF_SECONDS)
                log.warning(
                    "timeline events not written, retrying: %s",
                    exc,
                    extra={"event": "events_held", "count": len(batch)},
                )

    async def _write(self, batch: list[PendingEvent]) -> None:
        """One statement; if the database refuses its data, each event alone, and one it
        refuses alone is dropped with a warning (its job deleted meanwhile, or a value no
        database can hold): retried, it would hold every later event back for good. Raises
        ``_Unwritten`` with the events not written when the database cannot be reached."""
        try:
            await self._store.record_events(batch)
            return
        except StoreDataError:
            if len(batch) == 1:
                self._refused(batch[0])
                return
        except StoreError as exc:
            raise _Unwritten(exc, batch) from exc
        for n, event in enumerate(batch):
            try:
                await self._store.record_events([event])
            except StoreDataError:
                self._refused(event)
            except StoreError as exc:
                raise _Unwritten(exc, batch[n:]) from exc

    @staticmethod
    def _refused(event: PendingEvent) -> None:
        log.warning(
            "timeline event refused by the database, not recorded",
            extra={"event": "event_dropped", "jobId": event.job_id, "kind": event.kind},
        )

    async def close(self, timeout: float = 5.0) -> None:
        """Log the last summary and write what is pending; after ``timeout`` (the database
        is down) give up on it."""
        self._batching = False
        self.log_summary()
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


class _Unwritten(Exception):
    """The database could not be reached: ``left`` are the events still to write."""

    def __init__(self, cause: StoreError, left: list[PendingEvent]) -> None:
        super().__init__(str(cause))
        self.cause = cause
        self.left = left
