"""A job's timeline: reading it, and events that change no state."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import select

from jobrelay.domain.timeline import causal_order
from jobrelay.storage.base import StoreBase
from jobrelay.storage.records import EventRecord, PendingEvent, event_job
from jobrelay.storage.tables import job_events


class EventsStore(StoreBase):
    async def events(self, job_id: str) -> list[EventRecord]:
        """The timeline every reader shows (API, ``job show``, explain, the console).

        By time: rows are not always written in time order (the worker batches its ack_sent
        lines, the relay writes ``published`` after the confirm); the id breaks ties in write
        order. Then causally (``domain.timeline``): a message's ``published`` before what its
        deliveries wrote, whatever the writers' clocks said.
        """
        async with self.reading() as conn:
            rows = (
                await conn.execute(
                    select(job_events.c.id, job_events.c.at, job_events.c.kind, job_events.c.detail)
                    .where(job_events.c.job_id == job_id)
                    .order_by(job_events.c.at, job_events.c.id)
                )
            ).all()
        return causal_order(
            [EventRecord(at=r.at, kind=r.kind, detail=r.detail or {}, id=r.id) for r in rows]
        )

    async def record_event(self, job_id: str, kind: str, now: datetime, **detail: Any) -> None:
        """An event with no state change (ack_sent, duplicate_acked); ignored for unknown jobs
        (``event_job``: no event outlives a job that retention deletes meanwhile)."""
        async with self.writing() as conn:
            if await conn.scalar(event_job(job_id)) is not None:
                await self.add_event(conn, job_id, kind, now, **detail)

    async def record_events(self, events: Sequence[PendingEvent]) -> None:
        """Many state-less events in one batch (one round trip); unknown jobs' are skipped."""
        if not events:
            return
        await self.driver.record_events(events)
