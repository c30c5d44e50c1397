"""The local transport's queue as SQL: every statement it runs, each a named function.

One row of ``local_messages`` is one message. A consumer owns a row while ``consumer`` names
it and ``invisible_until`` lies in the future; ``delivery_count`` is bumped on every claim and
doubles as a fencing token, so a consumer that lost its claim (it stalled past the visibility
timeout and someone else took the row) can never ack or reject the new holder's delivery.

Rules, the same as the job store's:
- Times come from the caller's clock, never the database's ``now()``.
- Claims run in one short write transaction: ``FOR UPDATE SKIP LOCKED`` lets PostgreSQL
  consumers claim side by side; on SQLite ``BEGIN IMMEDIATE`` (see ``engine``) serialises
  claimers across processes, so two of them never read the same free row.
- Every settle is guarded on (id, consumer, fence); the caller learns from the result whether
  it still held the row.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import and_, delete, func, insert, not_, or_, select, tuple_, update
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from jobrelay.domain.messages import dead_letter_reason, peek_job_id
from jobrelay.storage.engine import begin_write, read_only
from jobrelay.storage.records import event_job, jsonable
from jobrelay.storage.tables import job_events
from jobrelay.storage.tables import local_messages as lm

# A row's ``queue`` is the work routing key of its queue: "work" for the default queue,
# "work.Q" for queue Q (see ``transport.topology``); or "quarantine".
WORK = "work"
QUARANTINE = "quarantine"
# Why a row reached the quarantine queue ("rejected" or "delivery_limit", as RabbitMQ says).
REASON_HEADER = "x-quarantine-reason"


@dataclass(frozen=True)
class Claimed:
    id: int
    body: bytes
    headers: dict[str, Any]
    delivery_count: int  # handed out before this claim
    fence: int  # the row's delivery_count while this claim holds it


@dataclass(frozen=True)
class ClaimResult:
    claimed: list[Claimed]
    quarantined: int  # rows moved aside instead, for exceeding the delivery limit


@contextlib.asynccontextmanager
async def writing(engine: AsyncEngine) -> AsyncIterator[AsyncConnection]:
    """A write transaction (BEGIN IMMEDIATE on SQLite, so the lock is taken up front),
    queued behind the process's other writers (``engine.begin_write``)."""
    async with begin_write(engine) as conn:
        yield conn


def reading(engine: AsyncEngine) -> contextlib.AbstractAsyncContextManager[AsyncConnection]:
    """A read-only transaction, which on SQLite does not queue behind the writers."""
    return read_only(engine)


async def check_table(conn: AsyncConnection) -> None:
    """Fail (with the driver's error) unless the queue table exists and can be read."""
    await conn.execute(select(lm.c.id).limit(1))


async def insert_messages(
    conn: AsyncConnection, rows: Sequence[Mapping[str, Any]], now: datetime
) -> None:
    """Queue many messages (each: queue, body, headers, available_at) in one statement."""
    await conn.execute(
        insert(lm),
        [
            {
                **row,
                "headers": dict(row["headers"]),
                "delivery_count": 0,
                "created_at": now,
                "dead_lettered_at": now if row["queue"] == QUARANTINE else None,
            }
            for row in rows
        ],
    )


async def _record_dead_letter(
    conn: AsyncConnection, body: str, deliveries: int, limit: int, now: datetime
) -> None:
    """A ``dead_lettered`` event on the job the message names, in the claim's transaction, so
    its timeline says why it stopped coming (RabbitMQ's own backstop is silent; see
    ``worker.consumer`` for the event written there)."""
    job_id = peek_job_id(body.encode())
    if job_id is None or await conn.scalar(event_job(job_id)) is None:
        return
    detail = {
        "reason": dead_letter_reason(deliveries, limit),
        "deliveries": deliveries,
        "limit": limit,
    }
    await conn.execute(
        insert(job_events).values(
            job_id=job_id, at=now, kind="dead_lettered", detail=jsonable(detail)
        )
    )


