"""Jobs that run after others (``after=``): how the transaction that commits a job's end
settles the jobs waiting for it, exactly once.

A job written with ``after=[ids]`` is ``waiting``: no outbox row, no message, no worker holds
it. ``jobs.waiting_for`` counts its dependencies that have not ended; each edge
(``job_dependencies``) is counted once, when its dependency first ends (``finished_state``).
The transaction that commits a dependency's end (a completion, a quarantine, a cancel)
decrements the count of every job waiting for it, and the one that takes a count to zero makes
the job ``queued`` with its outbox row, in that same transaction: there is no counter outside
it to lose (celery#4207) nor a second reader to fire it twice (sidekiq#6852).

Why no end is missed on PostgreSQL: the enqueue locks each unfinished dependency's row (in id
order) and marks it ``has_dependants`` before it commits its edges; a dependency's end is an
``UPDATE`` of that same row. Whichever commits second saw the first: an end committed first is
read as ended by the enqueue (not counted), an enqueue committed first made the end's own
``UPDATE`` wait for it, and the end's NEXT statement (a new snapshot: never the same statement,
whose snapshot predates the enqueue) reads the edges. So a completion of a job marked
``has_dependants`` runs in a transaction that settles its dependants (``OutcomesStore``); the
hot completion statement leaves such a job to it (``Won.deferred``). On SQLite one writer at a
time gives the same order.

Written as steps (``drivers.new_job``): the enqueue runs them on the caller's connection, sync
or async, the store's transitions on theirs.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy import func, insert, select, update

from jobrelay.domain.disclosure import DEPENDENCY_FAILED, public_error
from jobrelay.domain.messages import JobMessage
from jobrelay.domain.states import JobState
from jobrelay.storage.records import DONE_CHANNEL, NOTIFY_CHANNEL, jsonable, work_destination
from jobrelay.storage.steps import Step, Steps
from jobrelay.storage.tables import job_dependencies, job_events, jobs, outbox
from jobrelay.storage.transitions import CANCEL, Inputs, awaiting_admission, values_of

FAILED_STATES = (JobState.QUARANTINED.value, JobState.CANCELLED.value)
# Ids per statement: a bound list stays far below every driver's limit on parameters.
CHUNK = 1000

_deps = job_dependencies


def chunks(items: Sequence[str], size: int = CHUNK) -> Iterator[Sequence[str]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


@dataclass
class Settled:
    """The waiting jobs a transaction made ``queued`` (their outbox rows written: the relays
    are woken at its commit) or ``cancelled`` (a dependency failed; their waiters told)."""

    queued: list[str] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)

    def merge(self, other: Settled) -> Settled:
        self.queued += other.queued
        self.cancelled += other.cancelled
        return self

    def __bool__(self) -> bool:
        return bool(self.queued or self.cancelled)


def _notify(listens: bool, channel: str) -> Step | None:
    """NOTIFY at the commit where the database ``listens`` (a hint, never the only path);
    nothing on SQLite, whose waiters and relays watch the file."""
    if not listens:
        return None
    return (select(func.pg_notify(channel, "")), None)


def finish_steps(listens: bool, ended: Mapping[str, str], now: datetime) -> Steps[Settled]:
    """The jobs of ``ended`` (id -> the state it ended in) ended in this transaction: count
    each edge to them once, and settle the jobs that waited for them (``settle_steps``).

    Run by every transition that ends a job, AFTER the statement that ended it (see the
    module's docstring: the edges of an enqueue that committed while that statement waited
    are visible only to a later one). A job with no dependants costs two indexed statements
    (the lock of what it can reach, the edges' update), each finding nothing."""
    by_state: dict[str, list[str]] = defaultdict(list)
    for job_id, state in ended.items():
        by_state[state].append(job_id)
    for chunk in chunks(sorted(ended)):
        # Every waiting job this end can reach (its dependants, theirs in a cancel's cascade),
        # locked at once in id order before any is counted down: two ends, or an end and an
        # enqueue (which locks waiting jobs in id order too), never wait on each other in a
        # cycle. A job without dependants costs this one indexed read.
        yield (_lock_reachable(chunk), None)
    counts: dict[str, int] = defaultdict(int)
    for state, ids in sorted(by_state.items()):
        for chunk in chunks(sorted(ids)):
            rows = yield (
                update(_deps)
                .where(_deps.c.depends_on.in_(chunk), _deps.c.finished_state.is_(None))
                .values(finished_state=state)
                .returning(_deps.c.job_id),
                None,
            )
            for row in rows.all():
                counts[row.job_id] += 1
    if not counts:
        return Settled()
    # In id order: two transactions settling the same jobs never wait on each other in a cycle.
    for job_id in sorted(counts):
        yield (
            update(jobs)
            .where(jobs.c.id == job_id, jobs.c.state == JobState.WAITING.value)
            .values(waiting_for=jobs.c.waiting_for - counts[job_id]),
            None,
        )
    return (yield from settle_steps(listens, sorted(counts), now))


def _lock_reachable(ended: Sequence[str]) -> Any:
    reach = (
        select(_deps.c.job_id.label("id"))
        .where(_deps.c.depends_on.in_(ended), _deps.c.finished_state.is_(None))
        .cte("reach", recursive=True)
    )
    reach = reach.union(
        select(_deps.c.job_id).where(
            _deps.c.depends_on == reach.c.id, _deps.c.finished_state.is_(None)
        )
    )
    return (
        select(jobs.c.id)
        .where(jobs.c.id.in_(select(reach.c.id)), jobs.c.state == JobState.WAITING.value)
        .order_by(jobs.c.id)
        .with_for_update(key_share=True, of=jobs)
    )


def settle_steps(listens: bool, job_ids: Iterable[str], now: datetime) -> Steps[Settled]:
    """Each ``waiting`` job of ``job_ids`` whose count reached zero becomes ``queued`` with
    its outbox row; one whose dependency failed is ``cancelled`` naming it, unless it was
    written with ``after_failure="run"``. Guarded on ``waiting``: a job an operator
    cancelled meanwhile, or settled already, is left as it is."""
    settled = Settled()
    for job_id in sorted(job_ids):
        row = (
            yield (
                select(
                    jobs.c.state,
                    jobs.c.waiting_for,
                    jobs.c.after_failure,
                    jobs.c.type,
                    jobs.c.queue,
                    jobs.c.run_at,
                ).where(jobs.c.id == job_id),
                None,
            )
        ).first()
        if row is None or row.state != JobState.WAITING.value:
            continue
        failed = None
        if row.after_failure != "run":
            failed = (
                yield (
                    select(_deps.c.depends_on, _deps.c.finished_state)
                    .where(_deps.c.job_id == job_id, _deps.c.finished_state.in_(FAILED_STATES))
                    .order_by(_deps.c.position)
                    .limit(1),
                    None,
                )
            ).first()
        if failed is not None:
            settled.merge(
                (yield from _cancel(listens, job_id, failed.depends_on, failed.finished_state, now))
            )
        elif (row.waiting_for or 0) <= 0:
            yield from _queue(listens, job_id, row, now)
            settled.queued.append(job_id)
    return settled


def _cancel(
    listens: bool, job_id: str, dependency: str, state: str, now: datetime
) -> Steps[Settled]:
    reason = f"dependency {dependency} ended {state}"
    sets = CANCEL.sets(Inputs(now=now, clock=now, req=values_of({})))
    yield (
        update(jobs)
        .where(jobs.c.id == job_id, jobs.c.state == JobState.WAITING.value)
        .values(
            **sets,
            cancel_reason=reason,
            public_error=public_error(DEPENDENCY_FAILED, f"job {dependency} ended {state}"),
        ),
        None,
    )
    yield _event(
        job_id,
        "cancelled",
        now,
        reason=reason,
        previousState=JobState.WAITING.value,
        dependency=dependency,
        dependencyState=state,
    )
    notify = _notify(listens, DONE_CHANNEL)
    if notify is not None:
        yield notify
    # Its own dependants learn of its end as any job's do.
    cascaded = yield from finish_steps(listens, {job_id: JobState.CANCELLED.value}, now)
    return Settled(cancelled=[job_id]).merge(cascaded)


def _queue(listens: bool, job_id: str, row: Any, now: datetime) -> Steps[None]:
    # The trace it was enqueued under (its row's), which its first message carries.
    trace = (yield (select(jobs.c.trace_context).where(jobs.c.id == job_id), None)).scalar()
    yield (
        update(jobs)
        .where(jobs.c.id == job_id, jobs.c.state == JobState.WAITING.value)
        .values(state=JobState.QUEUED.value, updated_at=now),
        None,
    )
    yield (
        insert(outbox).values(
            job_id=job_id,
            destination=work_destination(row.queue),
            body=JobMessage(job_id, row.type).encode().decode(),
            headers=dict(trace or {}),
            created_at=now,
            # A job also given a run time is held until then, as at any enqueue.
            **({"available_at": row.run_at} if row.run_at is not None else {}),
            # Under limits: the row waits for its admission (``storage.admission``).
            awaiting_admission=select(awaiting_admission())
            .where(jobs.c.id == job_id)
            .scalar_subquery(),
        ),
        None,
    )
    counted = (
        yield (
            select(
                func.count(),
                func.count(_deps.c.finished_state).filter(
                    _deps.c.finished_state.in_(FAILED_STATES)
                ),
            ).where(_deps.c.job_id == job_id),
            None,
        )
    ).one()
    yield _event(job_id, "dependencies_met", now, dependencies=counted[0], failed=counted[1])
    notify = _notify(listens, NOTIFY_CHANNEL)
    if notify is not None:
        yield notify


def _event(job_id: str, kind: str, now: datetime, **detail: Any) -> Step:
    return (
        insert(job_events).values(job_id=job_id, at=now, kind=kind, detail=jsonable(detail)),
        None,
    )


def dependency_ids(job_id: str) -> Any:
    """The statement reading the jobs ``job_id`` runs after, in the order given."""
    return select(_deps.c.depends_on).where(_deps.c.job_id == job_id).order_by(_deps.c.position)


__all__ = [
    "CHUNK",
    "FAILED_STATES",
    "Settled",
    "chunks",
    "dependency_ids",
    "finish_steps",
    "settle_steps",
]
