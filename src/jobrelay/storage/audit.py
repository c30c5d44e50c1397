"""Whole-database facts for the soak's checker: every job, its result writes, its e-mail.

These are bulk reads over the whole database, meant for a checker that runs once the system
is quiet, never for the request path.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncEngine

from jobrelay.domain.states import JobState
from jobrelay.storage.engine import read_tx
from jobrelay.storage.port import StorePort
from jobrelay.storage.store import JobRecord, job_record
from jobrelay.storage.tables import effects_ledger, job_events, jobs, outbox


@dataclass(frozen=True)
class Facts:
    jobs: dict[str, JobRecord]
    events: dict[str, Counter[str]]  # job id -> event kind -> count
    effects: dict[str, tuple[str, str]]  # job id -> (ledger state, message id)
    unpublished: int
    id_secret: bytes = field(repr=False)  # the installation's: what the API keyed ids with


async def non_terminal_and_unpublished(engine: AsyncEngine) -> tuple[int, int]:
    """How much is still moving: jobs not yet terminal, outbox rows not yet published."""
    waiting = [s.value for s in JobState if not s.is_terminal]
    async with read_tx(engine, "audit") as conn:
        moving = await conn.scalar(
            select(func.count()).select_from(jobs).where(jobs.c.state.in_(waiting))
        )
        unpublished = await conn.scalar(
            select(func.count()).select_from(outbox).where(outbox.c.published_at.is_(None))
        )
    return int(moving or 0), int(unpublished or 0)


async def collect(store: StorePort) -> Facts:
    engine = store.engine
    async with read_tx(engine, "audit") as conn:
        rows = (await conn.execute(store.job_query())).all()
        found = {r.id: job_record(r) for r in rows}
        events: dict[str, Counter[str]] = {}
        counted = await conn.execute(
            select(job_events.c.job_id, job_events.c.kind, func.count()).group_by(
                job_events.c.job_id, job_events.c.kind
            )
        )
        for job_id, kind, n in counted:
            events.setdefault(job_id, Counter())[kind] = int(n)
        ledger = await conn.execute(
            select(effects_ledger.c.job_id, effects_ledger.c.state, effects_ledger.c.message_id)
        )
        effects = {job_id: (state, message_id) for job_id, state, message_id in ledger}
        unpublished = await conn.scalar(
            select(func.count()).select_from(outbox).where(outbox.c.published_at.is_(None))
        )
    keys = await store.id_keys(store.local_now())
    return Facts(found, events, effects, int(unpublished or 0), keys.current)