async def claim_messages(
    conn: AsyncConnection,
    *,
    queue: str = WORK,
    consumer: str,
    now: datetime,
    invisible_until: datetime,
    limit: int,
    delivery_limit: int,
) -> ClaimResult:
    """Take up to ``limit`` visible rows of ``queue``; quarantine those past the delivery limit.

    A row already handed out more than ``delivery_limit`` times goes to the quarantine queue
    here instead of out again: the same backstop as RabbitMQ's ``x-delivery-limit`` for a
    message that kills every consumer that takes it.
    """
    rows = (
        await conn.execute(
            select(lm.c.id, lm.c.body, lm.c.headers, lm.c.delivery_count)
            .where(
                lm.c.queue == queue,
                lm.c.available_at <= now,
                or_(lm.c.invisible_until.is_(None), lm.c.invisible_until <= now),
            )
            .order_by(lm.c.available_at, lm.c.id)
            .limit(limit)
            .with_for_update(skip_locked=True)
        )
    ).all()
    exhausted = [r for r in rows if r.delivery_count > delivery_limit]
    for row in exhausted:
        await _record_dead_letter(conn, row.body, row.delivery_count, delivery_limit, now)
        headers = {**(row.headers or {}), REASON_HEADER: "delivery_limit"}
        await conn.execute(
            update(lm)
            .where(lm.c.id == row.id)
            .values(
                queue=QUARANTINE,
                consumer=None,
                invisible_until=None,
                headers=headers,
                dead_lettered_at=now,
            )
        )
    fresh = [r for r in rows if r.delivery_count <= delivery_limit]
    if fresh:
        await conn.execute(
            update(lm)
            .where(lm.c.id.in_([r.id for r in fresh]))
            .values(
                consumer=consumer,
                invisible_until=invisible_until,
                delivery_count=lm.c.delivery_count + 1,
            )
        )
    claimed = [
        Claimed(
            id=r.id,
            body=r.body.encode(),
            headers=dict(r.headers or {}),
            delivery_count=r.delivery_count,
            fence=r.delivery_count + 1,
        )
        for r in fresh
    ]
    return ClaimResult(claimed=claimed, quarantined=len(exhausted))


def _held(message_id: int, consumer: str, fence: int) -> list[Any]:
    return [
        lm.c.id == message_id,
        lm.c.queue != QUARANTINE,
        lm.c.consumer == consumer,
        lm.c.delivery_count == fence,
    ]


async def renew_claims(
    conn: AsyncConnection, *, consumer: str, claims: Mapping[int, int], invisible_until: datetime
) -> set[int]:
    """Push back ``invisible_until`` of rows still held; returns the ids that were.

    ``claims`` maps id to fence. An id missing from the result was lost (its claim expired
    and another consumer took it), so the caller stops counting it as in flight.
    """
    if not claims:
        return set()
    result = await conn.execute(
        update(lm)
        .where(lm.c.id.in_(list(claims)), lm.c.queue != QUARANTINE, lm.c.consumer == consumer)
        .values(invisible_until=invisible_until)
        .returning(lm.c.id, lm.c.delivery_count)
    )
    return {r.id for r in result.all() if claims.get(r.id) == r.delivery_count}


async def delete_claimed(
    conn: AsyncConnection, *, message_id: int, consumer: str, fence: int
) -> bool:
    """The ack: remove the row, only if this claim still holds it."""
    result = await conn.execute(delete(lm).where(*_held(message_id, consumer, fence)))
    return bool(result.rowcount == 1)


async def delete_many_claimed(
    conn: AsyncConnection, *, consumer: str, claims: Mapping[int, int]
) -> set[int]:
    """Many acks in one statement: each row removed only if its claim (id -> fence) still
    holds it, as ``delete_claimed``; returns the ids that were."""
    if not claims:
        return set()
    result = await conn.execute(
        delete(lm)
        .where(
            tuple_(lm.c.id, lm.c.delivery_count).in_(list(claims.items())),
            lm.c.queue != QUARANTINE,
            lm.c.consumer == consumer,
        )
        .returning(lm.c.id)
    )
    return {r.id for r in result.all()}


async def quarantine_claimed(
    conn: AsyncConnection,
    *,
    message_id: int,
    consumer: str,
    fence: int,
    headers: Mapping[str, Any],
    now: datetime,
) -> bool:
    """The reject: move the row (body kept) to the quarantine queue, if still held.

    ``now`` is kept as ``dead_lettered_at``: retention counts the dead letter's age from it.
    """
    result = await conn.execute(
        update(lm)
        .where(*_held(message_id, consumer, fence))
        .values(
            queue=QUARANTINE,
            consumer=None,
            invisible_until=None,
            headers={**headers, REASON_HEADER: "rejected"},
            dead_lettered_at=now,
        )
    )
    return bool(result.rowcount == 1)


