"""The worker's claims and the writes that keep one alive: claim, renew, report progress.

A claim increments ``attempt`` and takes a lease, judged by the store's clock; the attempt is
the claim's token. Every claim is the driver's one CLAIM statement (``transitions.CLAIM``): a
delivery's claim unread, a batch of them, and the careful claim made after reading the job
(``claim_job``: guarded too on the state and attempt the policy read) are each a batch, of
one or more. The same for renewals (``RENEW``).
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.ext.asyncio import AsyncConnection

from jobrelay.domain.policy import JobView
from jobrelay.domain.states import JobState
from jobrelay.storage.base import StoreBase
from jobrelay.storage.records import Claim, Claimed, ClaimRequest, Fenced, PendingEvent, Renewed
from jobrelay.storage.tables import job_events, jobs
from jobrelay.storage.transitions import PROGRESS, Inputs, values_of


class ClaimsStore(StoreBase):
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

    async def current(self, conn: AsyncConnection | None, job_id: str) -> Fenced:
        """What a fenced write that lost found: the attempt and state holding the job now."""
        query = select(jobs.c.state, jobs.c.attempt).where(jobs.c.id == job_id)
        if conn is None:
            async with self.reading() as own:
                row = (await own.execute(query)).first()
        else:
            row = (await conn.execute(query)).first()
        if row is None:
            return Fenced(False)
        return Fenced(False, int(row.attempt), JobState(row.state))

    async def claim_many(
        self,
        requests: Sequence[ClaimRequest],
        now: datetime,
        lease: timedelta,
        events: Sequence[PendingEvent] = (),
    ) -> list[Claimed]:
        """Claim many distinct jobs in one statement (one transaction on SQLite), each
        winning or losing on its own, in request order: (claim, job, state it left) or None.

        None when a job is not ready to run (finished, leased, not yet due, attempts used,
        another type, no such job, a suspect asked for in a batch): the caller then reads it
        and decides what the delivery means.

        ``events``: state-less events (``record_events``) written with the claims, in their
        commit: a worker's settles ride on its next claim instead of a commit of their own.
        """
        return await self.driver.claim_many(requests, now, lease, events)

    async def claim_delivered(
        self,
        job_id: str,
        job_type: str,
        worker_id: str,
        now: datetime,
        lease: timedelta,
        **detail: Any,
    ) -> Claimed:
        """``claim_many`` of one: the claim a delivery makes without reading the job."""
        [claimed] = await self.claim_many(
            [ClaimRequest(job_id, job_type, worker_id, detail)], now, lease
        )
        return claimed

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

        The claim of a job read first, by a worker running nothing else beside it (so a
        suspect may be claimed here): guarded on every condition the policy checked, judged
        by the store's clock, and (with ``seen``) on the state and attempt the policy read,
        so a racing copy or a retry that is not yet due loses here instead of running twice.
        """
        request = ClaimRequest(
            job_id,
            None,
            worker_id,
            detail,
            seen_state=None if seen is None else seen.state.value,
            seen_attempt=None if seen is None else seen.attempt,
            alone=True,
        )
        [claimed] = await self.claim_many([request], now, lease)
        return None if claimed is None else claimed[0]

    async def renew_leases(
        self, claims: Sequence[Claim], lease: timedelta, now: datetime
    ) -> Renewed:
        """Many claims' leases renewed in one statement (one transaction on SQLite): the
        claims that still hold their job, each lease now ending at the store's clock
        + ``lease``, which of them an operator has asked to cancel, and (PostgreSQL) which
        were skipped because another transaction held their row locked."""
        if not claims:
            return Renewed()
        return await self.driver.renew_many(claims, lease, now)

    async def renew_lease(self, claim: Claim, lease: timedelta, now: datetime) -> bool:
        """``renew_leases`` of one."""
        return claim in await self.renew_leases([claim], lease, now)

    async def report_progress(self, claim: Claim, done: int, total: int, now: datetime) -> bool:
        i = Inputs(
            now=now,
            clock=self.now_sql(),
            req=values_of(
                {
                    "id": claim.job_id,
                    "attempt": claim.attempt,
                    "worker": claim.worker_id,
                    "done": done,
                    "total": total,
                }
            ),
        )
        async with self.writing() as conn:
            result = await conn.execute(
                update(jobs)
                .where(jobs.c.id == claim.job_id, *PROGRESS.guards(i))
                .values(**PROGRESS.sets(i))
            )
        return bool(result.rowcount == 1)

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
