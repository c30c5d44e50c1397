"""A job's timeline: reading it, and events that change no state."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import (
    select,
)

from jobrelay.storage.base import StoreBase
from jobrelay.storage.records import (
    EventRecord,
)
from jobrelay.storage.tables import (
    job_events,
    jobs,
)


class EventsStore(StoreBase):
    async def events(self, job_id: str) -> list[EventRecord]:
        async with self.reading() as conn:
            rows = (
                await conn.execute(
                    select(job_events.c.at, job_events.c.kind, job_events.c.detail)
                    .where(job_events.c.job_id == job_id)
                    .order_by(job_events.c.id)
                )
            ).all()
        return [EventRecord(at=r.at, kind=r.kind, detail=r.detail or {}) for r in rows]

    async def record_event(self, job_id: str, kind: str, now: datetime, **detail: Any) -> None:
        """An event with no state change (ack_sent, duplicate_acked); ignored for unknown jobs."""
        async with self.writing() as conn:
            exists = await conn.scalar(select(jobs.c.id).where(jobs.c.id == job_id))
            if exists is not None:
                await self.add_event(conn, job_id, kind, now, **detail)
