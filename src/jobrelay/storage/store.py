"""The job store: every query jobrelay runs against its own tables, each a named method.

Rules every method keeps:
- A state change is a guarded ``UPDATE … WHERE state IN (:legal sources)``; the caller learns
  from the returned bool whether it won. Nobody overwrites a state they did not read.
- Each transition writes its ``job_events`` row in the same transaction.
- A message to send is an ``outbox`` row written in the same transaction as the state it
  belongs to; nothing here talks to the broker.
- Every write after a claim is fenced on the claim token: the job id, ``running`` and the
  attempt number the claim produced (each claim increments it, so it names one claim). A
  write that loses changes nothing and the caller records ``lease_lost``.
- What is *judged* by time (is a lease live, is a retry due, when does a new lease end) uses
  ONE clock, the store's: on PostgreSQL the database's own ``now()`` in SQL, on SQLite this
  process's clock (one process owns the file). No worker host's clock decides. Times that
  are only *recorded* (an event's ``at``) still come from the caller. Tests inject a clock
  into the store to move time.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import (
    ColumnElement,
    Row,
    and_,
    delete,
    func,
    insert,
    literal,
    or_,
    select,
    text,
    type_coerce,
    update,
)
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


Clock = Callable[[], datetime]


def _utc_now() -> datetime:
    return datetime.now(UTC)


@dataclass(frozen=True)
class Claim:
    """One claim of a job: the token every later write of that run is fenced on."""

    job_id: str
    attempt: int
    worker_id: str


@dataclass(frozen=True)
class Fenced:
    """What a fenced write found: ``won``, or the attempt that holds the job now."""

    won: bool
    current_attempt: int | None = None
    current_state: JobState | None = None


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
    # The store's clock when this row was read: what the policy judges leases and due times by.
    observed_at: datetime | None = None

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
    def __init__(self, engine: AsyncEngine, *, clock: Clock | None = None) -> None:
        self.engine = engine
        self.is_postgres = engine.dialect.name == "postgresql"
        # None: the database's clock on PostgreSQL, this process's on SQLite. Tests inject one.
        self._clock = clock
        # In-process wake-ups for a relay in this same process (``jobrelay up``), set after
        # a commit that wrote outbox rows. PostgreSQL relays elsewhere get NOTIFY instead.
        self.outbox_listeners: list[asyncio.Event] = []
        # External effects of jobs (e-mails sent): a small module of its own, same database.
        self.effects = EffectsLedger(engine)

    def _wake_relays(self) -> None:
        for listener in self.outbox_listeners:
            listener.set()

    # --- the one clock -----------------------------------------------------------------------

    def now_sql(self, plus: timedelta = timedelta(0)) -> ColumnElement[datetime]:
        """The store's clock (+ ``plus``) as a SQL expression, for guards and lease ends.

        On PostgreSQL it is ``now()`` evaluated by the server; elsewhere the value is computed
        here (SQLite has no interval arithmetic on the text it stores times as).
        """
        if self._clock is None and self.is_postgres:
            expr = func.now() if not plus else func.now() + plus
            return type_coerce(expr, UTCDateTime())
        return literal(self.local_now() + plus, UTCDateTime())

    def local_now(self) -> datetime:
        return self._clock() if self._clock is not None else _utc_now()

    async def db_now(self) -> datetime:
        """The store's clock as a value (one round trip on PostgreSQL, none on SQLite)."""
        if self._clock is None and self.is_postgres:
            async with self._read() as conn:
                value = await conn.scalar(select(self.now_sql()))
            assert isinstance(value, datetime)
            return value
        return self.local_now()

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
        message: JobMessage | bytes,
        destination: str,
        now: datetime,
        headers: Mapping[str, str] | None = None,
        *,
        extra_headers: Mapping[str, str] | None = None,
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
                body=(message if isinstance(message, bytes) else message.encode()).decode(),
                headers={**(headers or {}), **(extra_headers or {})},
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
            self.now_sql().label("observed_at"),
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
        self, relay_id: str, limit: int, claim_for: timedelta
    ) -> list[OutboxRow]:
        """Take up to ``limit`` waiting rows for ``claim_for``, in a short transaction.

        The claim is a lease too, judged and set by the store's clock, so a relay whose host
        clock runs ahead cannot take rows another relay still owns.

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
                        or_(
                            outbox.c.claimed_until.is_(None),
                            outbox.c.claimed_until < self.now_sql(),
                        ),
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
                    claimed_until=self.now_sql(claim_for),
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
                .values(published_at=self.now_sql(), claimed_until=None, last_error=None)
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

    async def release_outbox(self, row: OutboxRow, error: str, backoff: timedelta) -> None:
        """A publish failed (nack, return, timeout): keep the row waiting, record why.

        The row stays claimed for ``backoff`` (by the store's clock) so an unroutable row backs
        off instead of being retried in a hot loop.
        """
        async with self._write() as conn:
            await conn.execute(
                update(outbox)
                .where(outbox.c.id == row.id, outbox.c.published_at.is_(None))
                .values(
                    claimed_until=self.now_sql(backoff), claimed_by=None, last_error=error[:2000]
                )
            )

    # --- worker -----------------------------------------------------------------------------

    def _fenced(self, claim: Claim) -> list[Any]:
        """The claim token: a write of this run lands only while this claim holds the job."""
        return [
            jobs.c.state == JobState.RUNNING.value,
            jobs.c.attempt == claim.attempt,
            jobs.c.lease_owner == claim.worker_id,
        ]

    def _as_seen(self, seen: JobView) -> list[Any]:
        """A guard equal to what the policy saw: the state, the attempt and the lease."""
        lease = seen.lease_expires_at
        return [
            jobs.c.state == seen.state.value,
            jobs.c.attempt == seen.attempt,
            jobs.c.lease_expires_at.is_(None)
            if lease is None
            else jobs.c.lease_expires_at == lease,
        ]

    async def _current(self, conn: AsyncConnection, job_id: str) -> Fenced:
        row = (
            await conn.execute(select(jobs.c.state, jobs.c.attempt).where(jobs.c.id == job_id))
        ).first()
        if row is None:
            return Fenced(False)
        return Fenced(False, int(row.attempt), JobState(row.state))

    async def claim_job(
        self,
        job_id: str,
        worker_id: str,
        now: datetime,
        lease: timedelta,
        *,
        seen: JobView | None = None,
        **detail: Any,
    ) -> Claim | None:
        """attempt += 1 and take the lease, before any work; returns the claim, or None.

        Guarded on every condition the policy checked, judged by the store's clock, and (with
        ``seen``) on the state and attempt the policy read, so a racing copy or a retry that is
        not yet due loses here instead of running twice.
        """
        clock = self.now_sql()
        guards = list(self._as_seen(seen)[:2]) if seen is not None else []
        async with self._write() as conn:
            result = await conn.execute(
                update(jobs)
                .where(
                    jobs.c.id == job_id,
                    jobs.c.state.in_(sorted(s.value for s in sources_for(JobState.RUNNING))),
                    jobs.c.attempt < jobs.c.max_attempts,
                    or_(
                        jobs.c.state == JobState.QUEUED.value,
                        and_(
                            jobs.c.state == JobState.RETRY_WAIT.value,
                            or_(
                                jobs.c.next_attempt_at.is_(None),
                                jobs.c.next_attempt_at <= self.now_sql(RETRY_SLACK),
                            ),
                        ),
                        and_(
                            jobs.c.state == JobState.RUNNING.value,
                            or_(
                                jobs.c.lease_expires_at.is_(None),
                                jobs.c.lease_expires_at <= clock,
                            ),
                        ),
                    ),
                    *guards,
                )
                .values(
                    state=JobState.RUNNING.value,
                    updated_at=now,
                    attempt=jobs.c.attempt + 1,
                    lease_owner=worker_id,
                    lease_expires_at=self.now_sql(lease),
                    next_attempt_at=None,
                    progress_done=None,
                    progress_total=None,
                )
                .returning(jobs.c.attempt)
            )
            attempt = result.scalar_one_or_none()
            if attempt is None:
                return None
            await self._event(
                conn, job_id, "claimed", now, worker=worker_id, attempt=int(attempt), **detail
            )
        return Claim(job_id, int(attempt), worker_id)

    async def renew_lease(self, claim: Claim, lease: timedelta, now: datetime) -> bool:
        """Extend the lease to the store's clock + ``lease``, only while the claim holds."""
        async with self._write() as conn:
            result = await conn.execute(
                update(jobs)
                .where(jobs.c.id == claim.job_id, *self._fenced(claim))
                .values(lease_expires_at=self.now_sql(lease), updated_at=now)
            )
        return bool(result.rowcount == 1)

    async def report_progress(self, claim: Claim, done: int, total: int, now: datetime) -> bool:
        async with self._write() as conn:
            result = await conn.execute(
                update(jobs)
                .where(jobs.c.id == claim.job_id, *self._fenced(claim))
                .values(progress_done=done, progress_total=total, updated_at=now)
            )
        return bool(result.rowcount == 1)

    async def complete(
        self,
        claim: Claim,
        result_key: str,
        result_meta: dict[str, Any],
        now: datetime,
        follow_ups: Sequence[NewJob] = (),
        publish: Callable[[], Awaitable[None]] | None = None,
    ) -> Fenced:
        """running -> succeeded with its result key, BEFORE the delivery is acked.

        Fenced on the claim. ``publish`` makes the staged result visible under its key while
        the guarded UPDATE holds the job's row lock (PostgreSQL) or the write lock (SQLite),
        and before the commit: a stale attempt can never pass the guard, so it can never
        replace the object the winning attempt committed. A publish that fails rolls the
        whole completion back.

        ``follow_ups`` (a notification of this success) are created in the SAME transaction,
        each with its outbox row and ``accepted`` event: no success without its follow-up,
        and, their ids being derived from this job's, never a second one.
        """
        async with self._write() as conn:
            won = await self._transition(
                conn,
                claim.job_id,
                JobState.SUCCEEDED,
                now,
                where=self._fenced(claim),
                result_key=result_key,
                result_meta=result_meta,
                lease_owner=None,
                lease_expires_at=None,
                last_error=None,
                progress_done=result_meta.get("rows"),
                progress_total=result_meta.get("rows"),
            )
            if not won:
                return await self._current(conn, claim.job_id)
            if publish is not None:
                await publish()
            await self._event(
                conn,
                claim.job_id,
                "result_saved",
                now,
                resultKey=result_key,
                worker=claim.worker_id,
                **result_meta,
            )
            for follow_up in follow_ups:
                await self._add_follow_up(conn, claim.job_id, follow_up, now)
        if follow_ups:
            self._wake_relays()
        return Fenced(True)

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
        self, claim: Claim, job_type: str, error: str, delay: int, now: datetime
    ) -> Fenced:
        """running -> retry_wait, and the retry message into the outbox, in one transaction.

        Fenced on the claim; the due time is the store's clock + ``delay``.
        """
        async with self._write() as conn:
            result = await conn.execute(
                update(jobs)
                .where(jobs.c.id == claim.job_id, *self._fenced(claim))
                .values(
                    state=JobState.RETRY_WAIT.value,
                    updated_at=now,
                    last_error=error[:4000],
                    next_attempt_at=self.now_sql(timedelta(seconds=delay)),
                    lease_owner=None,
                    lease_expires_at=None,
                )
                .returning(jobs.c.next_attempt_at)
            )
            due = result.scalar_one_or_none()
            if due is None:
                return await self._current(conn, claim.job_id)
            await self._enqueue(
                conn,
                claim.job_id,
                JobMessage(claim.job_id, job_type),
                retry_destination(delay),
                now,
            )
            await self._event(
                conn,
                claim.job_id,
                "retry_scheduled",
                now,
                error=error,
                delaySeconds=delay,
                nextAttemptAt=due,
                attempt=claim.attempt,
                worker=claim.worker_id,
            )
        self._wake_relays()
        return Fenced(True)

    async def quarantine(
        self,
        job_id: str,
        reason: str,
        now: datetime,
        *,
        claim: Claim | None = None,
        seen: JobView | None = None,
        **detail: Any,
    ) -> bool:
        """-> quarantined with the reason kept.

        With ``claim`` (the worker's own run failed for good) only while that claim holds;
        with ``seen`` (a delivery-time decision) only if the job is still exactly as the
        policy saw it: same state, same attempt, same lease. A bad copy read while the job
        was ``queued`` therefore never quarantines a job a good copy has claimed since.
        """
        where: list[Any] = []
        if claim is not None:
            where += self._fenced(claim)
            detail = {**detail, "attempt": claim.attempt, "worker": claim.worker_id}
        if seen is not None:
            where += self._as_seen(seen)
        async with self._write() as conn:
            won = await self._transition(
                conn,
                job_id,
                JobState.QUARANTINED,
                now,
                where=where,
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
        self,
        job_id: str,
        message: JobMessage | bytes,
        delay: int,
        reason: str,
        now: datetime,
        *,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        """Re-check a job later through the delay route: an outbox row, no state change.

        ``message`` may be the raw body of a delivery this worker cannot read (a type or
        version only newer workers know): it is passed on unchanged, with ``headers`` added.
        """
        async with self._write() as conn:
            await self._enqueue(
                conn, job_id, message, retry_destination(delay), now, extra_headers=headers
            )
            await self._event(conn, job_id, "deferred", now, reason=reason, delaySeconds=delay)
        self._wake_relays()

    async def committed_by(self, claim: Claim, kind: str) -> bool:
        """Whether the job's timeline has a ``kind`` event written by this very claim.

        For a worker whose outcome commit may have landed while its answer was lost (the
        database went away mid-commit): only its own event proves the outcome is its own.
        """
        async with self._read() as conn:
            rows = await conn.scalars(
                select(job_events.c.detail).where(
                    job_events.c.job_id == claim.job_id, job_events.c.kind == kind
                )
            )
            details = list(rows)
        return any(
            (d or {}).get("attempt") == claim.attempt and (d or {}).get("worker") == claim.worker_id
            for d in details
        )

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
        observed_at=_aware(m.get("observed_at")),
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
    "Claim",
    "EventRecord",
    "Fenced",
    "JobRecord",
    "NewJob",
    "OutboxRow",
    "Store",
    "TokenRecord",
    "retry_destination",
]
