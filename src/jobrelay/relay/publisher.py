"""The relay: move outbox rows to the broker, and mark them published only once confirmed.

A batch is claimed in one short statement (the claim is a column with an expiry, so no
transaction stays open while we wait for the broker), published concurrently, its confirms
awaited together, and the confirmed rows marked in a second statement. The relay does not
wait for a batch's confirms before it claims the next: up to ``JOBRELAY_RELAY_WINDOW`` rows
may be published and unconfirmed at once (a sliding window, ``_Window``), so the broker's
confirm latency is paid once per window, not once per batch. The ``published`` event is
stamped with the claim's instant (by the store's clock), not the confirm's: RabbitMQ may
hand the message to a worker, which claims the job, before the confirm reaches us, and the
timeline must not show that claim before the publish.

A relay killed between the confirm and the mark leaves rows that another relay republishes
when the claim expires: that is the at-least-once half of the guarantee, and the worker's
duplicate handling is the other half. A nack, a ``basic.return`` (unroutable) or a confirm
timeout leaves the row waiting with the error recorded and a back-off before the next try.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
import uuid
from collections.abc import Coroutine
from datetime import timedelta
from typing import Any

from jobrelay.domain.messages import OUTBOX_ID_HEADER
from jobrelay.errors import PublishError, StoreError, TransportError
from jobrelay.observe import tracing
from jobrelay.observe.scrub import scrub
from jobrelay.runtime.heartbeat import heartbeat
from jobrelay.runtime.wiring import Runtime
from jobrelay.storage.notify import OutboxListener
from jobrelay.storage.store import OutboxRow
from jobrelay.transport.base import OutgoingMessage

log = logging.getLogger("jobrelay.relay")

_MAX_BACKOFF_SECONDS = 30.0
# An admission round admits and claims up to this many claims' worth of jobs (4 x
# ``JOBRELAY_RELAY_BATCH`` by default, within the window's room): a round per claim paid the
# round's fixed cost (its ranking of every waiting row, its lock, its commit) once per 200
# jobs, and the non-binding bench cell ran at 0.64 of no limits (median of three sittings of
# 10,000 jobs).
ADMIT_AHEAD = 4


def new_relay_id() -> str:
    return f"relay:{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"


class Relay:
    def __init__(self, rt: Runtime, *, relay_id: str | None = None) -> None:
        self.rt = rt
        self.relay_id = relay_id or new_relay_id()
        self.claim_for = timedelta(seconds=rt.settings.relay_claim_seconds)
        self.published = 0
        self.failed = 0
        # The confirmed rows' timer, looked up once: ``labels()`` per row was a lock and a
        # dict lookup each time.
        self._confirmed_seconds = rt.metrics.publish_seconds.labels(outcome="confirmed")

    def message_for(self, row: OutboxRow) -> OutgoingMessage:
        headers = {str(k): str(v) for k, v in row.headers.items()}
        headers["x-jobrelay-job-id"] = row.job_id
        headers[OUTBOX_ID_HEADER] = str(row.id)
        return OutgoingMessage(
            destination=row.destination,
            body=row.body,
            headers=headers,
            message_id=f"{row.job_id}:{row.id}",
        )

    async def relay_once(self) -> int:
        """One round: claim, publish, confirm, mark. Returns how many rows were claimed."""
        rows = await self._claim(self.rt.settings.relay_batch)
        if rows:
            await self._settle(rows)
        return len(rows)

    async def _claim(self, limit: int, room: int | None = None) -> list[OutboxRow]:
        """Admit what waits for its limits (``storage.admission``), then claim what else
        waits. Whatever app this relay runs: a job enqueued with limits by another version
        of the app is admitted too. The admission's write transaction runs only when a row
        waits for it (one read of an index that is empty when none does); it claims the rows
        it admits for this relay, up to ``ADMIT_AHEAD`` claims' worth within ``room`` (the
        window's), which are published with the claim's rows."""
        store = self.rt.store
        room = (ADMIT_AHEAD + 1) * limit if room is None else room
        # A claim's worth of the room is left to the claim (jobs under no limits are not
        # starved by a backlog under limits), unless the room is no more than that.
        budget = min(ADMIT_AHEAD * limit, room - limit) if room > limit else room
        admitted: tuple[OutboxRow, ...] = ()
        if await store.awaits_admission():
            answer = await store.admit_waiting(
                budget,
                self.rt.settings.fair_ahead,
                claim_for=(self.relay_id, self.claim_for),
                priority_ahead=self.rt.settings.priority_ahead,
            )
            admitted = answer.rows
            self.rt.metrics.admission(answer.throttled, answer.waits)
        left = min(limit, room - len(admitted))
        if left <= 0:
            return list(admitted)
        try:
            rows = await store.claim_outbox(self.relay_id, left, self.claim_for)
        except Exception as exc:
            if not admitted:
                raise
            # The admitted rows are claimed for this relay already: publish them now rather
            # than leave them (and their slots) waiting for the claim to expire.
            log.warning(
                "relay claim failed after an admission: %s",
                exc,
                extra={"event": "relay_round_failed"},
            )
            return list(admitted)
        return [*admitted, *rows]

    async def _settle(self, rows: list[OutboxRow]) -> None:
        """Publish a claimed batch, await its confirms, mark the confirmed rows in one
        statement and release the others with their error."""
        store = self.rt.store
        outcomes = await asyncio.gather(*(self._publish(row) for row in rows))
        confirmed = [row for row, error in zip(rows, outcomes, strict=True) if error is None]
        await self.rt.faults.ahit("relay.before_mark")
        if confirmed:
            await store.mark_published(self.relay_id, confirmed)
            self.published += len(confirmed)
        failed = 0
        for row, error in zip(rows, outcomes, strict=True):
            if error is not None:
                failed += 1
                await store.release_outbox(row, error, self._backoff(row))
        self.failed += failed
        log.info(
            "published batch",
            extra={
                "event": "published_batch",
                "relay": self.relay_id,
                "confirmed": len(confirmed),
                "failed": failed,
                "firstOutboxId": rows[0].id,
                "lastOutboxId": rows[-1].id,
            },
        )

    async def _settle_in_window(self, rows: list[OutboxRow]) -> None:
        """``_settle`` as a task of the window: a failure is logged, never raised. The rows
        of a batch whose mark failed stay claimed and unpublished, and are published again
        when their claim expires (the worker acks the second copy as a duplicate)."""
        try:
            await self._settle(rows)
        except StoreError as exc:
            log.warning("relay mark failed: %s", exc, extra={"event": "relay_round_failed"})
        except Exception:
            log.exception("relay batch failed", extra={"event": "relay_round_failed"})

    async def _publish(self, row: OutboxRow) -> str | None:
        """Publish one row; None when confirmed, else the error to record."""
        with tracing.publishing(row.job_id, row.headers, row.destination) as span:
            started = time.monotonic()
            error = await self._publish_row(row)
            tracing.published(span, error)
            timer = (
                self._confirmed_seconds
                if error is None
                else self.rt.metrics.publish_seconds.labels(outcome=error.split(":", 1)[0])
            )
            timer.observe(time.monotonic() - started)
            return error

    async def _publish_row(self, row: OutboxRow) -> str | None:
        try:
            await self.rt.transport.publish(self.message_for(row))
        except PublishError as exc:
            kind = "publish_unknown" if exc.unknown else "publish_failed"
            log.warning(
                "publish failed: %s",
                exc,
                extra={"event": kind, "jobId": row.job_id, "outboxId": row.id},
            )
            return scrub(f"{kind}: {exc}")
        except TransportError as exc:
            log.warning(
                "broker error: %s", exc, extra={"event": "publish_unknown", "jobId": row.job_id}
            )
            return scrub(f"publish_unknown: {exc}")
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "published",
                extra={
                    "event": "published",
                    "jobId": row.job_id,
                    "outboxId": row.id,
                    "destination": row.destination,
                },
            )
        return None

    def _backoff(self, row: OutboxRow) -> timedelta:
        base = self.rt.settings.relay_poll_seconds
        seconds = min(base * 2 ** max(row.publish_attempts - 1, 0), _MAX_BACKOFF_SECONDS)
        return timedelta(seconds=seconds)

    async def _idle_seconds(self, poll: float) -> float:
        """How long to wait for a wake-up: the poll, or less when a delayed job's row falls
        due before it (a NOTIFY comes at enqueue, not at the due time)."""
        try:
            due_in = await self.rt.store.seconds_to_next_due()
        except StoreError:
            return poll  # the next round meets the outage and backs off
        return poll if due_in is None else min(poll, due_in)

    async def run(self, stop: asyncio.Event) -> None:
        """Relay until ``stop``; wake on NOTIFY or an in-process hint, else poll.

        The hot statements' connections are open before the relay says it started."""
        async with self.rt.store.hot_connections():
            await self._run(stop)

    async def _run(self, stop: asyncio.Event) -> None:
        wake = asyncio.Event()
        self.rt.store.outbox_listeners.append(wake)
        poll = self.rt.settings.relay_poll_seconds
        batch = self.rt.settings.relay_batch
        window = _Window(self.rt.settings.relay_window)
        log.info("relay started", extra={"event": "relay_started", "relay": self.relay_id})
        failures = 0  # store errors in a row, for the back-off
        async with OutboxListener(self.rt.engine, wake), heartbeat(self.rt, self.relay_id, "relay"):
            try:
                while not stop.is_set():
                    window.raise_fatal()
                    wake.clear()
                    room = window.room
                    if room == 0:
                        await _wait_any(stop, window.freed, seconds=poll)
                        continue
                    limit = min(batch, room)
                    try:
                        rows = await self._claim(limit, room)
                    except StoreError as exc:
                        # The database is down: back off (up to 8 s) instead of failing every
                        # poll; an in-process wake-up still ends the wait early.
                        failures += 1
                        log.warning(
                            "relay round failed: %s", exc, extra={"event": "relay_round_failed"}
                        )
                        await _wait_any(stop, wake, seconds=min(poll * 2**failures, 8.0))
                        continue
                    except Exception:
                        # Unknown failure: keep relaying; every row is still in the outbox.
                        log.exception("relay round failed", extra={"event": "relay_round_failed"})
                        rows = []
                    else:
                        failures = 0
                    if rows:
                        window.start(self._settle_in_window(rows), len(rows))
                    if len(rows) >= limit:
                        continue  # more waiting: go again at once (the window permitting)
                    idle = await self._idle_seconds(poll)
                    await _wait_any(stop, wake, window.fatal, seconds=idle)
            finally:
                # What was published gets its confirms and its mark; past the claim's expiry
                # another relay would publish the rows again anyway.
                await window.drain(self.rt.settings.relay_claim_seconds)
                self.rt.store.outbox_listeners.remove(wake)
        log.info("relay stopped", extra={"event": "relay_stopped", "published": self.published})


