"""The SQL behind operator actions and views, each a named method on ``AdminQueries`` (the
reconciler's repairs are ``repairs.py``).

The same rules as ``Store`` (whose transaction helpers this reuses): every state change is a
guarded ``UPDATE … WHERE state IN (:legal sources)`` from ``domain.states`` (``by="operator"``
for replay and cancel), writes its event in the same transaction, and a message it needs is
an outbox row in that same transaction. A repair or an action that loses its guard changes
nothing and says so; a finished job is never overwritten.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import delete, func, select

from jobrelay.domain.states import JobState, sources_for
from jobrelay.observe.tracing import trace_id_of
from jobrelay.storage.base import first_message_headers
from jobrelay.storage.delayed import drop_held, due_since, waiting_due
from jobrelay.storage.port import StorePort
from jobrelay.storage.store import JobRecord, aware_time, job_record
from jobrelay.storage.tables import jobs, local_messages, pruned_jobs
from jobrelay.storage.transitions import CANCEL, REPLAY, in_states

OPERATOR = "operator"


@dataclass(frozen=True)
class ActionOutcome:
    """What an operator action did: ``done``, or why not (``state`` is the job's state then)."""

    job_id: str
    done: bool
    state: JobState | None  # None: no such job
    previous_state: JobState | None = None
    # A cancel of a running job is a request (``storage.cancels``): recorded, not yet done.
    requested: bool = False


@dataclass(frozen=True)
class QueuedMessage:
    headers: dict[str, Any]
    body: bytes
    id: int = 0  # the local transport's row id


class AdminQueries:
    def __init__(self, store: StorePort) -> None:
        self.store = store

    # --- operator actions -----------------------------------------------------------------

    async def replay(
        self,
        job_id: str,
        *,
        actor: str,
        reason: str,
        budget: int | Callable[[str], int],
        now: datetime,
        headers: dict[str, str] | None = None,
    ) -> ActionOutcome:
        """quarantined -> queued with ``budget`` more attempts, and a new work message.

        ``attempt`` keeps counting (attempt 3 is still attempt 3 in the timeline); the budget
        becomes ``attempt + budget``. A callable is asked with the job's type (the type's own
        ``max_attempts``), read in the same transaction as the row it replays.
        """
        store = self.store
        async with store.writing() as conn:
            row = (
                await conn.execute(
                    select(
                        jobs.c.state,
                        jobs.c.type,
                        jobs.c.queue,
                        jobs.c.attempt,
                        jobs.c.quarantine_reason,
                    )
                    .where(jobs.c.id == job_id)
                    .with_for_update(key_share=True)  # FOR NO KEY UPDATE: see ``cancel``
                )
            ).first()
            if row is None:
                return ActionOutcome(job_id, False, None)
            state = JobState(row.state)
            granted = budget(row.type) if callable(budget) else budget
            won = await store.transition(
                conn,
                job_id,
                REPLAY,
                now,
                sources=sources_for(JobState.QUEUED, by=OPERATOR),
                granted=granted,
            )
            if not won:
                return ActionOutcome(job_id, False, state)
            await store.next_message(conn, job_id, row.type, row.queue, now, headers=headers)
            await store.add_event(
                conn,
                job_id,
                "replayed",
                now,
                actor=actor,
                reason=reason,
                previousReason=row.quarantine_reason,
                attempt=row.attempt,
                maxAttempts=row.attempt + granted,
            )
        store.wake_relays()
        return ActionOutcome(job_id, True, JobState.QUEUED, state)

    async def cancel(self, job_id: str, *, actor: str, reason: str, now: datetime) -> ActionOutcome:
        """waiting | queued | retry_wait | quarantined -> cancelled; later deliveries are acked
        unworked, and a delayed job's held message is deleted before it is ever published."""
        store = self.store
        async with store.writing() as conn:
            # FOR NO KEY UPDATE, as the worker's batches lock jobs: a state-less event
            # key-share locks its job (``RECORD_MANY``), which a plain FOR UPDATE would wait
            # for. (While ``published`` events had a foreign key, the relay's mark held the
            # outbox row and then key-share locked the job, and a FOR UPDATE here deadlocked
            # with the held row's DELETE below at the due time.)
            current = await conn.scalar(
                select(jobs.c.state).where(jobs.c.id == job_id).with_for_update(key_share=True)
            )
            if current is None:
                return ActionOutcome(job_id, False, None)
            state = JobState(current)
            won = await store.transition(
                conn, job_id, CANCEL, now, sources=sources_for(JobState.CANCELLED, by=OPERATOR)
            )
            if not won:
                return ActionOutcome(job_id, False, state)
            # A delayed job's message is still held: drop it, so none is ever published.
            held = await drop_held(conn, job_id)
            await store.add_event(
                conn,
                job_id,
                "cancelled",
                now,
                actor=actor,
                reason=reason,
                previousState=state.value,
                **({"heldMessagesDropped": held} if held else {}),
            )
        store.wake_relays()  # a slot it held is free: the key's next job need not wait
        return ActionOutcome(job_id, True, JobState.CANCELLED, state)

    async def find_jobs(
        self,
        *,
        state: JobState | None = None,
        reason: str | None = None,
        job_type: str | None = None,
        account_id: str | None = None,
        queue: str | None = None,
        limit: int = 100,
    ) -> list[JobRecord]:
        """Newest first. ``reason`` matches part of the quarantine reason or the last error,
        ignoring case."""
        query = self.store.job_query().order_by(jobs.c.created_at.desc(), jobs.c.id).limit(limit)
        if state is not None:
            query = query.where(*in_states([state]))
        if job_type is not None:
            query = query.where(jobs.c.type == job_type)
        if account_id is not None:
            query = query.where(jobs.c.account_id == account_id)
        if queue is not None:
            query = query.where(jobs.c.queue == queue)
        if reason:
            text = reason.lower()
            query = query.where(
                func.lower(func.coalesce(jobs.c.quarantine_reason, jobs.c.last_error, "")).contains(
                    text, autoescape=True
                )
            )
        async with self.store.reading() as conn:
            rows = (await conn.execute(query)).all()
        return [job_record(r) for r in rows]

    async def stored_types(self) -> set[str]:
        """Every job type that has a job in the database."""
        async with self.store.reading() as conn:
            return set((await conn.scalars(select(jobs.c.type).distinct())).all())

    async def trace_id(self, job_id: str) -> str | None:
        """The trace id the job was enqueued under (``jobs.trace_context``)."""
        async with self.store.reading() as conn:
            headers = await conn.scalar(select(jobs.c.trace_context).where(jobs.c.id == job_id))
            if headers is None:  # written before migration 0020: its messages carry it
                headers = await conn.scalar(first_message_headers(job_id))
        return trace_id_of(headers)

    # --- metrics --------------------------------------------------------------------------

    async def outbox_stats(self) -> tuple[int, datetime | None]:
        """How many outbox rows wait, and since when the oldest of them has been due (a
        delayed job's row not yet due is not waiting: it is not counted)."""
        async with self.store.reading() as conn:
            row = (
                await conn.execute(
                    select(func.count(), func.min(due_since())).where(
                        waiting_due(self.store.now_sql())
                    )
                )
            ).one()
        return int(row[0] or 0), aware_time(row[1])

    async def local_queue_messages(self, queue: str, limit: int) -> list[QueuedMessage]:
        """Messages in one queue of the database-backed local transport (read only)."""
        query = (
            select(local_messages.c.id, local_messages.c.headers, local_messages.c.body)
            .where(local_messages.c.queue == queue)
            .order_by(local_messages.c.id)
            .limit(limit)
        )
        async with self.store.reading() as conn:
            rows = (await conn.execute(query)).all()
        return [QueuedMessage(dict(r.headers or {}), str(r.body).encode(), r.id) for r in rows]

    async def delete_local_messages(self, queue: str, ids: list[int]) -> int:
        """Remove these rows of one local queue (the quarantine purge); rows gone already
        (another purge) are not counted."""
        if not ids:
            return 0
        async with self.store.writing() as conn:
            result = await conn.execute(
                delete(local_messages).where(
                    local_messages.c.queue == queue, local_messages.c.id.in_(ids)
                )
            )
        return int(result.rowcount or 0)

    async def pruned_of(self, job_ids: list[str]) -> set[str]:
        """Which of these jobs were deleted by retention (their tombstone is still kept)."""
        if not job_ids:
            return set()
        async with self.store.reading() as conn:
            rows = await conn.execute(
                select(pruned_jobs.c.id).where(pruned_jobs.c.id.in_(sorted(set(job_ids))))
            )
            return {r.id for r in rows}


__all__ = ["OPERATOR", "ActionOutcome", "AdminQueries", "QueuedMessage"]
