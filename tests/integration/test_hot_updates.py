"""On PostgreSQL a job's claim is a HOT update: no index entry is written for it.

No index of ``jobs`` holds a column that a transition between unfinished states writes
(migration 0022, ``tests/unit/test_hot_transitions.py`` checks the declarations): the claim,
a renewal and a retry then update the row in place. Before, ``ix_jobs_state_updated`` made
every update of a job a new index entry in every index: 0 of 44,256 updates were HOT in the
no-op drain of 10,000 jobs (issue 41). PostgreSQL's own counters say it here, after jobs
ran through the real relay and worker.
"""

from __future__ import annotations

import asyncpg
import pytest
from pydantic import BaseModel

import jobrelay
from jobrelay.testing import run_jobs

from .ops_fixtures import eventually

pytestmark = pytest.mark.timeout(120)

JOBS = 5  # their rows and their claims fit one page: a claim never finds it full


class Nothing(BaseModel):
    pass


app = jobrelay.App()


@app.job("lab.noop", params=Nothing)
async def noop(ctx: jobrelay.JobContext[Nothing], p: Nothing) -> None:
    return None


async def test_a_claim_writes_no_index_entry(pg_url: str, amqp_url: str) -> None:
    async with run_jobs(app, database_url=pg_url, broker_url=amqp_url) as runner:
        for _ in range(JOBS):
            await app.enqueue("lab.noop", Nothing())
        await runner.drain()
        assert len(await runner.jobs(state=jobrelay.JobState.SUCCEEDED)) == JOBS

    conn = await asyncpg.connect(pg_url.replace("postgresql+asyncpg://", "postgresql://"))
    try:

        async def counters() -> tuple[int, int] | None:
            # The backends report their counts when they end or idle (at most once a second).
            await conn.execute("SELECT pg_stat_clear_snapshot()")
            row = await conn.fetchrow(
                "SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables WHERE relname = 'jobs'"
            )
            assert row is not None
            return (row[0], row[1]) if row[0] >= 2 * JOBS else None

        updated, hot = await eventually(counters, timeout=30, what="the jobs table's counters")
    finally:
        await conn.close()
    # Each job: its claim (HOT) and its completion (not: it stamps ``finished_at``, which
    # retention's index holds). HOT also needs room on the row's page: five rows leave it.
    assert hot >= JOBS, (updated, hot)


async def test_the_database_holds_finished_at_to_the_state(pg_url: str, amqp_url: str) -> None:
    """A writer that ends a job without ``finished_at`` (or re-opens one and keeps it) is
    refused by PostgreSQL (``ck_jobs_finished_when_terminal``): retention and the quota's
    index read it, so a job stamped wrong would be kept, or pruned, for ever."""
    async with run_jobs(app, database_url=pg_url, broker_url=amqp_url) as runner:
        job_id = await app.enqueue("lab.noop", Nothing())
        await runner.drain()
    conn = await asyncpg.connect(pg_url.replace("postgresql+asyncpg://", "postgresql://"))
    try:
        with pytest.raises(asyncpg.CheckViolationError):
            await conn.execute("UPDATE jobs SET state = 'queued' WHERE id = $1", job_id)
        with pytest.raises(asyncpg.CheckViolationError):
            await conn.execute("UPDATE jobs SET finished_at = NULL WHERE id = $1", job_id)
        await conn.execute(
            "UPDATE jobs SET state = 'queued', finished_at = NULL WHERE id = $1", job_id
        )
        with pytest.raises(asyncpg.CheckViolationError):
            await conn.execute("UPDATE jobs SET state = 'cancelled' WHERE id = $1", job_id)
    finally:
        await conn.close()


async def test_no_trigger_runs_for_an_event_or_outbox_row(pg_url: str) -> None:
    """Five event rows and an outbox row are written per job. A foreign key to ``jobs`` is
    checked by a trigger per row that looks the job up and key-share locks it (a third of an
    event row's cost, migration 0023): neither table has one; their writers hold the
    reference (``storage.tables``)."""
    conn = await asyncpg.connect(pg_url.replace("postgresql+asyncpg://", "postgresql://"))
    try:
        triggers = await conn.fetch(
            "SELECT tgrelid::regclass::text AS tab, tgname FROM pg_trigger"
            " WHERE tgrelid IN ('job_events'::regclass, 'outbox'::regclass)"
        )
    finally:
        await conn.close()
    assert [(t["tab"], t["tgname"]) for t in triggers] == []
