"""The SQL of the reconciler's repairs: find what is overdue, and put it back on its way.

The same rules as ``Store`` (whose transaction helpers this reuses) and the operator's
actions (``admin.py``): every repair is a guarded ``UPDATE … WHERE state = :seen AND …``
that writes its event in the same transaction, and a message it needs is an outbox row in
that same transaction. A repair that loses its guard changes nothing and says so; a finished
job is never overwritten.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import exists, func, or_, select, update

from jobrelay.domain.disclosure import WORKER_LOST, public_error
from jobrelay.domain.states import JobState
from jobrelay.storage.admin import ActionOutcome
from jobrelay.storage.delayed import due_since
from jobrelay.storage.port import StorePort
from jobrelay.storage.store import JobRecord, aware_time, job_record
from jobrelay.storage.tables import job_events, jobs, outbox
from jobrelay.storage.transitions import LEASE_EXPIRED, outbox_admissible, unfinished

RECONCILED_LEASE = "reconciled_lease_expired"  # LEASE_EXPIRED.event
RECONCILED_RETRY = "reconciled_retry_overdue"
RECONCILED_QUEUED = "reconciled_queued_unclaimed"
RESENT = "resent"  # an operator re-sent a queued job's message
# The events with which a job's wait in ``queued`` begins.
WAIT_BEGINS = ("accepted", "replayed")


@dataclass(frozen=True)
class WaitingJob:
    job: JobRecord
    requeued_before: bool  # the reconciler already re-sent its message once in this wait
    confirmed_at: datetime | None = None  # when the broker confirmed its newest message
    resends: int = 0  # how often the reconciler re-sent it in this wait (queued jobs)


@dataclass(frozen=True)
class StaleOutboxRow:
    id: int
    job_id: str
    job_state: JobState
    destination: str
    created_at: datetime  # since when it has been due (a delayed job's: its run time)
    publish_attempts: int
    last_error: str | None
    claimed_by: str | None


class RepairQueries:
    def __init__(self, store: StorePort) -> None:
        self.store = store

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

    # --- reconciler: find -----------------------------------------------------------------

    async def expired_leases(self, before: datetime, limit: int) -> list[JobRecord]:
        """Jobs ``running`` whose lease ran out before ``before`` (its worker is presumed dead)."""
        query = (
            self.store.job_query()
            # ``unfinished()``: read from the unfinished jobs' index (none holds ``state``).
            .where(
                jobs.c.state == JobState.RUNNING.value,
                jobs.c.lease_expires_at < before,
                unfinished(),
            )
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
                unfinished(),
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
        resends = _resends_this_wait()
        query = (
            self.store.job_query()
            .add_columns(
                (resends > 0).label("requeued_before"),
                confirmed.label("confirmed_at"),
                resends.label("resends"),
            )
            .where(
                jobs.c.state == JobState.QUEUED.value,
                jobs.c.updated_at < before,
                unfinished(),
                ~_unpublished_row(),
                ~exists().where(outbox.c.job_id == jobs.c.id, outbox.c.published_at >= before),
            )
            .order_by(jobs.c.updated_at)
            .limit(limit)
        )
        async with self.store.reading() as conn:
            rows = (await conn.execute(query)).all()
        return [
            WaitingJob(
                job_record(r),
                bool(r.requeued_before),
                aware_time(r.confirmed_at),
                int(r.resends or 0),
            )
            for r in rows
        ]

    async def stale_outbox(self, before: datetime, limit: int) -> list[StaleOutboxRow]:
        """Outbox rows due before ``before`` and still not confirmed by a broker: a delayed
        job's row counts from its run time, so one still held is never "stuck"."""
        query = (
            select(outbox, due_since().label("due_since"), jobs.c.state.label("job_state"))
            .join(jobs, jobs.c.id == outbox.c.job_id)
            # A row held for its job's limits is waiting its turn, not stuck (its
            # ``throttled`` event says why); one no admission has looked at (no relay
            # runs) is stuck as any unpublished row.
            .where(
                outbox.c.published_at.is_(None),
                due_since() < before,
                or_(outbox_admissible(), jobs.c.throttled_at.is_(None)),
            )
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
                created_at=aware_time(r.due_since) or r.created_at,
                publish_attempts=r.publish_attempts,
                last_error=r.last_error,
                claimed_by=r.claimed_by,
            )
            for r in rows
        ]

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
                LEASE_EXPIRED,
                now,
                where=[owner_guard, jobs.c.lease_expires_at < before],
                error=f"lease of {owner} expired: the worker was presumed lost",
                public=public_error(WORKER_LOST),
            )
            if not won:
                return False
            await store.next_message(conn, job_id, row.type, row.queue, now)
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
        """Re-send the work message of a job ``queued`` and unclaimed since before ``before``.

        As often as the reconciler finds it lost (it spaces the re-sends out); the guard
        only keeps two reconcilers from sending the same copy: the repair moves
        ``updated_at`` to ``now``. A surplus copy is harmless: the job's state decides, and
        the later copy is deferred or acked as a duplicate."""
        return await self._resend_once(
            job_id,
            JobState.QUEUED,
            jobs.c.updated_at < before,
            RECONCILED_QUEUED,
            now,
            actor,
            once=False,
        )

    async def resend_queued(
        self, job_id: str, *, actor: str, reason: str, now: datetime
    ) -> ActionOutcome:
        """An operator's re-send of a ``queued`` job's work message (an outbox row and a
        ``resent`` event in one transaction), whatever the reconciler's back-off says: a
        person decided. Refused (nothing written) for a job in any other state."""
        store = self.store
        async with store.writing() as conn:
            row = (
                await conn.execute(
                    select(
                        jobs.c.state,
                        jobs.c.type,
                        jobs.c.queue,
                        jobs.c.attempt,
                        jobs.c.run_at,
                        # Judged by the store's clock, the one the relay holds the row by.
                        (jobs.c.run_at > store.now_sql()).label("not_due"),
                    )
                    .where(jobs.c.id == job_id)
                    .with_for_update(key_share=True)  # as the relay's key shares allow
                )
            ).first()
            if row is None:
                return ActionOutcome(job_id, False, None)
            result = await conn.execute(
                update(jobs)
                .where(jobs.c.id == job_id, jobs.c.state == JobState.QUEUED.value)
                .values(updated_at=now)
            )
            if result.rowcount != 1:
                return ActionOutcome(job_id, False, JobState(row.state))
            # A delayed job re-sent before its time: the new message is held until then too.
            held = row.run_at if row.run_at is not None and row.not_due else None
            await store.next_message(conn, job_id, row.type, row.queue, now, available_at=held)
            await store.add_event(
                conn, job_id, RESENT, now, actor=actor, reason=reason, queue=row.queue
            )
        store.wake_relays()
        return ActionOutcome(job_id, True, JobState.QUEUED, JobState.QUEUED)

    async def _resend_once(
        self,
        job_id: str,
        state: JobState,
        overdue: Any,
        kind: str,
        now: datetime,
        actor: str,
        detail: Callable[[Any], dict[str, Any]] = lambda _: {},
        *,
        once: bool = True,
    ) -> bool:
        """A work message and a ``kind`` event for a job still in ``state`` and ``overdue``,
        with none waiting in the outbox and (``once``) no ``kind`` repair since the job last
        changed."""
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
                    *([~_requeued_this_wait(kind)] if once else []),
                )
                .values(updated_at=now)
            )
            if result.rowcount != 1:
                return False
            await store.next_message(conn, job_id, row.type, row.queue, now)
            await store.add_event(conn, job_id, kind, now, actor=actor, **detail(row))
        store.wake_relays()
        return True


def _unpublished_row() -> Any:
    return exists().where(outbox.c.job_id == jobs.c.id, outbox.c.published_at.is_(None))


def _resends_this_wait() -> Any:
    """How many times the reconciler re-sent a queued job since it last became queued
    (accepted, or replayed by an operator)."""
    marks = job_events.alias("wait_marks")  # not correlated with the events counted
    began = (
        select(func.max(marks.c.at))
        .where(marks.c.job_id == jobs.c.id, marks.c.kind.in_(WAIT_BEGINS))
        .correlate(jobs)
        .scalar_subquery()
    )
    return (
        select(func.count())
        .select_from(job_events)
        .where(
            job_events.c.job_id == jobs.c.id,
            job_events.c.kind == RECONCILED_QUEUED,
            or_(began.is_(None), job_events.c.at >= began),
        )
        .correlate(jobs)
        .scalar_subquery()
    )


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
    "RESENT",
    "RepairQueries",
    "StaleOutboxRow",
    "WaitingJob",
]
