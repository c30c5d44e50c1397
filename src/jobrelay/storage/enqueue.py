"""A new job, written on a connection someone else owns: the application's own transaction.

This is the seed's one transaction: the application's change, the job row, its outbox row
and its ``accepted`` event commit together or not at all. The statements are written once,
as a generator that yields each statement and receives its result, and run either on an
asynchronous SQLAlchemy connection (asyncpg, aiosqlite) or a synchronous one (psycopg,
sqlite3). Nothing here commits, begins, or opens a connection: a rollback of the caller's
transaction leaves no trace, and on PostgreSQL the relay's wake-up (``pg_notify``) is
delivered only at the caller's commit.
"""

from __future__ import annotations

from collections.abc import Generator
from datetime import datetime
from typing import Any, TypeVar

from sqlalchemy import Connection, Executable, insert, select, text
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncConnection

from jobrelay.domain.messages import JobMessage
from jobrelay.domain.states import JobState
from jobrelay.errors import ConfigError, IdempotencyConflict
from jobrelay.storage.records import NOTIFY_CHANNEL, NewJob, work_destination
from jobrelay.storage.tables import job_events, jobs, outbox

T = TypeVar("T")
Steps = Generator[Executable, Any, T]


def new_job_steps(dialect: str, job: NewJob, now: datetime) -> Steps[tuple[str, bool]]:
    """Insert the job unless its id exists; then its outbox row and ``accepted`` event.

    Returns ``(job_id, created)``. An existing job with the same request hash is the same
    request again: nothing is written. Another hash under the same id raises
    ``IdempotencyConflict``.
    """
    if dialect not in ("postgresql", "sqlite"):
        raise ConfigError("connection", f"jobrelay supports PostgreSQL and SQLite, not {dialect}")
    upsert = postgresql.insert(jobs) if dialect == "postgresql" else sqlite.insert(jobs)
    inserted = (
        yield upsert.values(
            id=job.job_id,
            type=job.type,
            account_id=job.account_id,
            params=job.params,
            idempotency_key=job.idempotency_key,
            request_hash=job.request_hash,
            state=JobState.QUEUED.value,
            attempt=0,
            max_attempts=job.max_attempts,
            queue=job.queue,
            created_at=now,
            updated_at=now,
        )
        .on_conflict_do_nothing(index_elements=[jobs.c.id])
        .returning(jobs.c.id)
    )
    # RETURNING, not rowcount: psycopg reports -1 for an INSERT … ON CONFLICT here.
    if inserted.first() is None:
        existing = (yield select(jobs.c.request_hash).where(jobs.c.id == job.job_id)).scalar_one()
        if existing != job.request_hash:
            raise IdempotencyConflict(
                "this Idempotency-Key was already used with a different request body"
            )
        return job.job_id, False
    body = JobMessage(job_id=job.job_id, type=job.type).encode().decode()
    yield insert(outbox).values(
        job_id=job.job_id,
        destination=job.destination or work_destination(job.queue),
        body=body,
        headers=dict(job.headers or {}),
        created_at=now,
    )
    if dialect == "postgresql":
        # Delivered at commit, to listening relays only: a hint, never the only path.
        yield text("SELECT pg_notify(:c, '')").bindparams(c=NOTIFY_CHANNEL)
    yield insert(job_events).values(
        job_id=job.job_id, at=now, kind="accepted", detail={"type": job.type}
    )
    return job.job_id, True


async def run_async(conn: AsyncConnection, steps: Steps[T]) -> T:
    """Run ``steps`` on an asynchronous connection, inside whatever transaction it has."""
    try:
        statement = next(steps)
        while True:
            statement = steps.send(await conn.execute(statement))
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]


def run_sync(conn: Connection, steps: Steps[T]) -> T:
    """Run ``steps`` on a synchronous connection, inside whatever transaction it has."""
    try:
        statement = next(steps)
        while True:
            statement = steps.send(conn.execute(statement))
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]