class _Window:
    """The batches a relay has published and not yet settled, counted in rows."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.in_flight = 0
        self.freed = asyncio.Event()  # set each time a batch settles
        self._tasks: set[asyncio.Task[None]] = set()
        # A batch ended by what is not an Exception (a simulated crash at a fault point):
        # the relay ends with it, as it would had the batch run in its own loop.
        self._fatal: BaseException | None = None
        self.fatal = asyncio.Event()

    def raise_fatal(self) -> None:
        if self._fatal is not None:
            raise self._fatal

    @property
    def room(self) -> int:
        return max(self.size - self.in_flight, 0)

    def start(self, settle: Coroutine[Any, Any, None], rows: int) -> None:
        self.in_flight += rows
        self.freed.clear()
        task = asyncio.create_task(settle)
        self._tasks.add(task)

        def done(_: asyncio.Task[None]) -> None:
            self._tasks.discard(task)
            self.in_flight -= rows
            if not task.cancelled() and task.exception() is not None:
                self._fatal = self._fatal or task.exception()
                self.fatal.set()
            self.freed.set()

        task.add_done_callback(done)

    async def drain(self, seconds: float) -> None:
        if not self._tasks:
            return
        pending = set(self._tasks)
        if self._fatal is not None:
            seconds = 0  # a crash settles nothing more
        try:
            _, late = await asyncio.wait(pending, timeout=seconds)
        except asyncio.CancelledError:
            for task in pending:  # the relay itself is cancelled: so are its batches
                task.cancel()
            raise
        for task in late:
            task.cancel()
        for task in late:
            with contextlib.suppress(asyncio.CancelledError):
                await task


async def _wait_any(*events: asyncio.Event, seconds: float) -> None:
    waiters = [asyncio.ensure_future(e.wait()) for e in events]
    try:
        await asyncio.wait(waiters, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waiters:
            w.cancel()
        for w in waiters:
            with contextlib.suppress(asyncio.CancelledError):
                await w
