"""The relay: move outbox rows to the broker, and mark them published only once confirmed.

Each round claims a batch in a short transaction (the claim is a column with an expiry, so
no transaction stays open while we wait for the broker), publishes the batch concurrently,
awaits every confirm, and then marks the confirmed rows in a second short transaction. The
``published`` event is stamped with the claim's instant (by the store's clock), not the
confirm's: RabbitMQ may hand the message to a worker, which claims the job, before the
confirm reaches us, and the timeline must not show that claim before the publish.

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
from datetime import timedelta

from jobrelay.domain.messages import OUTBOX_ID_HEADER
from jobrelay.errors import PublishError, StoreError, TransportError
from jobrelay.observe import logs
from jobrelay.roles.heartbeat import heartbeat
from jobrelay.roles.runtime import Runtime
from jobrelay.storage.notify import OutboxListener
from jobrelay.storage.store import OutboxRow
from jobrelay.transport.base import OutgoingMessage

log = logging.getLogger("jobrelay.relay")

_MAX_BACKOFF_SECONDS = 30.0


def new_relay_id() -> str:
    return f"relay:{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"


class Relay:
    def __init__(self, rt: Runtime, *, relay_id: str | None = None) -> None:
        self.rt = rt
        self.relay_id = relay_id or new_relay_id()
        self.claim_for = timedelta(seconds=rt.settings.relay_claim_seconds)
        self.published = 0
        self.failed = 0

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
        store = self.rt.store
        rows = await store.claim_outbox(self.relay_id, self.rt.settings.relay_batch, self.claim_for)
        if not rows:
            return 0
        outcomes = await asyncio.gather(
            *(self._publish(row) for row in rows), return_exceptions=False
        )
        confirmed = [row for row, error in zip(rows, outcomes, strict=True) if error is None]
        self.rt.faults.hit("relay.before_mark")
        if confirmed:
            await store.mark_published(self.relay_id, confirmed)
            self.published += len(confirmed)
        for row, error in zip(rows, outcomes, strict=True):
            if error is not None:
                self.failed += 1
                await store.release_outbox(row, error, self._backoff(row))
        return len(rows)

    async def _publish(self, row: OutboxRow) -> str | None:
        """Publish one row; None when confirmed, else the error to record."""
        with logs.bound(traceId=logs.trace_id(row.headers.get("traceparent"))):
            started = time.monotonic()
            error = await self._publish_row(row)
            outcome = "confirmed" if error is None else error.split(":", 1)[0]
            self.rt.metrics.publish_seconds.labels(outcome=outcome).observe(
                time.monotonic() - started
            )
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
            return f"{kind}: {exc}"
        except TransportError as exc:
            log.warning(
                "broker error: %s", exc, extra={"event": "publish_unknown", "jobId": row.job_id}
            )
            return f"publish_unknown: {exc}"
        log.info(
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
        log.info("relay started", extra={"event": "relay_started", "relay": self.relay_id})
        failures = 0  # store errors in a row, for the back-off
        async with OutboxListener(self.rt.engine, wake), heartbeat(self.rt, self.relay_id, "relay"):
            try:
                while not stop.is_set():
                    wake.clear()
                    try:
                        claimed = await self.relay_once()
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
                        claimed = 0
                    else:
                        failures = 0
                    if claimed >= self.rt.settings.relay_batch:
                        continue  # more waiting: go again at once
                    await _wait_any(stop, wake, seconds=await self._idle_seconds(poll))
            finally:
                self.rt.store.outbox_listeners.remove(wake)
        log.info("relay stopped", extra={"event": "relay_stopped", "published": self.published})


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
