"""Jobs: accepting one (job + outbox row + event in one transaction) and reading them."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import (
    func,
    select,
)

from jobrelay.domain.messages import JobMessage
from jobrelay.domain.states import JobState
from jobrelay.errors import IdempotencyConflict
from jobrelay.storage.base import StoreBase
from jobrelay.storage.records import (
    WORK_DESTINATION,
    JobRecord,
    NewJob,
    job_record,
)
from jobrelay.storage.tables import (
    jobs,
)


class JobsStore(StoreBase):
    async def submit(self, job: NewJob, now: datetime) -> tuple[str, bool]:
        """Insert the job, its outbox row and its ``accepted`` event in ONE transaction.

        Returns ``(job_id, created)``. A repeat of the same request returns the existing id
        and writes nothing; the same idempotency key with another body raises.
        """
        async with self.writing() as conn:
            if not await self.insert_job(conn, job, now):
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
            await self.add_message(conn, job.job_id, message, WORK_DESTINATION, now, headers)
            await self.add_event(conn, job.job_id, "accepted", now, type=job.type)
        self.wake_relays()
        return job.job_id, True

    async def get_job(self, job_id: str) -> JobRecord | None:
        async with self.reading() as conn:
            row = (await conn.execute(self.job_query().where(jobs.c.id == job_id))).first()
        return job_record(row) if row is not None else None

    async def list_jobs(
        self, state: JobState | None = None, account_id: str | None = None, limit: int = 100
    ) -> list[JobRecord]:
        query = self.job_query().order_by(jobs.c.created_at.desc(), jobs.c.id).limit(limit)
        if state is not None:
            query = query.where(jobs.c.state == state.value)
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
