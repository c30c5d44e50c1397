"""Whole-database facts for the soak's checker: every job, its result writes, its e-mail,
the timeline of its runs (each claim and the event that ended it) and the slots still held.

These are bulk reads over the whole database, meant for a checker that runs once the system
is quiet, never for the request path.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncEngine

from jobrelay.domain.states import UNFINISHED_VALUES
from jobrelay.storage.engine import read_tx
from jobrelay.storage.port import StorePort
from jobrelay.storage.store import JobRecord, job_record
from jobrelay.storage.tables import effects_ledger, job_events, job_slots, jobs, outbox
from jobrelay.storage.transitions import (
    CANCEL,
    CLAIM,
    COMPLETE,
    LEASE_EXPIRED,
    QUARANTINE,
    RETRY,
    Transition,
)


def _event(transition: Transition) -> str:
    assert transition.event is not None
    return transition.event


# A run starts with its claim and ends with the event of the transition that gives its slots
# back (``Transition.releases``): success, retry, quarantine, cancel, the reconciler's takeover.
RUN_STARTS = _event(CLAIM)
_ENDING = (COMPLETE, RETRY, QUARANTINE, CANCEL, LEASE_EXPIRED)
RUN_ENDS = frozenset(_event(t) for t in _ENDING if t.releases)


@dataclass(frozen=True)
class RunEvent:
    """One start or end of a job's run, as its timeline recorded it."""

    job_id: str
    at: datetime
    kind: str


@dataclass(frozen=True)
class Facts:
    jobs: dict[str, JobRecord]
    events: dict[str, Counter[str]]  # job id -> event kind -> count
    effects: dict[str, tuple[str, str]]  # job id -> (ledger state, message id)
    unpublished: int
    id_secret: bytes = field(repr=False)  # the installation's: what the API keyed ids with
    # Every claim and run-ending event, in the order written.
    runs: tuple[RunEvent, ...] = ()
    slots_held: int = 0  # ``job_slots`` rows: none once every job has finished


async def non_terminal_and_unpublished(engine: AsyncEngine) -> tuple[int, int]:
    """How much is still moving: jobs not yet terminal, outbox rows not yet published."""
    waiting = list(UNFINISHED_VALUES)
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
        timeline = await conn.execute(
            select(job_events.c.job_id, job_events.c.at, job_events.c.kind)
            .where(job_events.c.kind.in_(sorted({RUN_STARTS, *RUN_ENDS})))
            .order_by(job_events.c.id)
        )
        runs = tuple(RunEvent(job_id, at, kind) for job_id, at, kind in timeline)
        slots = await conn.scalar(select(func.count()).select_from(job_slots))
    keys = await store.id_keys(store.local_now())
    return Facts(found, events, effects, int(unpublished or 0), keys.current, runs, int(slots or 0))
