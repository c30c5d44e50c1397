"""Process heartbeats: which workers and relays ran lately, for the overview.

Each worker and relay upserts its row every ``JOBRELAY_HEARTBEAT_SECONDS``; a row is one
small write per process per beat, never per job. Each beat also deletes the rows not seen
for ``HEARTBEAT_RETENTION`` (any process may prune: the delete is idempotent), so the table
holds the processes of about the last hour and no more.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import delete, select

from jobrelay.storage.port import StorePort
from jobrelay.storage.tables import process_heartbeats as hb

HEARTBEAT_RETENTION = timedelta(hours=1)


@dataclass(frozen=True)
class ProcessBeat:
    id: str
    role: str
    host: str
    pid: int
    queues: tuple[str, ...]
    started_at: datetime
    last_seen_at: datetime


async def beat(store: StorePort, process: ProcessBeat, now: datetime) -> None:
    """Upsert this process's row as seen ``now``, and prune the rows long unseen."""
    values = {
        "role": process.role,
        "host": process.host,
        "pid": process.pid,
        "queues": list(process.queues),
        "started_at": process.started_at,
        "last_seen_at": now,
    }
    upsert = store.upsert(hb).values(id=process.id, **values)
    async with store.writing() as conn:
        await conn.execute(
            upsert.on_conflict_do_update(index_elements=["id"], set_={"last_seen_at": now})
        )
        await conn.execute(delete(hb).where(hb.c.last_seen_at < now - HEARTBEAT_RETENTION))


async def seen_since(store: StorePort, since: datetime, limit: int = 200) -> list[ProcessBeat]:
    """The processes whose last beat is at or after ``since``, the latest first."""
    query = (
        select(hb).where(hb.c.last_seen_at >= since).order_by(hb.c.last_seen_at.desc()).limit(limit)
    )
    async with store.reading() as conn:
        rows = (await conn.execute(query)).all()
    return [
        ProcessBeat(
            r.id, r.role, r.host, r.pid, tuple(_names(r.queues)), r.started_at, r.last_seen_at
        )
        for r in rows
    ]


def _names(queues: Sequence[str] | None) -> list[str]:
    return [str(q) for q in queues or ()]


__all__ = ["HEARTBEAT_RETENTION", "ProcessBeat", "beat", "seen_since"]
