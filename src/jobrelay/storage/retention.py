"""Retention as SQL: what is old enough to delete, deleted in small batches, and the
tombstones that let the API answer 410 for a job that was pruned.

What goes once it is older than the cutoff (``now - JOBRELAY_RETENTION_DAYS`` by the store's
clock, as every other judgement by time):

- ``jobs`` that are ``succeeded`` or ``cancelled`` and finished before the cutoff
  (``finished_at``, stamped by the transition that ended it; migration 0022), with their
  ``job_events``, ``effects_ledger`` and ``outbox`` rows, and their result object unless
  ``JOBRELAY_RETENTION_KEEP_RESULTS``. Each leaves a ``pruned_jobs`` tombstone. Never a job
  in any other state: ``quarantined`` waits for an operator, ``waiting``, ``queued``,
  ``running`` and ``retry_wait`` are still work; nor one that a job written with ``after=``
  and not ended yet still needs (it reads its dependencies when it runs).
- Published ``outbox`` rows of the jobs that stay, except each job's newest row: that one
  still says whether the job's latest message was published (``JobRecord.published``) and
  when the broker confirmed it (the reconciler's ``queued_unclaimed`` judges by it).
- ``local_messages`` in the quarantine queue (dead-lettered: settled by a reject or by the
  delivery limit), by when they were dead-lettered (``dead_lettered_at``), not when they were
  first published: a message sent long ago and rejected a minute ago stays for a whole
  retention period. Rows of the work queues are waiting or in flight and are never touched;
  an acked row is already gone (the ack deletes it).
- ``pruned_jobs`` tombstones older than the cutoff: a pruned job answers 410 for one more
  retention period, then 404 like an id that never existed.

Why batches: every step is its own short transaction over at most ``batch`` rows, so no
transaction holds locks for long and a relay, API or worker waits at most one batch. On
PostgreSQL the victims are picked with ``FOR UPDATE SKIP LOCKED``: a row someone else holds
is left for the next round instead of being waited on. On SQLite a batch is one short
``BEGIN IMMEDIATE``. ``max_rows`` caps one call per table, so one reconciler round stays
bounded; ``PruneCounts.capped`` says more remains.

Result objects are deleted BEFORE their job's rows, outside any transaction (S3 is I/O no
lock should wait on). A crash between the two leaves a past-retention job whose result is
gone: a result read in between answers 410 (result gone), and the next prune deletes the
rows. A result object whose delete fails (the store is down) keeps its job, and ends the
jobs step of this call, for the next round: the key is never forgotten while its object
still exists, and a store that is down is asked once, not once per job. A batch that deleted
fewer jobs than it picked (some were locked, skipped) also ends the step, so a few held rows
are never picked again and again.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import delete, exists, func, insert, select
from sqlalchemy.ext.asyncio import AsyncConnection

from jobrelay.domain.states import UNFINISHED_VALUES, JobState
from jobrelay.errors import TransientError
from jobrelay.results.base import ResultStore
from jobrelay.storage.base import StoreBase
from jobrelay.storage.local_queue import QUARANTINE
from jobrelay.storage.port import StorePort
from jobrelay.storage.tables import (
    effects_ledger,
    job_dependencies,
    job_events,
    jobs,
    local_messages,
    outbox,
    pruned_jobs,
)

log = logging.getLogger("jobrelay.retention")

PRUNABLE = frozenset({JobState.SUCCEEDED, JobState.CANCELLED})
BATCH = 500
MAX_ROWS = 10_000
TABLES = (
    "jobs",
    "job_events",
    "effects_ledger",
    "outbox",
    "local_messages",
    "pruned_jobs",
    "results",
)


@dataclass
class PruneCounts:
    """Rows (and result objects) deleted, or that would be in a dry run, per table."""

    jobs: int = 0
    job_events: int = 0
    effects_ledger: int = 0
    outbox: int = 0
    local_messages: int = 0
    results: int = 0
    pruned_jobs: int = 0  # expired tombstones
    capped: bool = False  # a table reached max_rows: more is left for the next call
    results_failed: int = 0  # result deletes that failed; their jobs wait for the next call

    def tables(self) -> dict[str, int]:
        """Per table (``results``: objects in the result store), in a fixed order."""
        return {name: getattr(self, name) for name in TABLES}

    @property
    def total(self) -> int:
        return sum(self.tables().values())


@dataclass(frozen=True)
class PrunedJob:
    job_id: str
    account_id: str | None
    created_at: datetime
    pruned_at: datetime


def _still_needed() -> Any:
    """A job that a job written with ``after=`` still needs: one that has not ended yet
    reads it (``ctx.dependencies()``) when it runs."""
    dependant = jobs.alias("dependant")
    return exists().where(
        job_dependencies.c.depends_on == jobs.c.id,
        dependant.c.id == job_dependencies.c.job_id,
        dependant.c.state.in_(UNFINISHED_VALUES),
    )


class Retention:
    def __init__(
        self,
        store: StorePort,
        results: ResultStore,
        *,
        keep_results: bool = False,
        batch: int = BATCH,
        max_rows: int = MAX_ROWS,
    ) -> None:
        if batch < 1 or max_rows < 1:
            raise ValueError("batch and max_rows must be at least 1")
        self.store = store
        self.results = results
        self.keep_results = keep_results
        self.batch = batch
        self.max_rows = max_rows

    async def cutoff(self, days: float) -> datetime:
        """``days`` before now by the store's clock: what is older may be pruned."""
        return await self.store.db_now() - timedelta(days=days)

    # --- what is old enough ---------------------------------------------------------------

    @staticmethod
    def _finished_before(cutoff: datetime) -> list[Any]:
        return [StoreBase.state_in(PRUNABLE), jobs.c.finished_at < cutoff, ~_still_needed()]

    @staticmethod
    def _superseded_before(cutoff: datetime) -> list[Any]:
        newer = outbox.alias("newer")
        return [
            outbox.c.published_at.is_not(None),
            outbox.c.published_at < cutoff,
            exists().where(newer.c.job_id == outbox.c.job_id, newer.c.id > outbox.c.id),
        ]

    @staticmethod
    def _dead_letters_before(cutoff: datetime) -> list[Any]:
        # By when it was dead-lettered; a row a process older than migration 0009 moved
        # aside has no such time, and counts from its first publish as before.
        dead_since = func.coalesce(local_messages.c.dead_lettered_at, local_messages.c.created_at)
        return [local_messages.c.queue == QUARANTINE, dead_since < cutoff]

    # --- prune ----------------------------------------------------------------------------

    async def prune(self, cutoff: datetime, *, dry_run: bool = False) -> PruneCounts:
        """Delete everything older than ``cutoff`` (see the module docstring), batch by batch;
        ``dry_run`` counts the same rows and changes nothing."""
        if dry_run:
            return await self.count(cutoff)
        counts = PruneCounts()
        now = await self.store.db_now()
        await self._prune_jobs(cutoff, now, counts)
        superseded = await self._superseded(cutoff)
        counts.outbox += await self._in_batches(counts, outbox, superseded)
        counts.local_messages += await self._in_batches(
            counts, local_messages, self._dead_letters_before(cutoff)
        )
        counts.pruned_jobs += await self._in_batches(
            counts, pruned_jobs, [pruned_jobs.c.pruned_at < cutoff]
        )
        return counts

    async def _superseded(self, cutoff: datetime) -> list[Any]:
        """``_superseded_before(cutoff)``, below the id of the first outbox row written at or
        after ``cutoff``.

        Ids grow with insertion, so every row older than the cutoff lies (give or take the
        few rows written as the cutoff passed, left for a later round) below it. Bounding the
        superseded-row scan by it makes that scan read the old rows only, not the whole
        table; finding it reads the old rows once too (a primary key scan that stops at the
        first young row). No index on ``published_at`` is needed, so the relay's publish
        writes no more index entries than before.
        """
        async with self.store.reading() as conn:
            boundary = await conn.scalar(
                select(outbox.c.id)
                .where(outbox.c.created_at >= cutoff)
                .order_by(outbox.c.id)
                .limit(1)
            )
        where = self._superseded_before(cutoff)
        return where if boundary is None else [*where, outbox.c.id < boundary]

    async def _prune_jobs(self, cutoff: datetime, now: datetime, counts: PruneCounts) -> None:
        while counts.jobs < self.max_rows:
            limit = min(self.batch, self.max_rows - counts.jobs)
            async with self.store.reading() as conn:
                rows = (
                    await conn.execute(
                        select(jobs.c.id, jobs.c.result_key)
                        # No ORDER BY: ``ix_jobs_finished`` answers the range by itself, and
                        # the oldest first is no promise worth a sort.
                        .where(*self._finished_before(cutoff))
                        .limit(limit)
                    )
                ).all()
            if not rows:
                return
            ids = (
                [r.id for r in rows]
                if self.keep_results
                else await self._delete_results(rows, counts)
            )
            deleted = 0
            if ids:
                async with self.store.writing() as conn:
                    deleted = await self._delete_jobs(conn, ids, cutoff, now, counts)
            # Fewer than asked: the last ones. A failed result delete, or rows skipped as
            # locked (they would be picked again and again): the next call.
            if len(rows) < limit or deleted < len(rows):
                return
        counts.capped = True

    async def _delete_results(self, rows: Sequence[Any], counts: PruneCounts) -> list[str]:
        """Delete the result objects of ``rows`` in order; the ids of the jobs whose object is
        gone now (or that had none). The first failure stops it: a result store that is down
        would fail (and time out) the same way for every other object of the batch."""
        done: list[str] = []
        for row in rows:
            if row.result_key is not None:
                try:
                    await self.results.delete(row.result_key)
                except TransientError as exc:
                    counts.results_failed += 1
                    log.warning(
                        "result not deleted, its job and the rest of the batch are kept for "
                        "the next prune: %s",
                        exc,
                        extra={"event": "prune_result_failed", "jobId": row.id},
                    )
                    break
                counts.results += 1
            done.append(row.id)
        return done

    async def _delete_jobs(
        self,
        conn: AsyncConnection,
        ids: list[str],
        cutoff: datetime,
        now: datetime,
        counts: PruneCounts,
    ) -> int:
        """One batch, one transaction: lock the jobs still prunable (skip any row someone
        holds), delete their rows child tables first, leave a tombstone for each. Returns how
        many jobs it deleted."""
        locked = (
            await conn.execute(
                select(jobs.c.id, jobs.c.account_id, jobs.c.created_at)
                .where(jobs.c.id.in_(ids), *self._finished_before(cutoff))
                .with_for_update(skip_locked=True)
            )
        ).all()
        if locked:
            # Read again, now that they are locked: the select's snapshot may predate an
            # enqueue that committed an ``after=`` edge to one of them before the lock (that
            # enqueue locked the row too, but changed nothing the lock would re-check).
            needed = set(
                await conn.scalars(
                    select(jobs.c.id).where(jobs.c.id.in_([r.id for r in locked]), _still_needed())
                )
            )
            locked = [r for r in locked if r.id not in needed]
        if not locked:
            return 0
        victims = [r.id for r in locked]
        await conn.execute(delete(job_dependencies).where(job_dependencies.c.job_id.in_(victims)))
        # The outbox before the events: a relay's mark that holds a row writes its
        # ``published`` event in the same commit, which this delete waits for; the events'
        # delete, a later statement, then sees that event (``job_events`` has no foreign key
        # to keep it from outliving its job, ``storage.tables``).
        result = await conn.execute(delete(outbox).where(outbox.c.job_id.in_(victims)))
        counts.outbox += result.rowcount
        for table, name in ((job_events, "job_events"), (effects_ledger, "effects_ledger")):
            result = await conn.execute(delete(table).where(table.c.job_id.in_(victims)))
            setattr(counts, name, getattr(counts, name) + result.rowcount)
        result = await conn.execute(delete(jobs).where(jobs.c.id.in_(victims)))
        counts.jobs += result.rowcount
        # A job re-created under the same id (a repeated request) and pruned again: newer stone.
        stones = [
            {"id": r.id, "account_id": r.account_id, "created_at": r.created_at, "pruned_at": now}
            for r in locked
        ]
        await conn.execute(delete(pruned_jobs).where(pruned_jobs.c.id.in_(victims)))
        await conn.execute(insert(pruned_jobs), stones)
        return len(victims)

    async def _in_batches(self, counts: PruneCounts, table: Any, where: list[Any]) -> int:
        """Delete rows of ``table`` matching ``where``, ``batch`` per transaction, up to
        ``max_rows``; the victims are locked with SKIP LOCKED inside the DELETE itself."""
        key = table.c.id
        done = 0
        while done < self.max_rows:
            limit = min(self.batch, self.max_rows - done)
            victims = (
                select(key)
                .where(*where)
                .order_by(key)
                .limit(limit)
                .with_for_update(skip_locked=True)
            )
            async with self.store.writing() as conn:
                result = await conn.execute(delete(table).where(key.in_(victims.scalar_subquery())))
            done += result.rowcount
            if result.rowcount < limit:
                return done
        counts.capped = True
        return done

    # --- dry run --------------------------------------------------------------------------

    async def count(self, cutoff: datetime) -> PruneCounts:
        """What ``prune(cutoff)`` would delete now, without the cap, changing nothing."""
        finished = select(jobs.c.id).where(*self._finished_before(cutoff))
        superseded = await self._superseded(cutoff)
        async with self.store.reading() as conn:

            async def n(table: Any, *where: Any) -> int:
                value = await conn.scalar(select(func.count()).select_from(table).where(*where))
                return int(value or 0)

            counts = PruneCounts(
                jobs=await n(jobs, *self._finished_before(cutoff)),
                job_events=await n(job_events, job_events.c.job_id.in_(finished)),
                effects_ledger=await n(effects_ledger, effects_ledger.c.job_id.in_(finished)),
                outbox=await n(outbox, outbox.c.job_id.in_(finished))
                + await n(outbox, ~outbox.c.job_id.in_(finished), *superseded),
                local_messages=await n(local_messages, *self._dead_letters_before(cutoff)),
                results=0
                if self.keep_results
                else await n(jobs, *self._finished_before(cutoff), jobs.c.result_key.is_not(None)),
                pruned_jobs=await n(pruned_jobs, pruned_jobs.c.pruned_at < cutoff),
            )
        return counts

    # --- tombstones -----------------------------------------------------------------------

    async def pruned(self, job_id: str) -> PrunedJob | None:
        """The tombstone of ``job_id`` if retention deleted it (and the stone has not expired)."""
        async with self.store.reading() as conn:
            row = (
                await conn.execute(select(pruned_jobs).where(pruned_jobs.c.id == job_id))
            ).first()
        if row is None:
            return None
        return PrunedJob(row.id, row.account_id, row.created_at, row.pruned_at)


__all__ = ["BATCH", "MAX_ROWS", "PRUNABLE", "PruneCounts", "PrunedJob", "Retention"]
