"""The SQL behind the operator's dashboard: the jobs list, its counts and the overview.

Every statement here is bounded: the list is a keyset page (``LIMIT``, an index on
``created_at`` per account), the throughput reads only the last hour of ``job_events``
through ``ix_job_events_at`` and is counted per minute by the database, and the relay lag
is measured on the last ``LAG_SAMPLE`` published outbox rows. Counts per state, type and
queue are one ``GROUP BY`` over ``jobs`` (the one scan; its rows are few groups).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import and_, exists, func, or_, select

from jobrelay.domain.job_filter import STATE_ENTRY_KINDS, THROUGHPUT_KINDS, JobFilter, PageKey
from jobrelay.storage.delayed import due_since
from jobrelay.storage.port import StorePort
from jobrelay.storage.store import JobRecord, aware_time, job_record
from jobrelay.storage.tables import job_events, jobs, outbox
from jobrelay.storage.transitions import in_states

LAG_SAMPLE = 200  # published outbox rows the relay lag is measured on


@dataclass(frozen=True)
class JobCounts:
    by_state: dict[str, int]
    by_type: dict[str, int]
    by_queue: dict[str, int]
    total: int


@dataclass(frozen=True)
class RelayLag:
    """Seconds from an outbox row's commit to its publish, over the latest published rows."""

    sampled: int
    median_seconds: float | None
    max_seconds: float | None
    last_published_at: datetime | None


def _where(query: Any, f: JobFilter) -> Any:
    if f.states is not None:
        query = query.where(*in_states(f.states))
    if f.job_type is not None:
        query = query.where(jobs.c.type == f.job_type)
    if f.queue is not None:
        query = query.where(jobs.c.queue == f.queue)
    if f.account_id is not None:
        query = query.where(jobs.c.account_id == f.account_id)
    if f.created_after is not None:
        query = query.where(jobs.c.created_at >= f.created_after)
    if f.created_before is not None:
        query = query.where(jobs.c.created_at < f.created_before)
    if f.reason and f.reason_public:
        # What the account reads (api.schemas: the public error, while there is an error).
        text = func.lower(func.coalesce(jobs.c.public_error, ""))
        query = query.where(
            jobs.c.last_error.is_not(None), text.contains(f.reason.lower(), autoescape=True)
        )
    elif f.reason:
        text = func.lower(func.coalesce(jobs.c.quarantine_reason, jobs.c.last_error, ""))
        query = query.where(text.contains(f.reason.lower(), autoescape=True))
    if f.uncancelled:
        query = query.where(jobs.c.cancel_requested_at.is_(None))
    if f.event_ceiling is not None:
        entered_since = select(job_events.c.id).where(
            job_events.c.job_id == jobs.c.id,
            job_events.c.id > f.event_ceiling,
            job_events.c.kind.in_(STATE_ENTRY_KINDS),
        )
        query = query.where(~exists(entered_since))
    return query


async def event_ceiling(store: StorePort) -> int:
    """The highest job event id now: a bulk operation's start (``JobFilter.event_ceiling``).

    Ids come from one sequence, taken when a row is inserted, so an event written after this
    read (a replay of the operation, the failure after it) has a higher id.
    """
    async with store.reading() as conn:
        top = await conn.scalar(select(func.max(job_events.c.id)))
    return int(top or 0)


async def search_jobs(
    store: StorePort, f: JobFilter, *, limit: int, after: PageKey | None = None
) -> list[JobRecord]:
    """One page of matching jobs, newest first, strictly after ``after``."""
    query = _where(store.job_query(), f)
    if after is not None:
        query = query.where(
            or_(
                jobs.c.created_at < after.created_at,
                and_(jobs.c.created_at == after.created_at, jobs.c.id < after.job_id),
            )
        )
    query = query.order_by(jobs.c.created_at.desc(), jobs.c.id.desc()).limit(limit)
    async with store.reading() as conn:
        rows = (await conn.execute(query)).all()
    return [job_record(r) for r in rows]


async def count_jobs(store: StorePort, f: JobFilter) -> int:
    async with store.reading() as conn:
        n = await conn.scalar(_where(select(func.count()).select_from(jobs), f))
    return int(n or 0)


async def job_counts(store: StorePort) -> JobCounts:
    query = select(jobs.c.state, jobs.c.type, jobs.c.queue, func.count()).group_by(
        jobs.c.state, jobs.c.type, jobs.c.queue
    )
    async with store.reading() as conn:
        rows = (await conn.execute(query)).all()
    by_state: dict[str, int] = {}
    by_type: dict[str, int] = {}
    by_queue: dict[str, int] = {}
    for state, job_type, queue, n in rows:
        by_state[state] = by_state.get(state, 0) + int(n)
        by_type[job_type] = by_type.get(job_type, 0) + int(n)
        by_queue[queue] = by_queue.get(queue, 0) + int(n)
    return JobCounts(by_state, by_type, by_queue, sum(by_state.values()))


async def throughput(store: StorePort, since: datetime) -> list[tuple[datetime, str, int]]:
    """``(minute, kind, count)`` of the counted event kinds at or after ``since``."""
    minute = store.minute_of(job_events.c.at)
    query = (
        select(minute.label("minute"), job_events.c.kind, func.count())
        .where(job_events.c.at >= since, job_events.c.kind.in_(list(THROUGHPUT_KINDS)))
        .group_by(minute, job_events.c.kind)
    )
    async with store.reading() as conn:
        rows = (await conn.execute(query)).all()
    out = []
    for at, kind, n in rows:
        when = datetime.fromisoformat(at) if isinstance(at, str) else at
        out.append((when if when.tzinfo else when.replace(tzinfo=UTC), str(kind), int(n)))
    return out


async def relay_lag(store: StorePort) -> RelayLag:
    query = (
        # From when it was due: a delayed job's wait is not the relay's lag.
        select(due_since().label("created_at"), outbox.c.published_at)
        .where(outbox.c.published_at.is_not(None))
        .order_by(outbox.c.id.desc())
        .limit(LAG_SAMPLE)
    )
    async with store.reading() as conn:
        rows = (await conn.execute(query)).all()
    lags = sorted(
        max(0.0, (aware(r.published_at) - aware(r.created_at)).total_seconds()) for r in rows
    )
    if not lags:
        return RelayLag(0, None, None, None)
    last = max(aware(r.published_at) for r in rows)
    return RelayLag(len(lags), lags[len(lags) // 2], lags[-1], last)


def aware(value: datetime | None) -> datetime:
    at = aware_time(value)
    assert at is not None
    return at


__all__ = [
    "LAG_SAMPLE",
    "JobCounts",
    "RelayLag",
    "count_jobs",
    "job_counts",
    "relay_lag",
    "search_jobs",
    "throughput",
]
