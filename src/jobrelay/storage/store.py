"""The job store: every query jobrelay runs against its own tables, each a named method.

Rules every method keeps:
- A state change is a guarded ``UPDATE … WHERE state IN (:legal sources)``; the caller learns
  from the returned bool whether it won. Nobody overwrites a state they did not read.
- Each transition writes its ``job_events`` row in the same transaction.
- A message to send is an ``outbox`` row written in the same transaction as the state it
  belongs to; nothing here talks to the broker.
- Times come from the caller (an injected clock), never from the database's ``now()``, so
  tests can move time and SQLite and PostgreSQL agree.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Row, and_, delete, func, insert, or_, select, text, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from jobrelay.domain.messages import JobMessage
from jobrelay.domain.policy import RETRY_SLACK, JobView
from jobrelay.domain.states import JobState, sources_for
from jobrelay.errors import IdempotencyConflict, StoreError
from jobrelay.storage.effects import EffectsLedger
from jobrelay.storage.engine import READ_ONLY_OPTION, first_line, read_tx, write_tx
from jobrelay.storage.tables import (
    UTCDateTime,
    api_tokens,
    job_events,
    jobs,
    ledger_entries,
    outbox,
)

NOTIFY_CHANNEL = "jobrelay_outbox"
WORK_DESTINATION = "work"


def retry_destination(seconds: int) -> str:
    return f"retry.{seconds}s"


@dataclass(frozen=True)
class NewJob:
    job_id: str
    type: str
    account_id: str
    params: dict[str, Any]
    request_hash: str
    max_attempts: int
    idempotency_key: str | None = None
    headers: Mapping[str, str] | None = None  # message headers (trace context)


@dataclass(frozen=True)
class JobRecord:
    id: str
    type: str
    account_id: str
    params: dict[str, Any]
    idempotency_key: str | None
    state: JobState
    attempt: int
    max_attempts: int
    result_key: str | None
    result_meta: dict[str, Any] | None
    last_error: str | None
    quarantine_reason: str | None
    next_attempt_at: datetime | None
    lease_owner: str | None
    lease_expires_at: datetime | None
    progress_done: int | None
    progress_total: int | None
    created_at: datetime
    updated_at: datetime
    published: bool
    unpublished_since: datetime | None  # oldest outbox row of this job still waiting
    last_publish_error: str | None

    def view(self) -> JobView:
        return JobView(
            state=self.state,
            attempt=self.attempt,
            max_attempts=self.max_attempts,
            lease_owner=self.lease_owner,
            lease_expires_at=self.lease_expires_at,
            next_attempt_at=self.next_attempt_at,
            result_key=self.result_key,
        )


@dataclass(frozen=True)
class EventRecord:
    at: datetime
    kind: str
    detail: dict[str, Any]


@dataclass(frozen=True)
class OutboxRow:
    id: int
    job_id: str
    destination: str
    body: bytes
    headers: dict[str, Any]
    publish_attempts: int


@dataclass(frozen=True)
class TokenRecord:
    account_id: str | None
    is_admin: bool


class Store:
    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine
        self.is_postgres = engine.dialect.name == "postgresql"
        # In-process wake-ups for a relay in this same process (``jobrelay up``), set after
        # a commit that wrote outbox rows. PostgreSQL relays elsewhere get NOTIFY instead.
        self.outbox_listeners: list[asyncio.Event] = []
        # External effects of jobs (e-mails sent): a small module of its own, same database.
        self.effects = EffectsLedger(engine)

    def _wake_relays(self) -> None:
        for listener in self.outbox_listeners:
            listener.set()

    # --- plumbing ---------------------------------------------------------------------------

    def _write(self) -> contextlib.AbstractAsyncContextManager[AsyncConnection]:
        return write_tx(self.engine, "database")

    def _read(self) -> contextlib.AbstractAsyncContextManager[AsyncConnection]:
        return read_tx(self.engine, "database")

    def _insert(self, table: Any) -> Any:
        dialect = postgresql if self.is_postgres else sqlite
        return dialect.insert(table)

    async def _event(
        self, conn: AsyncConnection, job_id: str, kind: str, now: datetime, **detail: Any
    ) -> None:
        await conn.execute(
            insert(job_events).values(job_id=job_id, at=now, kind=kind, detail=_jsonable(detail))
        )

    async def _enqueue(
        self,
        conn: AsyncConnection,
        job_id: str,
        message: JobMessage,
        destination: str,
        now: datetime,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        if headers is None:
            # Retries, deferrals and repairs carry on the trace of the job's first message.
            first = await conn.scalar(
                select(outbox.c.headers)
                .where(outbox.c.job_id == job_id)
                .order_by(outbox.c.id)
                .limit(1)
            )
            trace = (first or {}).get("traceparent")
            headers = {"traceparent": trace} if isinstance(trace, str) else None
        await conn.execute(
            insert(outbox).values(
                job_id=job_id,
                destination=destination,
                body=message.encode().decode(),
                headers=dict(headers or {}),
                created_at=now,
            )
        )
        if self.is_postgres:
            # Delivered at commit, to listening relays only: a hint, never the only path.
            await conn.execute(text("SELECT pg_notify(:c, '')"), {"c": NOTIFY_CHANNEL})

    async def _transition(
        self,
        conn: AsyncConnection,
        job_id: str,
        target: JobState,
        now: datetime,
        *,
        sources: Iterable[JobState] | None = None,
        where: Sequence[Any] = (),
        **values: Any,
    ) -> bool:
        allowed = sorted(s.value for s in (sources if sources is not None else sources_for(target)))
        result = await conn.execute(
            update(jobs)
            .where(jobs.c.id == job_id, jobs.c.state.in_(allowed), *where)
            .values(state=target.value, updated_at=now, **values)
        )
        return bool(result.rowcount == 1)

    async def _insert_job(self, conn: AsyncConnection, job: NewJob, now: datetime) -> bool:
        """Insert a queued job unless its id exists; True when this call created it."""
        inserted = await conn.execute(
            self._insert(jobs)
            .values(
                id=job.job_id,
                type=job.type,
                account_id=job.account_id,
                params=job.params,
                idempotency_key=job.idempotency_key,
                request_hash=job.request_hash,
                state=JobState.QUEUED.value,
                attempt=0,
                max_attempts=job.max_attempts,
                created_at=now,
                updated_at=now,
            )
            .on_conflict_do_nothing(index_elements=[jobs.c.id])
        )
        return bool(inserted.rowcount == 1)

    async def ping(self) -> None:
        async with self._read() as conn:
            await conn.execute(text("SELECT 1"))

    # --- accept -----------------------------------------------------------------------------

    async def submit(self, job: NewJob, now: datetime) -> tuple[str, bool]:
        """Insert the job, its outbox row and its ``accepted`` event in ONE transaction.

        Returns ``(job_id, created)``. A repeat of the same request returns the existing id
        and writes nothing; the same idempotency key with another body raises.
        """
        async with self._write() as conn:
            if not await self._insert_job(conn, job, now):
                existing = (
                    await conn.execute(select(jobs.c.request_hash).where(jobs.c.id == job.job_id))
                ).scalar_one()
                if existing != job.request_hash:
                    raise IdempotencyConflict(
                        "this Idempotency-Key was already used with a different request body"
                    )
                return job.job_id, False
            message = JobMessage(job_id=job.job_id, type=job.type)
            headers = job.headers or {}  # a new job: no earlier message to inherit from
            await self._enqueue(conn, job.job_id, message, WORK_DESTINATION, now, headers)
            await self._event(conn, job.job_id, "accepted", now, type=job.type)
        self._wake_relays()
        return job.job_id, True

    # --- read -------------------------------------------------------------------------------

    def _job_query(self) -> Any:
        waiting = (
            select(
                func.min(outbox.c.created_at).label("unpublished_since"),
            )
            .where(outbox.c.job_id == jobs.c.id, outbox.c.published_at.is_(None))
            .scalar_subquery()
        )
        any_published = (
            select(func.count())
            .where(outbox.c.job_id == jobs.c.id, outbox.c.published_at.is_not(None))
            .scalar_subquery()
        )
        last_error = (
            select(outbox.c.last_error)
            .where(outbox.c.job_id == jobs.c.id, outbox.c.published_at.is_(None))
            .order_by(outbox.c.id.desc())
            .limit(1)
            .scalar_subquery()
        )
        return select(
            jobs,
            waiting.label("unpublished_since"),
            any_published.label("published_count"),
            last_error.label("last_publish_error"),
        )

    async def get_job(self, job_id: str) -> JobRecord | None:
        async with self._read() as conn:
            row = (await conn.execute(self._job_query().where(jobs.c.id == job_id))).first()
        return _job_record(row) if row is not None else None

    async def list_jobs(
        self, state: JobState | None = None, account_id: str | None = None, limit: int = 100
    ) -> list[JobRecord]:
        query = self._job_query().order_by(jobs.c.created_at.desc(), jobs.c.id).limit(limit)
        if state is not None:
            query = query.where(jobs.c.state == state.value)
        if account_id is not None:
            query = query.where(jobs.c.account_id == account_id)
        async with self._read() as conn:
            rows = (await conn.execute(query)).all()
        return [_job_record(r) for r in rows]

    async def events(self, job_id: str) -> list[EventRecord]:
        async with self._read() as conn:
            rows = (
                await conn.execute(
                    select(job_events.c.at, job_events.c.kind, job_events.c.detail)
                    .where(job_events.c.job_id == job_id)
                    .order_by(job_events.c.id)
                )
            ).all()
        return [EventRecord(at=r.at, kind=r.kind, detail=r.detail or {}) for r in rows]

    async def count_by_state(self) -> dict[str, int]:
        async with self._read() as conn:
            rows = (
                await conn.execute(select(jobs.c.state, func.count()).group_by(jobs.c.state))
            ).all()
        return {r[0]: int(r[1]) for r in rows}

    async def outbox_backlog(self) -> int:
        async with self._read() as conn:
            n = await conn.scalar(
                select(func.count()).select_from(outbox).where(outbox.c.published_at.is_(None))
            )
        return int(n or 0)

    # --- relay ------------------------------------------------------------------------------

    async def claim_outbox(
        self, relay_id: str, now: datetime, limit: int, claim_for: timedelta
    ) -> list[OutboxRow]:
        """Take up to ``limit`` waiting rows for ``claim_for``, in a short transaction.

        ``SKIP LOCKED`` lets several relays claim side by side; the claim itself is a column,
        so the relay can publish with no transaction open. Order is by id only as a fairness
        hint: a lower id may commit after a higher one, and is still found later because the
        filter is on per-row state, never on an id watermark.
        """
        async with self._write() as conn:
            rows = (
                await conn.execute(
                    select(outbox)
                    .where(
                        outbox.c.published_at.is_(None),
                        or_(outbox.c.claimed_until.is_(None), outbox.c.claimed_until < now),
                    )
                    .order_by(outbox.c.id)
                    .limit(limit)
                    .with_for_update(skip_locked=True)
                )
            ).all()
            if not rows:
                return []
            ids = [r.id for r in rows]
            await conn.execute(
                update(outbox)
                .where(outbox.c.id.in_(ids))
                .values(
                    claimed_by=relay_id,
                    claimed_until=now + claim_for,
                    publish_attempts=outbox.c.publish_attempts + 1,
                )
            )
        return [
            OutboxRow(
                id=r.id,
                job_id=r.job_id,
                destination=r.destination,
                body=r.body.encode(),
                headers=dict(r.headers or {}),
                publish_attempts=r.publish_attempts + 1,
            )
            for r in rows
        ]

    async def mark_published(self, relay_id: str, rows: Sequence[OutboxRow], now: datetime) -> int:
        """Set ``published_at`` for confirmed rows this relay still owns; one event each."""
        if not rows:
            return 0
        async with self._write() as conn:
            done = await conn.execute(
                update(outbox)
                .where(
                    outbox.c.id.in_([r.id for r in rows]),
                    outbox.c.published_at.is_(None),
                )
                .values(published_at=now, claimed_until=None, last_error=None)
                .returning(outbox.c.id, outbox.c.job_id, outbox.c.destination)
            )
            marked = done.all()
            if marked:
                await conn.execute(
                    insert(job_events),
                    [
                        {
                            "job_id": m.job_id,
                            "at": now,
                            "kind": "published",
                            "detail": {
                                "destination": m.destination,
                                "outboxId": m.id,
                                "relay": relay_id,
                            },
                        }
                        for m in marked
                    ],
                )
        return len(marked)

    async def release_outbox(self, row: OutboxRow, error: str, retry_at: datetime) -> None:
        """A publish failed (nack, return, timeout): keep the row waiting, record why.

        The row stays claimed until ``retry_at`` so an unroutable row backs off instead of
        being retried in a hot loop.
        """
        async with self._write() as conn:
            await conn.execute(
                update(outbox)
                .where(outbox.c.id == row.id, outbox.c.published_at.is_(None))
                .values(claimed_until=retry_at, claimed_by=None, last_error=error[:2000])
            )

    # --- worker -----------------------------------------------------------------------------

    async def claim_job(
        self, job_id: str, worker_id: str, now: datetime, lease: timedelta, **detail: Any
    ) -> int | None:
        """attempt += 1 and take the lease, before any work; returns the attempt, or None.

        Guarded on every condition the policy checked, so a racing worker or a retry that is
        not yet due loses here instead of running twice.
        """
        async with self._write() as conn:
            won = await self._transition(
                conn,
                job_id,
                JobState.RUNNING,
                now,
                where=[
                    jobs.c.attempt < jobs.c.max_attempts,
                    or_(
                        jobs.c.state == JobState.QUEUED.value,
                        and_(
                            jobs.c.state == JobState.RETRY_WAIT.value,
                            or_(
                                jobs.c.next_attempt_at.is_(None),
                                jobs.c.next_attempt_at <= now + RETRY_SLACK,
                            ),
                        ),
                        and_(
                            jobs.c.state == JobState.RUNNING.value,
                            or_(jobs.c.lease_expires_at.is_(None), jobs.c.lease_expires_at <= now),
                        ),
                    ),
                ],
                attempt=jobs.c.attempt + 1,
                lease_owner=worker_id,
                lease_expires_at=now + lease,
                next_attempt_at=None,
                progress_done=None,
                progress_total=None,
            )
            if not won:
                return None
            attempt = int(
                (await conn.execute(select(jobs.c.attempt).where(jobs.c.id == job_id))).scalar_one()
            )
            await self._event(
                conn, job_id, "claimed", now, worker=worker_id, attempt=attempt, **detail
            )
        return attempt

    def _held_by(self, worker_id: str) -> list[Any]:
        return [jobs.c.lease_owner == worker_id]

    async def renew_lease(
        self, job_id: str, worker_id: str, until: datetime, now: datetime
    ) -> bool:
        async with self._write() as conn:
            result = await conn.execute(
                update(jobs)
                .where(
                    jobs.c.id == job_id,
                    jobs.c.state == JobState.RUNNING.value,
                    *self._held_by(worker_id),
                )
                .values(lease_expires_at=until, updated_at=now)
            )
        return bool(result.rowcount == 1)

    async def report_progress(
        self, job_id: str, worker_id: str, done: int, total: int, now: datetime
    ) -> None:
        async with self._write() as conn:
            await conn.execute(
                update(jobs)
                .where(
                    jobs.c.id == job_id,
                    jobs.c.state == JobState.RUNNING.value,
                    *self._held_by(worker_id),
                )
                .values(progress_done=done, progress_total=total, updated_at=now)
            )

    async def complete(
        self,
        job_id: str,
        worker_id: str,
        result_key: str,
        result_meta: dict[str, Any],
        now: datetime,
        follow_ups: Sequence[NewJob] = (),
    ) -> bool:
        """running -> succeeded with its result key, BEFORE the delivery is acked.

        ``follow_ups`` (a notification of this success) are created in the SAME transaction,
        each with its outbox row and ``accepted`` event: no success without its follow-up,
        and, their ids being derived from this job's, never a second one.
        """
        async with self._write() as conn:
            won = await self._transition(
                conn,
                job_id,
                JobState.SUCCEEDED,
                now,
                where=self._held_by(worker_id),
                result_key=result_key,
                result_meta=result_meta,
                lease_owner=None,
                lease_expires_at=None,
                last_error=None,
                progress_done=result_meta.get("rows"),
                progress_total=result_meta.get("rows"),
            )
            if won:
                await self._event(
                    conn,
                    job_id,
                    "result_saved",
                    now,
                    resultKey=result_key,
                    worker=worker_id,
                    **result_meta,
                )
                for follow_up in follow_ups:
                    await self._add_follow_up(conn, job_id, follow_up, now)
        if won and follow_ups:
            self._wake_relays()
        return won

    async def _add_follow_up(
        self, conn: AsyncConnection, parent_id: str, job: NewJob, now: datetime
    ) -> None:
        if not await self._insert_job(conn, job, now):
            return  # created by an earlier success of the same parent
        message = JobMessage(job_id=job.job_id, type=job.type)
        await self._enqueue(conn, job.job_id, message, WORK_DESTINATION, now, job.headers or {})
        await self._event(conn, job.job_id, "accepted", now, type=job.type, parentJobId=parent_id)
        await self._event(
            conn, parent_id, "follow_up_accepted", now, jobId=job.job_id, type=job.type
        )

    async def schedule_retry(
        self,
        job_id: str,
        worker_id: str,
        job_type: str,
        error: str,
        delay: int,
        now: datetime,
    ) -> bool:
        """running -> retry_wait, and the retry message into the outbox, in one transaction."""
        due = now + timedelta(seconds=delay)
        async with self._write() as conn:
            won = await self._transition(
                conn,
                job_id,
                JobState.RETRY_WAIT,
                now,
                where=self._held_by(worker_id),
                last_error=error[:4000],
                next_attempt_at=due,
                lease_owner=None,
                lease_expires_at=None,
            )
            if won:
                await self._enqueue(
                    conn, job_id, JobMessage(job_id, job_type), retry_destination(delay), now
                )
                await self._event(
                    conn,
                    job_id,
                    "retry_scheduled",
                    now,
                    error=error,
                    delaySeconds=delay,
                    nextAttemptAt=due,
                )
        if won:
            self._wake_relays()
        return won

    async def quarantine(
        self,
        job_id: str,
        reason: str,
        now: datetime,
        *,
        worker_id: str | None = None,
        **detail: Any,
    ) -> bool:
        """-> quarantined with the reason kept. With ``worker_id`` only while it holds the lease."""
        async with self._write() as conn:
            won = await self._transition(
                conn,
                job_id,
                JobState.QUARANTINED,
                now,
                where=self._held_by(worker_id) if worker_id else (),
                quarantine_reason=reason[:4000],
                last_error=reason[:4000],
                lease_owner=None,
                lease_expires_at=None,
                next_attempt_at=None,
            )
            if won:
                await self._event(conn, job_id, "quarantined", now, reason=reason, **detail)
        return won

    async def defer(
        self, job_id: str, job_type: str, delay: int, reason: str, now: datetime
    ) -> None:
        """Re-check a job later through the delay route: an outbox row, no state change."""
        async with self._write() as conn:
            await self._enqueue(
                conn, job_id, JobMessage(job_id, job_type), retry_destination(delay), now
            )
            await self._event(conn, job_id, "deferred", now, reason=reason, delaySeconds=delay)
        self._wake_relays()

    async def record_event(self, job_id: str, kind: str, now: datetime, **detail: Any) -> None:
        """An event with no state change (ack_sent, duplicate_acked); ignored for unknown jobs."""
        async with self._write() as conn:
            exists = await conn.scalar(select(jobs.c.id).where(jobs.c.id == job_id))
            if exists is not None:
                await self._event(conn, job_id, kind, now, **detail)

    # --- tokens -----------------------------------------------------------------------------

    async def add_token(
        self,
        token_hash: str,
        account_id: str | None,
        is_admin: bool,
        now: datetime,
        label: str | None = None,
    ) -> None:
        async with self._write() as conn:
            await conn.execute(
                insert(api_tokens).values(
                    token_hash=token_hash,
                    account_id=account_id,
                    is_admin=is_admin,
                    label=label,
                    created_at=now,
                )
            )

    async def find_token(self, token_hash: str) -> TokenRecord | None:
        async with self._read() as conn:
            row = (
                await conn.execute(
                    select(api_tokens.c.account_id, api_tokens.c.is_admin).where(
                        api_tokens.c.token_hash == token_hash
                    )
                )
            ).first()
        return TokenRecord(row.account_id, bool(row.is_admin)) if row else None

    # --- ledger (read by report.export, written by seed) ------------------------------------

    async def ledger_count(self, account_id: str, period: str) -> int:
        async with self._read() as conn:
            n = await conn.scalar(
                select(func.count())
                .select_from(ledger_entries)
                .where(ledger_entries.c.account_id == account_id, ledger_entries.c.period == period)
            )
        return int(n or 0)

    async def stream_ledger(
        self, account_id: str, period: str, batch: int = 1000
    ) -> AsyncIterator[Row[Any, Any, Any, Any, Any, Any]]:
        """Rows of one account and month, in id order, through a server-side cursor."""
        query = (
            select(
                ledger_entries.c.id,
                ledger_entries.c.booked_on,
                ledger_entries.c.description,
                ledger_entries.c.counterparty,
                ledger_entries.c.amount,
                ledger_entries.c.currency,
            )
            .where(ledger_entries.c.account_id == account_id, ledger_entries.c.period == period)
            .order_by(ledger_entries.c.id)
            .execution_options(yield_per=batch)
        )
        try:
            async with self.engine.connect() as conn:
                await conn.execution_options(**{READ_ONLY_OPTION: True})
                async with conn.begin():
                    result = await conn.stream(query)
                    async for row in result:
                        yield row
        except (DBAPIError, OSError) as exc:
            raise StoreError(f"ledger read failed: {first_line(exc)}") from exc

    async def replace_ledger(self, account_id: str, rows: Sequence[dict[str, Any]]) -> None:
        async with self._write() as conn:
            await conn.execute(
                delete(ledger_entries).where(ledger_entries.c.account_id == account_id)
            )
            for start in range(0, len(rows), 5000):
                await conn.execute(insert(ledger_entries), list(rows[start : start + 5000]))


def _job_record(row: Row[Any]) -> JobRecord:
    m = row._mapping
    return JobRecord(
        id=m["id"],
        type=m["type"],
        account_id=m["account_id"],
        params=m["params"] or {},
        idempotency_key=m["idempotency_key"],
        state=JobState(m["state"]),
        attempt=m["attempt"],
        max_attempts=m["max_attempts"],
        result_key=m["result_key"],
        result_meta=m["result_meta"],
        last_error=m["last_error"],
        quarantine_reason=m["quarantine_reason"],
        next_attempt_at=m["next_attempt_at"],
        lease_owner=m["lease_owner"],
        lease_expires_at=m["lease_expires_at"],
        progress_done=m["progress_done"],
        progress_total=m["progress_total"],
        created_at=m["created_at"],
        updated_at=m["updated_at"],
        published=m["unpublished_since"] is None and (m["published_count"] or 0) > 0,
        unpublished_since=_aware(m["unpublished_since"]),
        last_publish_error=m["last_publish_error"],
    )


def _aware(value: Any) -> datetime | None:
    # Aggregates (min) bypass the column type on SQLite and come back as text.
    return UTCDateTime().process_result_value(value, None)  # type: ignore[arg-type]


def _jsonable(detail: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in detail.items():
        out[key] = value.isoformat() if isinstance(value, datetime) else value
    return out


__all__ = [
    "NOTIFY_CHANNEL",
    "WORK_DESTINATION",
    "EventRecord",
    "JobRecord",
    "NewJob",
    "OutboxRow",
    "Store",
    "TokenRecord",
    "retry_destination",
]
