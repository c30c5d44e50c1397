"""Is a queue moving, and has it moved past a waiting job? The reconciler's evidence.

A ``queued`` job whose message was confirmed long ago is either waiting its turn behind a
backlog, or its message is gone (dead-lettered, purged). Its age alone cannot tell: no
constant grace fits every backlog. What can: the jobs of the same queue published after it.
A broker hands a queue out in order, so while the job's message still waits, at most what
the consuming workers' windows hold (``prefetch`` each) of the later jobs can have been
claimed before it. More than that claimed, the queue has moved past it: the message is gone.

Three facts per queue, each one small indexed query: which live workers consume it (their
heartbeats), whether any of its jobs runs now or was claimed lately, and
the publication times of the later jobs that have been claimed, newest first, up to one past
the windows.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import exists, func, or_, select

from jobrelay.domain.states import JobState
from jobrelay.storage.port import StorePort
from jobrelay.storage.records import aware_time, work_destination
from jobrelay.storage.tables import job_events, jobs, outbox
from jobrelay.storage.tables import process_heartbeats as hb
from jobrelay.storage.transitions import unfinished


@dataclass(frozen=True)
class QueueProgress:
    queue: str
    consumers: int  # live workers consuming it (a recent heartbeat)
    active: bool  # one of its jobs runs now, or was claimed since the grace began
    # The publication time past which more than the windows' worth of later jobs have been
    # claimed; a job whose message was confirmed before it has been passed. None: not yet.
    passed_before: datetime | None

    def moved_past(self, confirmed_at: datetime | None) -> bool:
        return (
            self.passed_before is not None
            and confirmed_at is not None
            and confirmed_at < self.passed_before
        )


async def queue_progress(
    store: StorePort,
    queue: str,
    since: datetime,
    oldest: datetime,
    window: int,
    alive_since: datetime,
) -> QueueProgress:
    """``since``: the start of the grace period; ``oldest``: the earliest confirm time among
    the queue's waiting jobs; ``window``: what one consuming worker may hold unclaimed;
    ``alive_since``: a worker that beat since then is alive."""
    async with store.reading() as conn:
        beats = (
            await conn.execute(
                select(hb.c.queues).where(hb.c.role == "worker", hb.c.last_seen_at >= alive_since)
            )
        ).all()
        consumers = sum(1 for row in beats if queue in [str(q) for q in row.queues or ()])
        # Worked on by a worker: one of its jobs running now, or claimed since ``since``
        # (the events' time index; a repair by the reconciler itself is no sign of work).
        running = exists().where(jobs.c.queue == queue, jobs.c.state == JobState.RUNNING.value)
        claimed = exists().where(
            job_events.c.at >= since,
            job_events.c.kind == "claimed",
            jobs.c.id == job_events.c.job_id,
            jobs.c.queue == queue,
        )
        active = bool(await conn.scalar(select(or_(running, claimed))))
        passed_before: datetime | None = None
        if consumers:
            first_sent = (
                select(func.min(outbox.c.published_at))
                .where(
                    outbox.c.job_id == jobs.c.id, outbox.c.destination == work_destination(queue)
                )
                .scalar_subquery()
            )
            later_claimed = (
                select(first_sent.label("sent"))
                .where(
                    jobs.c.queue == queue,
                    jobs.c.attempt >= 1,
                    jobs.c.state != JobState.QUEUED.value,
                    jobs.c.updated_at >= oldest,  # claimed after its message, so after oldest
                    # The same, said to the indexes (none holds ``updated_at``): claimed since
                    # ``oldest``, it is unfinished or finished since.
                    or_(unfinished(), jobs.c.finished_at >= oldest),
                    first_sent > oldest,
                )
                .order_by(first_sent.desc())
                .limit(consumers * window + 1)
            )
            sent = [aware_time(r.sent) for r in (await conn.execute(later_claimed)).all()]
            if len(sent) > consumers * window:
                passed_before = sent[-1]
    return QueueProgress(queue, consumers, active, passed_before)


__all__ = ["QueueProgress", "queue_progress"]
