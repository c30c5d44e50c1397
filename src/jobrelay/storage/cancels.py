"""Cancelling a running job: the operator's request, and the two ways such a job ends.

An operator cannot move a ``running`` job to ``cancelled`` at once: its worker holds the
claim and may be committing its outcome right now. So the request is recorded on the row
(``cancel_requested_at``/``_by``, ``cancel_reason``) with a ``cancel_requested`` event, in
one transaction, and from then on the outcome fences (``transitions.fenced``) refuse that claim:
a run that finishes after the request can no longer become ``succeeded``. The job ends
``cancelled`` with the operator's reason either by its worker, fenced on its claim, once it
has learnt the request (its lease renewal carries it) or lost its outcome to it
(``end_cancelled``); or, when that worker is gone and its lease has expired, by the
reconciler or the next delivery (``end_abandoned``). A job that finished first is left as
it is, and the request says so.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import select, update

from jobrelay.domain.states import JobState
from jobrelay.storage.base import StoreBase
from jobrelay.storage.records import Claim
from jobrelay.storage.storable import safe_text
from jobrelay.storage.tables import jobs
from jobrelay.storage.transitions import CANCEL, Inputs, holds, lease_expired

_RUNNING = JobState.RUNNING.value


@dataclass(frozen=True)
class CancelAsked:
    """What a cancel request of a running job found: ``requested`` (now or before), or the
    state the job was in (``None``: no such job)."""

    job_id: str
    requested: bool
    state: JobState | None
    first: bool = False  # this call recorded it (a repeated request changes nothing)


class CancelsStore(StoreBase):
    async def request_cancel(
        self, job_id: str, *, actor: str, reason: str, now: datetime
    ) -> CancelAsked:
        """Record an operator's cancel of a ``running`` job and its ``cancel_requested``
        event, in one transaction; a job in any other state is left unchanged."""
        reason = safe_text(reason)[:4000]
        async with self.writing() as conn:
            won = await conn.execute(
                update(jobs)
                .where(
                    jobs.c.id == job_id,
                    jobs.c.state == _RUNNING,
                    jobs.c.cancel_requested_at.is_(None),
                )
                .values(
                    cancel_requested_at=now,
                    cancel_requested_by=actor,
                    cancel_reason=reason,
                    updated_at=now,
                )
                .returning(jobs.c.attempt, jobs.c.lease_owner)
            )
            row = won.first()
            if row is not None:
                await self.add_event(
                    conn,
                    job_id,
                    "cancel_requested",
                    now,
                    actor=actor,
                    reason=reason,
                    attempt=row.attempt,
                    worker=row.lease_owner,
                )
                return CancelAsked(job_id, True, JobState.RUNNING, first=True)
            found = (
                await conn.execute(
                    select(jobs.c.state, jobs.c.cancel_requested_at).where(jobs.c.id == job_id)
                )
            ).first()
        if found is None:
            return CancelAsked(job_id, False, None)
        state = JobState(found.state)
        return CancelAsked(job_id, state is JobState.RUNNING, state)

    async def end_cancelled(self, claim: Claim, now: datetime) -> bool:
        """running -> cancelled by the worker whose claim holds the job, once an operator
        asked for it; with a ``cancelled`` event naming that operator and reason."""
        return await self._end(
            [jobs.c.id == claim.job_id, *holds(claim)],
            claim.job_id,
            now,
            attempt=claim.attempt,
            worker=claim.worker_id,
        )

    async def end_abandoned(self, job_id: str, now: datetime) -> bool:
        """running -> cancelled for a job whose cancel was requested and whose lease has
        expired by the store's clock: its worker died before it could end the job."""
        return await self._end(
            [jobs.c.id == job_id, jobs.c.state == _RUNNING, lease_expired(self.now_sql())],
            job_id,
            now,
            leaseExpired=True,
        )

    async def abandoned_cancels(self, limit: int = 100) -> list[str]:
        """Running jobs with a cancel requested and their lease expired: the reconciler's."""
        async with self.reading() as conn:
            rows = await conn.scalars(
                select(jobs.c.id)
                .where(
                    jobs.c.state == _RUNNING,
                    jobs.c.cancel_requested_at.is_not(None),
                    lease_expired(self.now_sql()),
                )
                .order_by(jobs.c.cancel_requested_at)
                .limit(limit)
            )
            return list(rows)

    async def _end(self, where: list[Any], job_id: str, now: datetime, **detail: Any) -> bool:
        async with self.writing() as conn:
            row = (
                await conn.execute(
                    update(jobs)
                    .where(*where, jobs.c.cancel_requested_at.is_not(None))
                    .values(**CANCEL.sets(Inputs(now=now, clock=self.now_sql())))
                    .returning(jobs.c.cancel_requested_by, jobs.c.cancel_reason, jobs.c.attempt)
                )
            ).first()
            if row is None:
                return False
            released = await self.release_slots(conn, CANCEL, job_id)
            await self.add_event(
                conn,
                job_id,
                "cancelled",
                now,
                actor=row.cancel_requested_by,
                reason=row.cancel_reason,
                previousState=_RUNNING,
                **{"attempt": row.attempt, **detail},
            )
        if released:
            self.wake_relays()
        return True


__all__ = ["CancelAsked", "CancelsStore"]
