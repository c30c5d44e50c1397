"""The SQL behind operator actions and the reconciler, each a named method on ``AdminQueries``.

The same rules as ``Store`` (whose transaction helpers this reuses): every state change is a
guarded ``UPDATE … WHERE state IN (:legal sources)`` from ``domain.states`` (``by="operator"``
for replay and cancel), writes its event in the same transaction, and a message it needs is
an outbox row in that same transaction. A repair or an action that loses its guard changes
nothing and says so; a finished job is never overwritten.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import exists, func, or_, select, update

from jobrelay.domain.messages import JobMessage
from jobrelay.domain.states import JobState, sources_for
from jobrelay.storage.records import work_destination
from jobrelay.storage.store import JobRecord, Store, aware_time, job_record
from jobrelay.storage.tables import api_tokens, job_events, jobs, local_messages, outbox

OPERATOR = "operator"
RECONCILED_LEASE = "reconciled_lease_expired"
RECONCILED_RETRY = "reconciled_retry_overdue"
RECONCILED_QUEUED = "reconciled_queued_unclaimed"


@dataclass(frozen=True)
class ActionOutcome:
    """What an operator action did: ``done``, or why not (``state`` is the job's state then)."""

    job_id: str
    done: bool
    state: JobState | None  # None: no such job
    previous_state: JobState | None = None


@dataclass(frozen=True)
class WaitingJob:
    job: JobRecord
    requeued_before: bool  # the reconciler already re-sent its message once in this wait
    confirmed_at: datetime | None = None  # when the broker confirmed its newest message


@dataclass(frozen=True)
class StaleOutboxRow:
    id: int
    job_id: str
    job_state: JobState
    destination: str
    created_at: datetime
    publish_attempts: int
    last_error: str | None
    claimed_by: str | None


@dataclass(frozen=True)
class QueuedMessage:
    headers: dict[str, Any]
    body: bytes


class AdminQueries:
    def __init__(self, store: Store) -> None:
        self.store = store

    # --- operator actions -----------------------------------------------------------------

    async def replay(
        self,
        job_id: str,
        *,
        actor: str,
        reason: str,
        budget: int,
        now: datetime,
        headers: dict[str, str] | None = None,
    ) -> ActionOutcome:
        """quarantined -> queued with ``budget`` more attempts, and a new work message.

        ``attempt`` keeps counting (attempt 3 is still attempt 3 in the timeline); the budget
        becomes ``attempt + budget``.
        """
        store = self.store
        async with store.writing() as conn:
            row = (
                await conn.execute(
                    select(
                        jobs.c.state,
                        jobs.c.type,
                        jobs.c.queue,
                        jobs.c.attempt,
                        jobs.c.quarantine_reason,
                    )
                    .where(jobs.c.id == job_id)
                    .with_for_update()
                )
            ).first()
            if row is None:
                return ActionOutcome(job_id, False, None)
            state = JobState(row.state)
            won = await store.transition(
                conn,
                job_id,
                JobState.QUEUED,
                now,
                sources=sources_for(JobState.QUEUED, by=OPERATOR),
                max_attempts=jobs.c.attempt + budget,
                quarantine_reason=None,
                next_attempt_at=None,
                lease_owner=None,
                lease_expires_at=None,
                progress_done=None,
                progress_total=None,
            )
            if not won:
                return ActionOutcome(job_id, False, state)
            await store.add_message(
                conn,
                job_id,
                JobMessage(job_id, row.type),
                work_destination(row.queue),
                now,
                headers,
            )
            await store.add_event(
                conn,
                job_id,
                "replayed",
                now,
                actor=actor,
                reason=reason,
                previousReason=row.quarantine_reason,
                attempt=row.attempt,
                maxAttempts=row.attempt + budget,
            )
        store.wake_relays()
        return ActionOutcome(job_id, True, JobState.QUEUED, state)

    async def cancel(self, job_id: str, *, actor: str, reason: str, now: datetime) -> ActionOutcome:
        """queued | retry_wait | quarantined -> cancelled; later deliveries are acked unworked."""
        store = self.store
        async with store.writing() as conn:
            current = await conn.scalar(
                select(jobs.c.state).where(jobs.c.id == job_id).with_for_update()
            )
            if current is None:
                return ActionOutcome(job_id, False, None)
            state = JobState(current)
            won = await store.transition(
                conn,
                job_id,
                JobState.CANCELLED,
                now,
                sources=sources_for(JobState.CANCELLED, by=OPERATOR),
                next_attempt_at=None,
                lease_owner=None,
                lease_expires_at=None,
            )
            if not won:
                return ActionOutcome(job_id, False, state)
            await store.add_event(
                conn,
                job_id,
                "cancelled",
                now,
                actor=actor,
                reason=reason,
                previousState=state.value,
            )
        return ActionOutcome(job_id, True, JobState.CANCELLED, state)

    async def find_jobs(
        self,
        *,
        state: JobState | None = None,
        reason: str | None = None,
        job_type: str | None = None,
        account_id: str | None = None,
        limit: int = 100,
    ) -> list[JobRecord]:
        """Newest first. ``reason`` matches part of the quarantine reason or the last error,
        ignoring case."""
        query = self.store.job_query().order_by(jobs.c.created_at.desc(), jobs.c.id).limit(limit)
        if state is not None:
            query = query.where(jobs.c.state == state.value)
        if job_type is not None:
            query = query.where(jobs.c.type == job_type)
        if account_id is not None:
            query = query.where(jobs.c.account_id == account_id)
        if reason:
            text = reason.lower()
            query = query.where(
                func.lower(func.coalesce(jobs.c.quarantine_reason, jobs.c.last_error, "")).contains(
                    text, autoescape=True
                )
            )
        async with self.store.reading() as conn:
            rows = (await conn.execute(query)).all()
        return [job_record(r) for r in rows]

    async def trace_id(self, job_id: str) -> str | None:
        """The trace id of the job's first message (from the HTTP request's traceparent)."""
        from jobrelay.observe.logs import trace_id

        async with self.store.reading() as conn:
            headers = await conn.scalar(
                select(outbox.c.headers)
                .where(outbox.c.job_id == job_id)
                .order_by(outbox.c.id)
                .limit(1)
            )
        return trace_id((headers or {}).get("traceparent"))

    async def token_identity(self, token_hash: str) -> tuple[int, str | None] | None:
        """A valid token's row id and label, to name who did an operator action (never the
        token). Read on every admin action, past the token cache: a revoked or expired admin
        token can no longer act from the moment it is revoked."""
        async with self.store.reading() as conn:
            row = (
                await conn.execute(
                    select(api_tokens.c.id, api_tokens.c.label).where(
                        api_tokens.c.token_hash == token_hash,
                        api_tokens.c.revoked_at.is_(None),
                        or_(
                            api_tokens.c.expires_at.is_(None),
                            api_tokens.c.expires_at > self.store.now_sql(),
                        ),
                    )
                )
            ).first()
        return (int(row.id), row.label) if row is not None else None

    async def states_of(self, job_ids: Iterable[str]) -> dict[str, JobState]:
        ids = sorted(set(job_ids))
        out: dict[str, JobState] = {}
        async with self.store.reading() as conn:
            for start in range(0, len(ids), 500):
                rows = await conn.execute(
                    select(jobs.c.id, jobs.c.state).where(jobs.c.id.in_(ids[start : start + 500]))
                )
                out.update({r.id: JobState(r.state) for r in rows})
        return out

    # --- metrics --------------------------------------------------------------------------

    async def outbox_stats(self) -> tuple[int, datetime | None]:
        """How many outbox rows wait, and when the oldest of them was written."""
        async with self.store.reading() as conn:
            row = (
                await conn.execute(
                    select(func.count(), func.min(outbox.c.created_at)).where(
                        outbox.c.published_at.is_(None)
                    )
                )
            ).one()
        return int(row[0] or 0), aware_time(row[1])

    # --- reconciler: find -----------------------------------------------------------------

    async def expired_leases(self, before: datetime, limit: int) -> list[JobRecord]:
        """Jobs ``running`` whose lease ran out before ``before`` (its worker is presumed dead)."""
        query = (
            self.store.job_query()
            .where(jobs.c.state == JobState.RUNNING.value, jobs.c.lease_expires_at < before)
            .order_by(jobs.c.lease_expires_at)
            .limit(limit)
        )
        async with self.store.reading() as conn:
            rows = (await conn.execute(query)).all()
        return [job_record(r) for r in rows]

    async def overdue_retries(self, before: datetime, limit: int) -> list[WaitingJob]:
        """Jobs in ``retry_wait`` due before ``before`` with no message waiting in the outbox."""
        query = (
            self.store.job_query()
            .add_columns(_requeued_this_wait(RECONCILED_RETRY).label("requeued_before"))
            .where(
                jobs.c.state == JobState.RETRY_WAIT.value,
                jobs.c.next_attempt_at < before,
                ~_unpublished_row(),
            )
            .order_by(jobs.c.next_attempt_at)
            .limit(limit)
        )
        async with self.store.reading() as conn:
            rows = (await conn.execute(query)).all()
        return [WaitingJob(job_record(r), bool(r.requeued_before)) for r in rows]

    async def unclaimed_queued(self, before: datetime, limit: int) -> list[WaitingJob]:
        """Jobs ``queued`` and unchanged since before ``before`` (never claimed in this wait),
        with no message waiting in the outbox and the newest one confirmed before ``before``.

        Either the broker no longer has the message (dead-lettered by its delivery limit after
        repeated returns, or purged), or a worker holds it unclaimed (busy, prefetched), or it
        still waits behind a backlog that took longer than that to drain. How deep the work
        queue is does not decide: a lost message must be found on a busy system too.
        """
        confirmed = (
            select(func.max(outbox.c.published_at))
            .where(outbox.c.job_id == jobs.c.id)
            .scalar_subquery()
        )
        query = (
            self.store.job_query()
            .add_columns(
                _requeued_this_wait(RECONCILED_QUEUED).label("requeued_before"),
                confirmed.label("confirmed_at"),
            )
            .where(
                jobs.c.state == JobState.QUEUED.value,
                jobs.c.updated_at < before,
                ~_unpublished_row(),
                ~exists().where(outbox.c.job_id == jobs.c.id, outbox.c.published_at >= before),
            )
            .order_by(jobs.c.updated_at)
            .limit(limit)
        )
        async with self.store.reading() as conn:
            rows = (await conn.execute(query)).all()
        return [
            WaitingJob(job_record(r), bool(r.requeued_before), aware_time(r.confirmed_at))
            for r in rows
        ]

    async def stale_outbox(self, before: datetime, limit: int) -> list[StaleOutboxRow]:
        """Outbox rows written before ``before`` and still not confirmed by a broker."""
        query = (
            select(outbox, jobs.c.state.label("job_state"))
            .join(jobs, jobs.c.id == outbox.c.job_id)
            .where(outbox.c.published_at.is_(None), outbox.c.created_at < before)
            .order_by(outbox.c.id)
            .limit(limit)
        )
        async with self.store.reading() as conn:
            rows = (await conn.execute(query)).all()
        return [
            StaleOutboxRow(
                id=r.id,
                job_id=r.job_id,
                job_state=JobState(r.job_state),
                destination=r.destination,
                created_at=r.created_at,
                publish_attempts=r.publish_attempts,
                last_error=r.last_error,
                claimed_by=r.claimed_by,
            )
            for r in rows
        ]

    async def local_queue_messages(self, queue: str, limit: int) -> list[QueuedMessage]:
        """Messages in one queue of the database-backed local transport (read only)."""
        query = (
            select(local_messages.c.headers, local_messages.c.body)
            .where(local_messages.c.queue == queue)
            .order_by(local_messages.c.id)
            .limit(limit)
        )
        async with self.store.reading() as conn:
            rows = (await conn.execute(query)).all()
        return [QueuedMessage(dict(r.headers or {}), str(r.body).encode()) for r in rows]

    # --- reconciler: repair ---------------------------------------------------------------

    async def requeue_expired_lease(
        self, job_id: str, owner: str | None, before: datetime, now: datetime, actor: str
    ) -> bool:
        """running (lease expired before ``before``, same owner) -> retry_wait, due now, with a
        work message. The next delivery claims it, or quarantines it if no attempt is left."""
        store = self.store
        async with store.writing() as conn:
            row = (
                await conn.execute(
                    select(
                        jobs.c.type, jobs.c.queue, jobs.c.attempt, jobs.c.lease_expires_at
                    ).where(jobs.c.id == job_id)
                )
            ).first()
            if row is None:
                return False
            owner_guard = (
                jobs.c.lease_owner.is_(None) if owner is None else jobs.c.lease_owner == owner
            )
            won = await store.transition(
                conn,
                job_id,
                JobState.RETRY_WAIT,
                now,
                where=[owner_guard, jobs.c.lease_expires_at < before],
                lease_owner=None,
                lease_expires_at=None,
                next_attempt_at=now,
                last_error=f"lease of {owner} expired: the worker was presumed lost",
            )
            if not won:
                return False
            await store.add_message(
                conn, job_id, JobMessage(job_id, row.type), work_destination(row.queue), now
            )
            await store.add_event(
                conn,
                job_id,
                RECONCILED_LEASE,
                now,
                actor=actor,
                worker=owner,
                leaseExpiredAt=row.lease_expires_at,
                attempt=row.attempt,
            )
        store.wake_relays()
        return True

    async def requeue_overdue_retry(
        self, job_id: str, before: datetime, now: datetime, actor: str
    ) -> bool:
        """Re-send the retry of a ``retry_wait`` job that is overdue with no message waiting;
        at most once per wait (the guard looks for this repair since the job last changed)."""
        return await self._resend_once(
            job_id,
            JobState.RETRY_WAIT,
            jobs.c.next_attempt_at < before,
            RECONCILED_RETRY,
            now,
            actor,
            lambda row: {"nextAttemptAt": row.next_attempt_at, "attempt": row.attempt},
        )

    async def requeue_unclaimed(
        self, job_id: str, before: datetime, now: datetime, actor: str
    ) -> bool:
        """Re-send the work message of a job ``queued`` and unclaimed since before ``before``,
        at most once while it stays queued. A surplus copy is harmless: the job's state
        decides, and the later copy is deferred or acked as a duplicate."""
        return await self._resend_once(
            job_id, JobState.QUEUED, jobs.c.updated_at < before, RECONCILED_QUEUED, now, actor
        )

    async def _resend_once(
        self,
        job_id: str,
        state: JobState,
        overdue: Any,
        kind: str,
        now: datetime,
        actor: str,
        detail: Callable[[Any], dict[str, Any]] = lambda _: {},
    ) -> bool:
        """A work message and a ``kind`` event for a job still in ``state`` and ``overdue``,
        with none waiting in the outbox and no ``kind`` repair since the job last changed."""
        store = self.store
        async with store.writing() as conn:
            row = (
                await conn.execute(
                    select(jobs.c.type, jobs.c.queue, jobs.c.attempt, jobs.c.next_attempt_at).where(
                        jobs.c.id == job_id
                    )
                )
            ).first()
            if row is None:
                return False
            result = await conn.execute(
                update(jobs)
                .where(
                    jobs.c.id == job_id,
                    jobs.c.state == state.value,
                    overdue,
                    ~_unpublished_row(),
                    ~_requeued_this_wait(kind),
                )
                .values(updated_at=now)
            )
            if result.rowcount != 1:
                return False
            await store.add_message(
                conn, job_id, JobMessage(job_id, row.type), work_destination(row.queue), now
            )
            await store.add_event(conn, job_id, kind, now, actor=actor, **detail(row))
        store.wake_relays()
        return True


def _unpublished_row() -> Any:
    return exists().where(outbox.c.job_id == jobs.c.id, outbox.c.published_at.is_(None))


def _requeued_this_wait(kind: str) -> Any:
    return exists().where(
        job_events.c.job_id == jobs.c.id,
        job_events.c.kind == kind,
        job_events.c.at >= jobs.c.updated_at,
    )


__all__ = [
    "RECONCILED_LEASE",
    "RECONCILED_QUEUED",
    "RECONCILED_RETRY",
    "ActionOutcome",
    "AdminQueries",
    "QueuedMessage",
    "StaleOutboxRow",
    "WaitingJob",
]
