"""Paused work queues: the durable flag workers poll, and its audit trail.

A pause or a resume is one transaction: the flag row upserted and a ``queue_events`` row
naming the actor and the reason. Pausing a paused queue (or resuming a running one) changes
nothing and says so, like a refused job action.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import insert, select

from jobrelay.storage.port import StorePort
from jobrelay.storage.tables import queue_events, queue_pauses


@dataclass(frozen=True)
class QueuePause:
    queue: str
    paused: bool
    changed_at: datetime
    changed_by: str
    reason: str


@dataclass(frozen=True)
class QueueEvent:
    queue: str
    at: datetime
    kind: str
    actor: str
    reason: str


async def pauses(store: StorePort) -> dict[str, QueuePause]:
    """Every queue an operator has ever paused, with its current flag."""
    async with store.reading() as conn:
        rows = (await conn.execute(select(queue_pauses))).all()
    return {
        r.queue: QueuePause(r.queue, bool(r.paused), r.changed_at, r.changed_by, r.reason)
        for r in rows
    }


async def pause_of(store: StorePort, queue: str) -> QueuePause | None:
    """The pause holding ``queue`` now, or None: what ``job show`` and explain name."""
    async with store.reading() as conn:
        row = (
            await conn.execute(
                select(queue_pauses).where(queue_pauses.c.queue == queue, queue_pauses.c.paused)
            )
        ).first()
    if row is None:
        return None
    return QueuePause(row.queue, True, row.changed_at, row.changed_by, row.reason)


async def paused_queues(store: StorePort) -> set[str]:
    """The queues workers must not consume now (what each worker polls)."""
    async with store.reading() as conn:
        rows = await conn.execute(select(queue_pauses.c.queue).where(queue_pauses.c.paused))
        return {r.queue for r in rows}


async def set_paused(
    store: StorePort, queue: str, paused: bool, *, actor: str, reason: str, now: datetime
) -> bool:
    """Pause or resume ``queue``; False (and nothing written) when it already was so."""
    async with store.writing() as conn:
        current = await conn.scalar(
            select(queue_pauses.c.paused).where(queue_pauses.c.queue == queue).with_for_update()
        )
        if bool(current) == paused:
            return False
        values = {"paused": paused, "changed_at": now, "changed_by": actor, "reason": reason}
        upsert = store.upsert(queue_pauses).values(queue=queue, **values)
        await conn.execute(upsert.on_conflict_do_update(index_elements=["queue"], set_=values))
        kind = "paused" if paused else "resumed"
        await conn.execute(
            insert(queue_events).values(queue=queue, at=now, kind=kind, actor=actor, reason=reason)
        )
    return True


async def queue_history(store: StorePort, queue: str, limit: int = 50) -> list[QueueEvent]:
    """The queue's pauses and resumes, newest first."""
    query = (
        select(queue_events)
        .where(queue_events.c.queue == queue)
        .order_by(queue_events.c.id.desc())
        .limit(limit)
    )
    async with store.reading() as conn:
        rows = (await conn.execute(query)).all()
    return [QueueEvent(r.queue, r.at, r.kind, r.actor, r.reason) for r in rows]


__all__ = [
    "QueueEvent",
    "QueuePause",
    "pause_of",
    "paused_queues",
    "pauses",
    "queue_history",
    "set_paused",
]
