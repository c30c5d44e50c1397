"""A job's timeline: reading it, and events that change no state."""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import ARRAY, JSON, String, Text, bindparam, exists, insert, select, text

from jobrelay.domain.timeline import causal_order
from jobrelay.storage.base import StoreBase
from jobrelay.storage.engine import statement_tx
from jobrelay.storage.pg_hot import HotStatement
from jobrelay.storage.records import EventRecord, PendingEvent, jsonable
from jobrelay.storage.tables import UTCDateTime, job_events, jobs

# PostgreSQL: the events of a batch as arrays, one statement whatever their number.
_RECORD_MANY = HotStatement(
    text(
        """
INSERT INTO job_events (job_id, at, kind, detail)
SELECT r.job_id, r.at, r.kind, CAST(r.detail AS json)
FROM unnest(CAST(:e_jobs AS text[]), CAST(:e_ats AS timestamptz[]),
            CAST(:e_kinds AS text[]), CAST(:e_details AS text[])) AS r(job_id, at, kind, detail)
WHERE EXISTS (SELECT 1 FROM jobs WHERE jobs.id = r.job_id)
"""
    ).bindparams(
        bindparam("e_jobs", type_=ARRAY(String())),
        bindparam("e_ats", type_=ARRAY(UTCDateTime())),
        bindparam("e_kinds", type_=ARRAY(String())),
        bindparam("e_details", type_=ARRAY(Text())),
    )
)


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
                    select(job_events.c.at, job_events.c.kind, job_events.c.detail)
                    .where(job_events.c.job_id == job_id)
                    .order_by(job_events.c.at, job_events.c.id)
                )
            ).all()
        return causal_order(
            [EventRecord(at=r.at, kind=r.kind, detail=r.detail or {}) for r in rows]
        )

    async def record_event(self, job_id: str, kind: str, now: datetime, **detail: Any) -> None:
        """An event with no state change (ack_sent, duplicate_acked); ignored for unknown jobs."""
        async with self.writing() as conn:
            exists = await conn.scalar(select(jobs.c.id).where(jobs.c.id == job_id))
            if exists is not None:
                await self.add_event(conn, job_id, kind, now, **detail)

    async def record_events(self, events: Sequence[PendingEvent]) -> None:
        """Many state-less events in one batch (one round trip); unknown jobs' are skipped."""
        if not events:
            return
        if self.is_postgres:
            params = {
                "e_jobs": [e.job_id for e in events],
                "e_ats": [e.at for e in events],
                "e_kinds": [e.kind for e in events],
                "e_details": [json.dumps(jsonable(e.detail)) for e in events],
            }
            await self.hot_rows(_RECORD_MANY, params)
            return
        job_id = bindparam("ev_job_id", type_=String())
        statement = insert(job_events).from_select(
            ["job_id", "at", "kind", "detail"],
            select(
                job_id,
                bindparam("ev_at", type_=UTCDateTime()),
                bindparam("ev_kind", type_=String()),
                bindparam("ev_detail", type_=JSON()),
            ).where(exists().where(jobs.c.id == job_id)),
        )
        rows = [
            {
                "ev_job_id": e.job_id,
                "ev_at": e.at,
                "ev_kind": e.kind,
                "ev_detail": jsonable(e.detail),
            }
            for e in events
        ]
        async with statement_tx(self.engine, "database") as conn:
            await conn.execute(statement, rows)