async def release_claims(
    conn: AsyncConnection, *, consumer: str, claims: Mapping[int, int], counted: bool = True
) -> int:
    """Make held rows visible again at once (a consumer that stops cleanly gives them back).

    ``delivery_count`` stays bumped, so the next delivery says ``redelivered`` and the
    delivery limit still counts the hand-out. ``counted=False`` is for rows claimed but never
    handed to the consumer's caller (prefetched, then the consumer left): the claim is undone,
    count included. The next claim then reuses the fence, which is safe because no delivery
    of the undone claim exists to settle with it.
    """
    released = 0
    values: dict[str, Any] = {"consumer": None, "invisible_until": None}
    if not counted:
        values["delivery_count"] = lm.c.delivery_count - 1
    for message_id, fence in claims.items():
        result = await conn.execute(
            update(lm).where(*_held(message_id, consumer, fence)).values(**values)
        )
        released += result.rowcount
    return released


class PortableQueue:
    """The local transport's claims and settles as the portable statements above, each in
    a write transaction through SQLAlchemy (PostgreSQL; ``drivers.open_queue_driver``)."""

    def __init__(self, engine: AsyncEngine) -> None:
        self._engine = engine

    def held(self) -> contextlib.AbstractAsyncContextManager[None]:
        return contextlib.nullcontext()

    async def publish(self, rows: Sequence[Mapping[str, Any]], now: datetime) -> None:
        async with writing(self._engine) as conn:
            await insert_messages(conn, rows, now)

    async def claim(self, **asked: Any) -> ClaimResult:
        async with writing(self._engine) as conn:
            return await claim_messages(conn, **asked)

    async def settle(
        self, consumer: str, settles: Sequence[tuple[Claimed, bool]], now: datetime
    ) -> list[bool]:
        acks = {claim.id: claim.fence for claim, reject in settles if not reject}
        held: dict[int, bool] = {}
        async with writing(self._engine) as conn:
            deleted = await delete_many_claimed(conn, consumer=consumer, claims=acks)
            for claim, reject in settles:
                if reject:
                    held[claim.id] = await quarantine_claimed(
                        conn,
                        message_id=claim.id,
                        consumer=consumer,
                        fence=claim.fence,
                        headers=claim.headers,
                        now=now,
                    )
        return [held[c.id] if reject else c.id in deleted for c, reject in settles]


async def count_queue(conn: AsyncConnection, queue: str) -> int:
    n = await conn.scalar(select(func.count()).select_from(lm).where(lm.c.queue == queue))
    return int(n or 0)


async def count_ready(conn: AsyncConnection, now: datetime, queues: Sequence[str]) -> int:
    """Messages of ``queues`` due and handed to no consumer: what RabbitMQ calls ready."""
    n = await conn.scalar(
        select(func.count())
        .select_from(lm)
        .where(
            lm.c.queue.in_(list(queues)),
            lm.c.available_at <= now,
            or_(lm.c.invisible_until.is_(None), lm.c.invisible_until <= now),
        )
    )
    return int(n or 0)


async def queue_depths(
    conn: AsyncConnection, now: datetime, queues: Sequence[str]
) -> dict[str, tuple[int, int]]:
    """Per queue: (ready, in flight), where in flight is held by a consumer's live claim."""
    held = and_(lm.c.consumer.is_not(None), lm.c.invisible_until > now)
    rows = await conn.execute(
        select(
            lm.c.queue,
            func.count().filter(and_(lm.c.available_at <= now, not_(held))),
            func.count().filter(held),
        )
        .where(lm.c.queue.in_(list(queues)))
        .group_by(lm.c.queue)
    )
    return {r[0]: (int(r[1] or 0), int(r[2] or 0)) for r in rows}


__all__ = [
    "QUARANTINE",
    "REASON_HEADER",
    "WORK",
    "ClaimResult",
    "Claimed",
    "PortableQueue",
    "check_table",
    "claim_messages",
    "count_queue",
    "count_ready",
    "delete_claimed",
    "insert_messages",
    "quarantine_claimed",
    "queue_depths",
    "reading",
    "release_claims",
    "renew_claims",
    "writing",
]
