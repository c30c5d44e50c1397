"""Jobs: accepting one (job + outbox row + event in one transaction) and reading them."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import (
    func,
    select,
    text,
)
from sqlalchemy.ext.asyncio import AsyncEngine

from jobrelay.domain.ids import IdKeys
from jobrelay.domain.states import JobState
from jobrelay.storage.base import StoreBase
from jobrelay.storage.dependencies import chunks, dependency_ids
from jobrelay.storage.drivers.new_job import steps_on
from jobrelay.storage.records import (
    Clock,
    JobLinks,
    JobRecord,
    LinkedJob,
    NewJob,
    job_record,
)
from jobrelay.storage.steps import run_async
from jobrelay.storage.tables import (
    UNFINISHED,
    job_dependencies,
    jobs,
)
from jobrelay.storage.transitions import in_states

# How long an account's count of unfinished jobs is trusted by this process; within it, the
# jobs this process accepted for the account are added to the count, read again only when
# that reaches the quota.
QUOTA_RECOUNT_SECONDS = 1.0
_QUOTA_CACHE_SIZE = 10_000  # accounts remembered; beyond that, start again
_monotonic = time.monotonic  # the count cache's clock (tests move it)


@dataclass
class _Counted:
    at: float
    count: int  # unfinished jobs read at ``at`` (at most the quota)
    accepted: int  # places this process has given out since


class JobsStore(StoreBase):
    def __init__(
        self, engine: AsyncEngine, *, clock: Clock | None = None, id_secret: bytes | None = None
    ) -> None:
        super().__init__(engine, clock=clock, id_secret=id_secret)
        self._unfinished: dict[str, _Counted] = {}

    async def has_room(self, account_id: str, quota: int) -> bool:
        """Whether the account may have one more unfinished job (and the place is taken).

        The count is read at most once per ``QUOTA_RECOUNT_SECONDS`` per account while the
        account is under its quota, whatever its rate: reading it costs one entry of the
        partial index per unfinished job (18 ms at 100,000 on PostgreSQL), too much for every
        accept of a busy account. So this process may give out more places than there are
        only by what other API processes accept for the account within that second; an
        account found full is refused without a read until the next count.
        """
        now = _monotonic()
        seen = self._unfinished.get(account_id)
        if seen is not None and now - seen.at < QUOTA_RECOUNT_SECONDS:
            if seen.count >= quota:
                return False
            if seen.count + seen.accepted < quota:
                seen.accepted += 1
                return True
        count = await self.unfinished_jobs(account_id, quota)
        if len(self._unfinished) >= _QUOTA_CACHE_SIZE:
            self._unfinished.clear()
        room = count < quota
        self._unfinished[account_id] = _Counted(now, count, accepted=1 if room else 0)
        return room

    async def unfinished_jobs(self, account_id: str, at_most: int) -> int:
        """How many of the account's jobs are unfinished (queued, delayed, running, waiting
        to retry), counted up to ``at_most``: one read of the partial index
        ``ix_jobs_account_unfinished``, never more than ``at_most`` of its entries."""
        some = (
            select(jobs.c.id)
            .where(jobs.c.account_id == account_id, text(UNFINISHED))
            .limit(at_most)
            .subquery()
        )
        async with self.reading() as conn:
            return int(await conn.scalar(select(func.count()).select_from(some)) or 0)

    async def job_exists(self, job_id: str) -> bool:
        async with self.reading() as conn:
            return await conn.scalar(select(jobs.c.id).where(jobs.c.id == job_id)) is not None

    async def id_keys(self, now: datetime) -> IdKeys:
        """The secrets job ids are derived with at ``now``: the installation's current one and
        the previous one while its window lasts. Cached: no statement on most calls."""
        return await self.installation.id_keys(now)

    async def submit(self, job: NewJob, now: datetime) -> tuple[str, bool]:
        """Insert the job, its outbox row and its ``accepted`` event in ONE transaction.

        Returns ``(job_id, created)``. A repeat of the same request returns the existing id
        and writes nothing; the same idempotency key with another body raises. On PostgreSQL
        the writes are one statement, sent in autocommit mode: one round trip. A job with
        ``after=`` takes several (``storage.dependencies``): a write transaction.
        """
        if job.after:
            async with self.writing() as conn:
                job_id, created = await run_async(conn, steps_on(conn, job, now))
        else:
            job_id, created = await self.driver.write_new_job(job, now)
        if created:
            self.wake_relays()
        return job_id, created

    async def get_job(self, job_id: str) -> JobRecord | None:
        async with self.reading() as conn:
            row = (await conn.execute(self.job_query().where(jobs.c.id == job_id))).first()
        return job_record(row) if row is not None else None

    async def dependencies_of(self, job_id: str) -> list[JobRecord]:
        """The jobs ``job_id`` runs after (``after=``), in the order given; a job pruned
        since (retention keeps every one a job still waits for) is left out."""
        async with self.reading() as conn:
            ids = list((await conn.scalars(dependency_ids(job_id))).all())
            found: dict[str, JobRecord] = {}
            for chunk in chunks(ids):
                rows = (await conn.execute(self.job_query().where(jobs.c.id.in_(chunk)))).all()
                found.update((r.id, job_record(r)) for r in rows)
        return [found[i] for i in ids if i in found]

    async def links_of(self, job_id: str, shown: int = 20) -> JobLinks:
        """The first ``shown`` jobs ``job_id`` runs after and that run after it, with their
        states, and how many of each (``job show``, explain, the console)."""
        deps, dependant = job_dependencies, jobs.alias("dependant")
        async with self.reading() as conn:
            after = (
                await conn.execute(
                    select(deps.c.depends_on, jobs.c.state)
                    .select_from(deps.outerjoin(jobs, jobs.c.id == deps.c.depends_on))
                    .where(deps.c.job_id == job_id)
                    .order_by(deps.c.position)
                    .limit(shown)
                )
            ).all()
            after_count = await conn.scalar(
                select(func.count()).select_from(deps).where(deps.c.job_id == job_id)
            )
            before = (
                await conn.execute(
                    select(deps.c.job_id, dependant.c.state)
                    .join(dependant, dependant.c.id == deps.c.job_id)
                    .where(deps.c.depends_on == job_id)
                    .order_by(deps.c.job_id)
                    .limit(shown)
                )
            ).all()
            before_count = await conn.scalar(
                select(func.count()).select_from(deps).where(deps.c.depends_on == job_id)
            )

        def linked(rows: Sequence[Any]) -> tuple[LinkedJob, ...]:
            return tuple(LinkedJob(r[0], None if r[1] is None else JobState(r[1])) for r in rows)

        return JobLinks(
            linked(after), int(after_count or 0), linked(before), int(before_count or 0)
        )

    async def list_jobs(
        self, state: JobState | None = None, account_id: str | None = None, limit: int = 100
    ) -> list[JobRecord]:
        query = self.job_query().order_by(jobs.c.created_at.desc(), jobs.c.id).limit(limit)
        if state is not None:
            query = query.where(*in_states([state]))
        if account_id is not None:
            query = query.where(jobs.c.account_id == account_id)
        async with self.reading() as conn:
            rows = (await conn.execute(query)).all()
        return [job_record(r) for r in rows]

    async def count_by_state(self) -> dict[str, int]:
        async with self.reading() as conn:
            rows = (
                await conn.execute(select(jobs.c.state, func.count()).group_by(jobs.c.state))
            ).all()
        return {r[0]: int(r[1]) for r in rows}
