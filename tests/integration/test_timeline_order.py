"""A job's timeline is in the order things happened: by time, ties by id (the order they
were written). Rows are not always written in time order: events batched by a worker
(ack_sent) can land after a later one written by another process."""

from __future__ import annotations

from datetime import timedelta

from sqlalchemy import func, insert, select

from jobrelay.domain.states import JobState
from jobrelay.roles.runtime import utc_now
from jobrelay.storage.engine import create_engine
from jobrelay.storage.store import Store
from jobrelay.storage.tables import job_events

from .ops_fixtures import job_in_state


async def test_events_are_ordered_by_time_then_id(database_url: str) -> None:
    engine = create_engine(database_url)
    try:
        store = Store(engine)
        t0 = utc_now() - timedelta(minutes=5)
        job_id = await job_in_state(store, JobState.QUEUED, t0)
        async with engine.begin() as conn:
            base = int(await conn.scalar(select(func.max(job_events.c.id))) or 0)
            written = [  # (kind, at, id), in the order they are written
                ("late", t0 + timedelta(seconds=3), base + 1),
                ("early", t0 + timedelta(seconds=1), base + 2),
                ("tie_higher_id", t0 + timedelta(seconds=2), base + 20),
                ("tie_lower_id", t0 + timedelta(seconds=2), base + 10),
            ]
            for kind, at, id_ in written:
                await conn.execute(
                    insert(job_events).values(id=id_, job_id=job_id, at=at, kind=kind, detail={})
                )
        kinds = [e.kind for e in await store.events(job_id) if e.at > t0]
        assert kinds == ["early", "tie_lower_id", "tie_higher_id", "late"]
    finally:
        await engine.dispose()
