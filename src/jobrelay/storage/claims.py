"""The worker's writes: a claim, and every write fenced on it.

A claim increments ``attempt`` and takes a lease, judged by the store's clock; the attempt
is the claim's token. Renewal, progress, completion (with the publication of its staged
result and its follow-up jobs), retry and the worker's quarantine are each one guarded
statement on that token; a delivery-time quarantine is guarded on what the policy saw.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import (
    ColumnElement,
    and_,
    func,
    not_,
    or_,
    select,
    update,
)
from sqlalchemy.dialects import postgresql
from sqlalchemy.engine import Dialect
from sqlalchemy.ext.asyncio import AsyncConnection

from jobrelay.domain.disclosure import WORKER_LOST, public_detail
from jobrelay.domain.messages import JobMessage
from jobrelay.domain.policy import RETRY_SLACK, JobView
from jobrelay.domain.queues import DEFAULT_QUEUE
from jobrelay.domain.states import JobState, sources_for
from jobrelay.storage.base import StoreBase
from jobrelay.storage.records import (
    Claim,
    Fenced,
    NewJob,
    retry_destination,
    work_destination,
)
from jobrelay.storage.storable import safe_text
from jobrelay.storage.tables import (
    job_events,
    jobs,
)


def holds(claim: Claim) -> list[Any]:
    """The claim holds the job: running, at its attempt, under its lease owner.

    What a lease renewal, a progress report and the end of a cancelled run are guarded on:
    they are no outcome of the work, so an operator's cancel request does not refuse them.
    """
    return [
        jobs.c.state == JobState.RUNNING.value,
        jobs.c.attempt == claim.attempt,
        jobs.c.lease_owner == claim.worker_id,
    ]


def fenced(claim: Claim) -> list[Any]:
    """The claim token: an outcome of this run lands only while this claim holds the job
    and no operator has asked to cancel it (``storage.cancels``).

    The one statement of the fence: the SQLAlchemy path uses it with values, the batched
    statements (``batches``, run on SQLAlchemy or raw asyncpg) with their arrays' columns.
    A run that finishes after a cancel was requested therefore cannot become ``succeeded``
    (nor ``retry_wait``): its worker ends the job ``cancelled`` instead (``end_cancelled``).
    """
    return [*holds(claim), jobs.c.cancel_requested_at.is_(None)]


def lease_expired(now: ColumnElement[datetime]) -> ColumnElement[bool]:
    """The job's lease has ended by the clock ``now`` (or it has none): whoever held it is
    presumed lost. A claim takes such a job over; the reconciler ends an abandoned cancel."""
    return or_(jobs.c.lease_expires_at.is_(None), jobs.c.lease_expires_at <= now)


def claimable(now: ColumnElement[datetime], due_by: ColumnElement[datetime]) -> list[Any]:
    """Exactly the policy's ``ReadyToRun``, judged by the clock ``now``.

    Not finished, not held by a live lease, not a retry before it is due (``due_by``: ``now``
    plus the policy's slack), attempts left: a claim guarded on this needs no earlier read of
    the job to be right. The one statement of it, as for ``fenced``.
    """
    return [
        StoreBase.state_in(sources_for(JobState.RUNNING)),
        jobs.c.attempt < jobs.c.max_attempts,
        # A job an operator asked to cancel is never claimed again (the reconciler ends it).
        jobs.c.cancel_requested_at.is_(None),
        or_(
            jobs.c.state == JobState.QUEUED.value,
            and_(
                jobs.c.state == JobState.RETRY_WAIT.value,
                or_(jobs.c.next_attempt_at.is_(None), jobs.c.next_attempt_at <= due_by),
            ),
            and_(jobs.c.state == JobState.RUNNING.value, lease_expired(now)),
        ),
    ]


_LOST_PREFIX = f"{WORKER_LOST}:"


def suspect() -> ColumnElement[bool]:
    """The job's last attempt ended with its worker lost: it may be what killed the worker.

    Among claimable jobs: ``running`` (claimable only once its lease has expired, so its
    worker died or froze) or ``retry_wait`` after the reconciler ended such an attempt
    (``worker_lost``). A worker claims a suspect alone (``roles.isolation``), never in a
    batch beside healthy jobs, so a job that kills its worker takes no neighbour with it.
    """
    return or_(
        jobs.c.state == JobState.RUNNING.value,
        and_(
            jobs.c.state == JobState.RETRY_WAIT.value,
            # A prefix compared without LIKE (no ``%`` to escape in the statements' text), and
            # never NULL: ``NOT`` of an unknown would refuse every claim of such a row.
            func.coalesce(func.substr(jobs.c.public_error, 1, len(_LOST_PREFIX)), "")
            == _LOST_PREFIX,
        ),
    )


def claimable_delivered(now: ColumnElement[datetime], due_by: ColumnElement[datetime]) -> list[Any]:
    """``claimable`` for the claims a delivery makes without reading the job first (one by
    one or in a batch): never a suspect. A suspect loses there, is read, and is claimed by
    ``claim_job`` once its worker runs nothing else."""
    return [*claimable(now, due_by), not_(suspect())]


def guard_sql(guards: list[Any], dialect: Dialect | None = None) -> str:
    """Guards as SQL text (PostgreSQL's unless ``dialect``), for the statements written in
    SQL (``batches``, ``sqlite_batches``).

    The values (states) are inlined; column expressions (``literal_column``) stay as written,
    so a guard may name a CTE's columns and bind parameters (``:b_slack``).
    """
    dialect = dialect or postgresql.dialect()  # type: ignore[no-untyped-call]
    clause = and_(*guards).compile(dialect=dialect, compile_kwargs={"literal_binds": True})
    return str(clause)


class ClaimsStore(StoreBase):
    def fenced(self, claim: Claim) -> list[Any]:
        """The claim token: a write of this run lands only while this claim holds the job."""
        return fenced(claim)

    def as_seen(self, seen: JobView) -> list[Any]:
        """A guard equal to what the policy saw: the state, the attempt and the lease."""
        lease = seen.lease_expires_at
        return [
            jobs.c.state == seen.state.value,
            jobs.c.attempt == seen.attempt,
            jobs.c.lease_expires_at.is_(None)
            if lease is None
            else jobs.c.lease_expires_at == lease,
        ]

    async def current(self, conn: AsyncConnection, job_id: str) -> Fenced:
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
        guards = list(self.as_seen(seen)[:2]) if seen is not None else []
        async with self.writing() as conn:
            result = await conn.execute(
                update(jobs)
                .where(jobs.c.id == job_id, *self.claimable(), *guards)
                .values(**self.claim_values(worker_id, now, lease))
                .returning(jobs.c.attempt)
            )
            attempt = result.scalar_one_or_none()
            if attempt is None:
                return None
            await self.add_event(
                conn, job_id, "claimed", now, worker=worker_id, attempt=int(attempt), **detail
            )
        return Claim(job_id, int(attempt), worker_id)

    def claimable(self) -> list[Any]:
        """``claimable`` on the store's clock (the database's, or the one a test injects)."""
        return claimable(self.now_sql(), self.now_sql(RETRY_SLACK))

    def claimable_delivered(self) -> list[Any]:
        """``claimable_delivered`` on the store's clock."""
        return claimable_delivered(self.now_sql(), self.now_sql(RETRY_SLACK))

    def claim_values(self, worker_id: str, now: datetime, lease: timedelta) -> dict[str, Any]:
        return {
            "state": JobState.RUNNING.value,
            "updated_at": now,
            "attempt": jobs.c.attempt + 1,
            "lease_owner": worker_id,
            "lease_expires_at": self.now_sql(lease),
            "next_attempt_at": None,
            "progress_done": None,
            "progress_total": None,
        }

    async def renew_lease(self, claim: Claim, lease: timedelta, now: datetime) -> bool:
        """Extend the lease to the store's clock + ``lease``, only while the claim holds."""
        async with self.writing() as conn:
            result = await conn.execute(
                update(jobs)
                .where(jobs.c.id == claim.job_id, *holds(claim))
                .values(lease_expires_at=self.now_sql(lease), updated_at=now)
            )
        return bool(result.rowcount == 1)

    async def report_progress(self, claim: Claim, done: int, total: int, now: datetime) -> bool:
        async with self.writing() as conn:
            result = await conn.execute(
                update(jobs)
                .where(jobs.c.id == claim.job_id, *holds(claim))
                .values(progress_done=done, progress_total=total, updated_at=now)
            )
        return bool(result.rowcount == 1)

    async def add_follow_up(
        self, conn: AsyncConnection, parent_id: str, job: NewJob, now: datetime
    ) -> None:
        if not await self.insert_job(conn, job, now):
            return  # created by an earlier success of the same parent
        message = JobMessage(job_id=job.job_id, type=job.type)
        destination = job.destination or work_destination(job.queue)
        await self.add_message(conn, job.job_id, message, destination, now, job.headers or {})
        await self.add_event(
            conn, job.job_id, "accepted", now, type=job.type, parentJobId=parent_id
        )
        await self.add_event(
            conn, parent_id, "follow_up_accepted", now, jobId=job.job_id, type=job.type
        )

    async def schedule_retry(
        self,
        claim: Claim,
        job_type: str,
        error: str,
        delay: int,
        now: datetime,
        *,
        public: str | None = None,
        asked_delay: float | None = None,
        traceback: str | None = None,
    ) -> Fenced:
        """running -> retry_wait, and the retry message into the outbox, in one transaction.

        Fenced on the claim; the due time is the store's clock + ``delay``; ``asked_delay``
        (kept in the event) is what the job asked with ``Retry(delay=)``. ``public`` is the
        error as the job's account reads it (``domain.disclosure``); ``error`` the operators',
        and ``traceback`` where the run raised (``roles.failures``; None clears an earlier
        one). All are stored with their NUL bytes escaped (``storable``): they must not make
        the write fail.
        """
        error = safe_text(error)
        public = None if public is None else safe_text(public)
        async with self.writing() as conn:
            result = await conn.execute(
                update(jobs)
                .where(jobs.c.id == claim.job_id, *self.fenced(claim))
                .values(
                    state=JobState.RETRY_WAIT.value,
                    updated_at=now,
                    last_error=error[:4000],
                    public_error=public,
                    last_traceback=None if traceback is None else safe_text(traceback),
                    next_attempt_at=self.now_sql(timedelta(seconds=delay)),
                    lease_owner=None,
                    lease_expires_at=None,
                )
                .returning(jobs.c.next_attempt_at, jobs.c.queue)
            )
            row = result.first()
            if row is None:
                return await self.current(conn, claim.job_id)
            due = row.next_attempt_at
            await self.add_message(
                conn,
                claim.job_id,
                JobMessage(claim.job_id, job_type),
                retry_destination(delay, row.queue),
                now,
            )
            await self.add_event(
                conn,
                claim.job_id,
                "retry_scheduled",
                now,
                error=error,
                delaySeconds=delay,
                **({} if asked_delay is None else {"askedDelaySeconds": asked_delay}),
                nextAttemptAt=due,
                attempt=claim.attempt,
                worker=claim.worker_id,
                **public_detail(public),
            )
        self.wake_relays()
        return Fenced(True)

    async def quarantine(
        self,
        job_id: str,
        reason: str,
        now: datetime,
        *,
        claim: Claim | None = None,
        seen: JobView | None = None,
        public: str | None = None,
        traceback: str | None = None,
        **detail: Any,
    ) -> bool:
        """-> quarantined with the reason kept.

        With ``claim`` (the worker's own run failed for good) only while that claim holds;
        with ``seen`` (a delivery-time decision) only if the job is still exactly as the
        policy saw it: same state, same attempt, same lease. A bad copy read while the job
        was ``queued`` therefore never quarantines a job a good copy has claimed since.
        The reason is stored with its NUL bytes escaped (``storable``). A worker's quarantine
        (``claim``) also stores ``traceback``, where its run raised (None clears an earlier
        one); a delivery-time one ran nothing and keeps the last failure's.
        """
        reason = safe_text(reason)
        public = None if public is None else safe_text(public)
        where: list[Any] = []
        values: dict[str, Any] = {}
        if claim is not None:
            where += self.fenced(claim)
            detail = {**detail, "attempt": claim.attempt, "worker": claim.worker_id}
            values["last_traceback"] = None if traceback is None else safe_text(traceback)
        if seen is not None:
            where += self.as_seen(seen)
        async with self.writing() as conn:
            won = await self.transition(
                conn,
                job_id,
                JobState.QUARANTINED,
                now,
                where=where,
                quarantine_reason=reason[:4000],
                last_error=reason[:4000],
                public_error=public,
                lease_owner=None,
                lease_expires_at=None,
                next_attempt_at=None,
                **values,
            )
            if won:
                await self.add_event(
                    conn,
                    job_id,
                    "quarantined",
                    now,
                    reason=reason,
                    **detail,
                    **public_detail(public),
                )
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
        **detail: Any,
    ) -> None:
        """Re-check a job later through the delay route: an outbox row, no state change.

        ``message`` may be the raw body of a delivery this worker cannot read (a type or
        version only newer workers know): it is passed on unchanged, with ``headers`` added.
        ``detail``: more of the ``deferred`` event (who deferred it, which deferral).
        """
        async with self.writing() as conn:
            queue = await conn.scalar(select(jobs.c.queue).where(jobs.c.id == job_id))
            await self.add_message(
                conn,
                job_id,
                message,
                retry_destination(delay, queue or DEFAULT_QUEUE),
                now,
                extra_headers=headers,
            )
            await self.add_event(
                conn, job_id, "deferred", now, reason=reason, delaySeconds=delay, **detail
            )
        self.wake_relays()

    async def committed_by(self, claim: Claim, kind: str) -> bool:
        """Whether the job's timeline has a ``kind`` event written by this very claim.

        For a worker whose outcome commit may have landed while its answer was lost (the
        database went away mid-commit): only its own event proves the outcome is its own.
        """
        async with self.reading() as conn:
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
