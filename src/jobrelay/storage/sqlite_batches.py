"""The batched claims and completions on SQLite: one write transaction per batch.

``batches`` sends a batch as one statement over arrays on PostgreSQL. SQLite has no arrays,
and no network to save round trips on: what costs there is the commit (the write lock
taken and given back; at ``synchronous=NORMAL`` in WAL no fsync per commit, as for every
write there) and the Python per statement. So a batch is ONE write transaction of few
statements: three for a batch of claims, two for a batch of completions. The guards are the
policy's (``claims``: ``claimable``, ``fenced``), row by row, with the same events and the
same answers as the PostgreSQL statements: each job wins or loses on its own.

A row that cannot be stored fails the transaction, all of it rolled back, with a
``StoreDataError``: the worker's batcher then sends each request alone, so only that job
fails. Nothing of a batch is acked before it has committed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Text, and_, case, insert, literal, or_, select, update

from jobrelay.domain.states import JobState
from jobrelay.storage.claims import fenced
from jobrelay.storage.hot_path import COMPLETABLE, HotPathStore, result_saved_detail
from jobrelay.storage.records import Claim, JobRecord, job_record, jsonable
from jobrelay.storage.storable import outcome_json
from jobrelay.storage.tables import job_events, jobs


@dataclass(frozen=True)
class ClaimRequest:
    job_id: str
    job_type: str
    worker_id: str
    detail: dict[str, Any]


@dataclass(frozen=True)
class CompleteRequest:
    claim: Claim
    result_key: str | None
    result_meta: dict[str, Any]


class SqliteBatches(HotPathStore):
    async def _claim_many_sqlite(
        self, requests: Sequence[ClaimRequest], now: datetime, lease: timedelta
    ) -> list[tuple[Claim, JobRecord, JobState] | None]:
        """The batch's claims in one transaction of three statements: the states the jobs
        leave, ONE guarded ``UPDATE … WHERE id IN (…) RETURNING`` per claiming worker (one:
        a batch is one worker's), and their ``claimed`` events in one insert.

        The guard is ``claimable`` per row, as ``claim_delivered``'s; under ``BEGIN
        IMMEDIATE`` nothing else writes between the read and the update."""
        wanted = {(r.job_id, r.job_type) for r in requests}
        asked = {r.job_id: r for r in requests}
        won: dict[str, Any] = {}
        async with self.writing() as conn:
            found = await conn.execute(
                select(jobs.c.id, jobs.c.type, jobs.c.state).where(jobs.c.id.in_(list(asked)))
            )
            left = {row.id: row.state for row in found if (row.id, row.type) in wanted}
            for worker in {asked[job_id].worker_id for job_id in left}:
                mine = [job_id for job_id in left if asked[job_id].worker_id == worker]
                claimed = await conn.execute(
                    update(jobs)
                    .where(jobs.c.id.in_(mine), *self.claimable())
                    .values(**self.claim_values(worker, now, lease))
                    .returning(*jobs.c)
                )
                won.update((row.id, row) for row in claimed)
            if won:
                await conn.execute(
                    insert(job_events),
                    [
                        {
                            "job_id": job_id,
                            "at": now,
                            "kind": "claimed",
                            "detail": jsonable(
                                {
                                    "worker": asked[job_id].worker_id,
                                    "attempt": int(row.attempt),
                                    **asked[job_id].detail,
                                }
                            ),
                        }
                        for job_id, row in won.items()
                    ],
                )
        results: list[tuple[Claim, JobRecord, JobState] | None] = []
        for request in requests:
            row = won.get(request.job_id)
            if row is None:
                results.append(None)
                continue
            job = job_record(row)
            claim = Claim(job.id, job.attempt, request.worker_id)
            results.append((claim, job, JobState(left[request.job_id])))
        return results

    async def _complete_many_sqlite(
        self, requests: Sequence[CompleteRequest], now: datetime
    ) -> set[str]:
        """The batch's completions in one transaction of two statements: ONE update fenced
        per row (``fenced`` of each claim; each row's key and meta its own, by ``CASE``),
        ``RETURNING`` the jobs whose completion won, and their ``result_saved`` events in
        one insert.

        Every row is checked (``outcome_json``) before the transaction begins; a value the
        driver still refuses (a lone surrogate in a key) rolls the whole batch back with a
        ``StoreDataError``, and the batcher then sends each request alone, so only that job
        fails."""
        for r in requests:
            outcome_json(r.result_key, r.result_meta)
        by_id = {r.claim.job_id: r for r in requests}
        meta = jobs.c.result_meta.type
        done = (
            update(jobs)
            .where(
                jobs.c.id.in_(list(by_id)),
                self.state_in(COMPLETABLE),
                # Each row on its own claim: the policy's fence, per job.
                or_(*(and_(jobs.c.id == r.claim.job_id, *fenced(r.claim)) for r in requests)),
            )
            .values(
                state=JobState.SUCCEEDED.value,
                updated_at=now,
                result_key=case(
                    *((jobs.c.id == i, literal(r.result_key, Text())) for i, r in by_id.items()),
                    else_=jobs.c.result_key,
                ),
                result_meta=case(
                    *((jobs.c.id == i, literal(r.result_meta, meta)) for i, r in by_id.items()),
                    else_=jobs.c.result_meta,
                ),
                lease_owner=None,
                lease_expires_at=None,
                last_error=None,
            )
            .returning(jobs.c.id)
        )
        async with self.writing() as conn:
            ids = {row.id for row in await conn.execute(done)}
            won = [r for r in requests if r.claim.job_id in ids]
            if won:
                await conn.execute(
                    insert(job_events),
                    [
                        {
                            "job_id": r.claim.job_id,
                            "at": now,
                            "kind": "result_saved",
                            "detail": jsonable(
                                result_saved_detail(r.claim, r.result_key, r.result_meta)
                            ),
                        }
                        for r in won
                    ],
                )
        return {r.claim.job_id for r in won}


__all__ = ["ClaimRequest", "CompleteRequest", "SqliteBatches"]
