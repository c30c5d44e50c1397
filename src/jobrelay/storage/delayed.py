"""Delayed jobs in SQL: which outbox rows are due, since when, and when the next one is.

A delayed job's outbox row carries ``available_at`` (its ``jobs.run_at``): the relay does not
take it before then, so the job is never published early and holds no broker message or
worker memory while it waits. Everything that judges a waiting row (the relay's claim, the
reconciler's "stuck publish", the backlog gauges, the job's ``unpublished since``) judges it
by these expressions, so "waiting on purpose" and "stuck" are told apart in one place.
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import ColumnElement, and_, delete, func, or_, select, type_coerce
from sqlalchemy.ext.asyncio import AsyncConnection

from jobrelay.storage.records import aware_time
from jobrelay.storage.tables import UTCDateTime, outbox


def outbox_due(now: ColumnElement[datetime]) -> ColumnElement[bool]:
    """The relay's guard: the row may be published at ``now`` (not held, or held until then).

    The one statement of it: the SQLAlchemy claim uses it as it is, the asyncpg claim as
    PostgreSQL text (``transitions.guard_sql``)."""
    return or_(outbox.c.available_at.is_(None), outbox.c.available_at <= now)


def waiting_due(now: ColumnElement[datetime]) -> ColumnElement[bool]:
    """Not published, and due by ``now``: a row the relay should be sending."""
    return and_(outbox.c.published_at.is_(None), outbox_due(now))


def due_since() -> ColumnElement[datetime]:
    """Since when a waiting row has been due: its hold's end, else when it was written.

    Ages (queue lag, "unpublished for …", the oldest-unpublished gauge) count from here, not
    from the enqueue: a job due in an hour is not an hour late when it is published."""
    return type_coerce(func.coalesce(outbox.c.available_at, outbox.c.created_at), UTCDateTime())


async def seconds_to_next_due(conn: AsyncConnection, now: ColumnElement[datetime]) -> float | None:
    """Seconds until the earliest held row falls due, by the store's clock (None: none is
    held), read with ``ix_outbox_delayed``; the clock is read in the same statement."""
    row = (
        await conn.execute(
            select(func.min(outbox.c.available_at), now).where(
                outbox.c.published_at.is_(None),
                outbox.c.available_at.is_not(None),
                outbox.c.available_at > now,
            )
        )
    ).one()
    due, at = aware_time(row[0]), aware_time(row[1])
    if due is None or at is None:
        return None
    return max((due - at).total_seconds(), 0.0)


async def drop_held(conn: AsyncConnection, job_id: str) -> int:
    """Delete the job's held rows (a delayed job cancelled before its time, a job cancelled
    while it waited for its limits), in the caller's transaction: nothing is ever published
    for it. Returns how many there were."""
    result = await conn.execute(
        delete(outbox).where(
            outbox.c.job_id == job_id,
            outbox.c.published_at.is_(None),
            or_(outbox.c.available_at.is_not(None), outbox.c.awaiting_admission.is_(True)),
        )
    )
    return int(result.rowcount or 0)
