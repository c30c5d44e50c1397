"""The database-backed transport: the embedded default, with RabbitMQ's delivery semantics.

A message is a row (SQL in ``storage.local_queue``). What stands in for each broker feature:

- publisher confirm: the commit of the inserted row;
- queues: a row's ``queue`` is its work routing key (``work``, ``work.Q``), and each
  ``consume(prefetch, queue=Q)`` claims only rows of Q;
- delayed retry tier ``retry.<n>s`` (``retry.Q.<n>s``): a row of the work queue (of Q) that
  becomes available n seconds later;
- prefetch and manual ack: at most ``prefetch`` rows claimed per consumer, deleted on ack
  (``ack``/``reject`` return False when the claim was lost and the row was left alone);
- requeue when a consumer dies: a claim is only good until ``invisible_until``; a background
  task renews it while the delivery is unsettled, so a live consumer keeps its long jobs and
  a dead one's rows come back after ``visibility_seconds`` with ``redelivered=True``;
- ``x-delivery-limit``: a row handed out more than ``topology.delivery_limit`` times is moved
  to the quarantine queue instead of out again.

Closing the iterator stops consuming and gives back rows claimed but not yet handed out,
uncounted: their ``delivery_count`` goes back down, since no consumer ever saw them (a
worker leaving a paused queue must not move its messages toward the delivery limit).
Deliveries already handed out are no longer renewed: a draining worker can still settle
them, and whatever it does not settle comes back after the visibility timeout, or at once
on ``close()``. With ``keep_in_flight`` they stay renewed until settled or ``close()``: a
worker leaving a paused queue keeps its long jobs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy.exc import DBAPIError, SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncEngine

from jobrelay.batching import Batcher
from jobrelay.domain.queues import DEFAULT_QUEUE, parse_destination
from jobrelay.errors import PublishError, StoreError, TransportError
from jobrelay.storage import local_queue as q
from jobrelay.storage.drivers import open_queue_driver
from jobrelay.transport.base import Delivery, OutgoingMessage, QueueStats
from jobrelay.transport.local_delivery import DOORBELLS, LocalDelivery
from jobrelay.transport.topology import Topology, work_routing_key

log = logging.getLogger("jobrelay.transport.local")
_DB_ERRORS = (SQLAlchemyError, OSError, StoreError)
_MAX_BACKOFF_SECONDS = 5.0


@dataclass(eq=False)
class _Stream:
    """One ``consume()`` iterator: claimed rows not yet handed out, and those in flight."""

    prefetch: int
    queue: str  # the rows' ``queue`` value it claims from
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    buffer: deque[q.Claimed] = field(default_factory=deque)
    handed: set[int] = field(default_factory=set)  # what fills the prefetch window
    # Handed out, their outcome committed, their ack to come: out of the window, still held.
    committed: set[int] = field(default_factory=set)


@dataclass(eq=False)
class _Hold:
    fence: int
    stream: _Stream
    settling: bool = False


class LocalTransport:
    def __init__(
        self,
        engine: AsyncEngine,
        topology: Topology,
        *,
        visibility_seconds: float = 30.0,
        poll_seconds: float = 0.2,
        consumer_id: str | None = None,
        clock: Callable[[], datetime] | None = None,
    ) -> None:
        if visibility_seconds <= 0 or poll_seconds <= 0:
            raise ValueError("visibility_seconds and poll_seconds must be positive")
        self._engine = engine
        self._topology = topology
        self._visibility = timedelta(seconds=visibility_seconds)
        self._poll = poll_seconds
        self._consumer = (
            consumer_id or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        )[:128]
        self._clock = clock or (lambda: datetime.now(UTC))
        self._bell = engine.url.render_as_string(hide_password=True)
        # Its claims and settles: on SQLite on a connection the consumers hold (one
        # hand-off to its thread per transaction), on PostgreSQL through SQLAlchemy.
        self._queue = open_queue_driver(engine)
        self._holds: dict[int, _Hold] = {}  # claims renewed for live iterators
        self._orphans: dict[int, int] = {}  # id -> fence, in flight from closed iterators
        self._streams: set[_Stream] = set()
        self._renewer: asyncio.Task[None] | None = None
        self._stopping = asyncio.Event()
        self._closed = False
        self._publishes: Batcher[dict[str, Any], None] = Batcher(self._insert_many, key=id)
        # Settles asked for while one is being written go together in the next transaction
        # (keyed on the message: two settles of one row are two fenced writes, one loses).
        self._settles: Batcher[tuple[q.Claimed, bool], bool] = Batcher(
            self._settle_many, key=lambda s: s[0].id
        )

    # --- lifecycle ------------------------------------------------------------------------

    async def connect(self) -> None:
        """Check the queue table is there; the migration is what "declares" this topology."""
        await self.ping()
        self._closed = False

    async def ping(self) -> None:
        try:
            async with q.reading(self._engine) as conn:
                await q.check_table(conn)
        except _DB_ERRORS as exc:
            # A dropped connection says nothing about the table: no upgrade to suggest.
            lost = isinstance(exc, DBAPIError) and exc.connection_invalidated
            hint = "" if lost else " (run `jobrelay db upgrade`?)"
            raise TransportError(f"local queue unreachable{hint}: {_short(exc)}") from exc

    async def close(self) -> None:
        """Stop every consumer and give back all unsettled rows at once."""
        self._closed = True
        for stream in self._streams:
            stream.wake.set()
        if self._renewer is not None:
            # Woken, not cancelled: a cancel landing mid-transaction can strand a connection.
            self._stopping.set()
            await self._renewer
            self._renewer = None
        orphans, self._orphans = self._orphans, {}
        await self._give_back(list(self._holds), orphans)

    # --- publishing -----------------------------------------------------------------------

    async def publish(self, message: OutgoingMessage) -> None:
        destination = message.destination
        if not self._topology.routes(destination):
            raise PublishError(f"unroutable: no queue for destination {destination!r}")
        parsed = parse_destination(destination)
        assert parsed is not None  # routes() said so
        queue, delay = parsed[0], parsed[1] or 0
        try:
            body = message.body.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise PublishError("the local transport stores text: body is not UTF-8") from exc
        row = {
            "queue": work_routing_key(queue),  # a tier's row waits in its work queue
            "body": body,
            "headers": message.headers,
            "delay": delay,
        }
        try:
            # Concurrent publishes (a relay's batch) share one transaction: the "confirm"
            # each of them awaits is that commit.
            await self._publishes.submit(row)
        except _DB_ERRORS as exc:
            # We cannot tell whether the commit happened; the relay will simply publish again.
            raise PublishError(f"database write failed: {_short(exc)}", unknown=True) from exc

    def wake_consumers(self) -> None:
        """Look at the queues now: a test moved its fake clock, and delayed rows fell due."""
        DOORBELLS.ring(self._bell)

    async def _insert_many(self, rows: Sequence[dict[str, Any]]) -> list[None]:
        now = self._clock()
        inserts = [
            {
                "queue": r["queue"],
                "body": r["body"],
                "headers": r["headers"],
                "available_at": now + timedelta(seconds=r["delay"]),
            }
            for r in rows
        ]
        await self._queue.publish(inserts, now)
        DOORBELLS.ring(self._bell)  # once per batch: the consumers claim what it committed
        return [None] * len(rows)

    async def quarantine_depth(self) -> int:
        try:
            async with q.reading(self._engine) as conn:
                return await q.count_queue(conn, q.QUARANTINE)
        except _DB_ERRORS as exc:
            raise TransportError(f"local queue unreachable: {_short(exc)}") from exc

    async def work_ready(self) -> int:
        try:
            async with q.reading(self._engine) as conn:
                queues = [work_routing_key(name) for name in self._topology.queues]
                return await q.count_ready(conn, self._clock(), queues)
        except _DB_ERRORS as exc:
            raise TransportError(f"local queue unreachable: {_short(exc)}") from exc

    async def queue_stats(self) -> list[QueueStats]:
        """Ready and in-flight rows per work queue; consumers are not registered anywhere
        (a consumer is whoever claims next), so their number is unknown."""
        names = {work_routing_key(name): name for name in self._topology.queues}
        try:
            async with q.reading(self._engine) as conn:
                depths = await q.queue_depths(conn, self._clock(), list(names))
        except _DB_ERRORS as exc:
            raise TransportError(f"local queue unreachable: {_short(exc)}") from exc
        return [
            QueueStats(name, depths.get(key, (0, 0))[0], None, depths.get(key, (0, 0))[1])
            for key, name in names.items()
        ]

    # --- consuming ------------------------------------------------------------------------

    async def consume(
        self, prefetch: int, queue: str = DEFAULT_QUEUE, *, keep_in_flight: bool = False
    ) -> AsyncIterator[Delivery]:
        if prefetch < 1:
            raise ValueError("prefetch must be at least 1")
        if self._closed:
            raise TransportError("transport is closed")
        if queue not in self._topology.queues:
            raise TransportError(f"cannot consume from queue {queue!r}: not in the topology")
        stream = _Stream(prefetch, work_routing_key(queue))
        held = contextlib.AsyncExitStack()
        await held.enter_async_context(self._queue.held())
        bell = DOORBELLS.register(self._bell, stream.wake)
        self._streams.add(stream)
        self._start_renewer()
        backoff = self._poll
        try:
            while not self._closed:
                if stream.buffer:
                    claim = stream.buffer.popleft()
                    stream.handed.add(claim.id)
                    yield LocalDelivery(self, claim)
                    continue
                stream.wake.clear()
                wait: float | None = None  # prefetch full: sleep until a settle wakes us
                if len(stream.handed) < prefetch:
                    try:
                        if await self._claim_shielded(stream):
                            backoff = self._poll
                            continue
                        wait = self._poll
                    except TransportError as exc:
                        log.warning("claim failed: %s", exc, extra={"event": "consume_retry"})
                        wait, backoff = backoff, min(backoff * 2, _MAX_BACKOFF_SECONDS)
                # Not wait_for: on 3.11 it swallows a cancel that lands as the event is set
                # (an ack then closing the iterator), and the consumer would never stop.
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(wait):
                        await stream.wake.wait()
        finally:
            DOORBELLS.unregister(self._bell, bell)
            self._streams.discard(stream)
            # Claimed but never handed out: given back now, under the fence of that claim (a
            # claim still running as close() gave back the rows can have taken them again).
            unstarted = {c.id: c.fence for c in stream.buffer}
            stream.buffer = deque()
            handed: dict[int, int] = {}
            # Handed out, and those whose outcome committed and whose ack is still to come.
            for message_id in stream.handed | stream.committed:
                hold = self._holds.get(message_id)
                if hold is None or message_id in unstarted:
                    continue
                if self._closed:  # close() has run or is running: nobody settles these now
                    handed[message_id] = hold.fence
                elif not keep_in_flight:
                    # No longer renewed, so they come back after the visibility timeout
                    # unless settled first (a draining worker still acks them).
                    self._orphans[message_id] = hold.fence
                    del self._holds[message_id]
            for message_id in (*unstarted, *handed):
                self._holds.pop(message_id, None)
            try:
                # Even if we are being cancelled: the unstarted uncounted, the rest counted.
                await asyncio.shield(self._give_back([], handed, unstarted=unstarted))
            finally:
                await asyncio.shield(held.aclose())

    async def _claim_shielded(self, stream: _Stream) -> bool:
        """Claim into ``stream.buffer``; a cancelled caller still gets the rows given back.

        The claim itself is shielded so its result is always recorded: otherwise a claim
        committed just as the worker cancels ``anext`` would strand its rows until the
        visibility timeout.
        """
        claiming = asyncio.ensure_future(self._claim(stream))
        try:
            return await asyncio.shield(claiming)
        except asyncio.CancelledError:
            await asyncio.gather(claiming, return_exceptions=True)
            raise

    async def _claim(self, stream: _Stream) -> bool:
        now = self._clock()
        try:
            result = await self._queue.claim(
                queue=stream.queue,
                consumer=self._consumer,
                now=now,
                invisible_until=now + self._visibility,
                limit=stream.prefetch - len(stream.handed) - len(stream.buffer),
                delivery_limit=self._topology.delivery_limit,
            )
        except _DB_ERRORS as exc:
            raise TransportError(f"claim failed: {_short(exc)}") from exc
        for claim in result.claimed:
            self._holds[claim.id] = _Hold(claim.fence, stream)
            stream.buffer.append(claim)
        if result.quarantined:
            log.warning(
                "delivery limit exceeded: %d message(s) quarantined",
                result.quarantined,
                extra={"event": "delivery_limit_quarantined", "count": result.quarantined},
            )
        return bool(result.claimed or result.quarantined)

    # --- settling and claims --------------------------------------------------------------

    async def _settle(self, claim: q.Claimed, *, reject: bool) -> bool:
        """True when the row was deleted (or quarantined) under our claim and committed.

        False when the claim was lost (the row was claimed again since, under a new fence,
        or given back): nothing was changed, and the row is another delivery's now. A claim
        past its visibility timeout that nobody took over still settles. A failed write
        raises ``TransportError``.
        """
        hold = self._holds.get(claim.id)
        if hold is not None and hold.fence == claim.fence:
            hold.settling = True
        # Shielded: a worker cancelled mid-ack still finishes the write (or its rollback).
        held = await asyncio.shield(self._write_settle(claim, reject=reject))
        if not held:
            log.warning(
                "settle ignored: claim on message %s was lost (visibility timeout passed)",
                claim.id,
                extra={"event": "settle_ignored", "messageId": claim.id},
            )
        return held

    async def _write_settle(self, claim: q.Claimed, *, reject: bool) -> bool:
        try:
            return await self._settles.submit((claim, reject))
        except _DB_ERRORS as exc:
            # Not renewed any more: the row comes back after the visibility timeout.
            raise TransportError(f"settle failed: {_short(exc)}") from exc
        finally:
            self._forget(claim.id, claim.fence)
            if self._orphans.get(claim.id) == claim.fence:
                del self._orphans[claim.id]

    async def _settle_many(self, settles: Sequence[tuple[q.Claimed, bool]]) -> list[bool]:
        """The acks and rejects asked for meanwhile, each fenced on its own claim, in ONE
        write transaction: one commit for the lot, the acks one statement. Each still wins
        or loses alone (a lost claim changes nothing); a failed write fails all of them."""
        return await self._queue.settle(self._consumer, settles, self._clock())

    async def _release(self, claim: q.Claimed) -> None:
        """Give one handed-out message back now, as RabbitMQ's nack with requeue does."""
        self._forget(claim.id, claim.fence)
        try:
            async with q.writing(self._engine) as conn:
                await q.release_claims(
                    conn, consumer=self._consumer, claims={claim.id: claim.fence}
                )
        except _DB_ERRORS as exc:
            # Not renewed any more: the row comes back after the visibility timeout anyway.
            raise TransportError(f"release failed: {_short(exc)}") from exc

    def _committed(self, claim: q.Claimed) -> None:
        """Its job's outcome is committed: free its prefetch slot (waking its consumer) now,
        not after the ack's own transaction; the claim stays held and renewed until then."""
        hold = self._holds.get(claim.id)
        if hold is not None and hold.fence == claim.fence and claim.id in hold.stream.handed:
            hold.stream.handed.discard(claim.id)
            hold.stream.committed.add(claim.id)
            hold.stream.wake.set()

    def _forget(self, message_id: int, fence: int) -> None:
        """Stop renewing a claim and free its prefetch slot (waking its consumer)."""
        hold = self._holds.get(message_id)
        if hold is not None and hold.fence == fence:
            del self._holds[message_id]
            hold.stream.handed.discard(message_id)
            hold.stream.committed.discard(message_id)
            hold.stream.wake.set()

    async def _give_back(
        self,
        ids: list[int],
        orphans: Mapping[int, int] | None = None,
        *,
        unstarted: Mapping[int, int] | None = None,
    ) -> None:
        """Release claims now instead of waiting out the visibility timeout (best effort);
        ``unstarted`` ones (never handed out) without counting their hand-out."""
        claims = {i: h.fence for i in ids if (h := self._holds.pop(i, None)) is not None}
        claims.update(orphans or {})
        if not claims and not unstarted:
            return
        try:
            async with q.writing(self._engine) as conn:
                await q.release_claims(conn, consumer=self._consumer, claims=claims)
                if unstarted:
                    await q.release_claims(
                        conn, consumer=self._consumer, claims=unstarted, counted=False
                    )
        except _DB_ERRORS as exc:
            log.warning(
                "could not give back %d message(s); they return after the visibility timeout: %s",
                len(claims) + len(unstarted or {}),
                _short(exc),
                extra={"event": "release_failed"},
            )

    def _start_renewer(self) -> None:
        if self._renewer is None or self._renewer.done():
            self._stopping = asyncio.Event()
            self._renewer = asyncio.create_task(self._renew_until_closed())

    async def _renew_until_closed(self) -> None:
        interval = self._visibility.total_seconds() / 3
        while not self._stopping.is_set():
            with contextlib.suppress(TimeoutError):  # the usual way out: time to renew
                async with asyncio.timeout(interval):
                    await self._stopping.wait()
                return  # closed
            claims = {i: h.fence for i, h in self._holds.items()}
            if not claims:
                continue
            now = self._clock()
            try:
                async with q.writing(self._engine) as conn:
                    kept = await q.renew_claims(
                        conn,
                        consumer=self._consumer,
                        claims=claims,
                        invisible_until=now + self._visibility,
                    )
            except _DB_ERRORS as exc:
                log.warning(
                    "claim renewal failed: %s", _short(exc), extra={"event": "renew_failed"}
                )
                continue
            for message_id in claims.keys() - kept:
                hold = self._holds.get(message_id)
                if hold is None or hold.settling:
                    continue
                self._forget(message_id, claims[message_id])
                log.warning(
                    "claim on message %s lost; another consumer may have it",
                    message_id,
                    extra={"event": "claim_lost", "messageId": message_id},
                )


def _short(exc: BaseException) -> str:
    lines = str(getattr(exc, "orig", None) or exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"


__all__ = ["LocalTransport"]
