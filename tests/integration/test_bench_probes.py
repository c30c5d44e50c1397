"""The bench's completion probes count exactly what the plain counts do, through indexes.

``bench/pipeline_bench.py`` polls every 50 ms while it measures; a probe that reads every
outbox row's body or every job (``published_at IS NULL`` matches none of the relay's partial
indexes; the jobs by state is a full scan) spent the cores under test. The cheap probes must
still be right: an outbox row in each of the relay's states, a job in each state.
"""

from __future__ import annotations

import sys
import uuid
from pathlib import Path

import asyncpg
import pytest

from jobrelay.domain.states import JobState
from jobrelay.storage.engine import create_engine
from jobrelay.storage.store import NewJob, Store

from .api_fixtures import T0

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import pipeline_bench  # the bench is not a package: by path

pytestmark = pytest.mark.postgres

# (published_at, available_at, awaiting_admission) of each outbox row: published, due,
# held for a time, awaiting admission, and held for a time while awaiting admission.
_OUTBOX = [
    ("now()", "NULL", "false"),
    ("NULL", "NULL", "false"),
    ("NULL", "now()", "false"),
    ("NULL", "NULL", "true"),
    ("NULL", "now()", "true"),
]
_UNFINISHED = "SELECT count(*) FROM jobs WHERE finished_at IS NULL"


async def _fill(url: str) -> list[str]:
    store = Store(create_engine(url))
    ids = [str(uuid.uuid4()) for _ in range(len(JobState) + len(_OUTBOX))]
    try:
        for job_id in ids:
            job = NewJob(job_id, "bench.noop", None, {}, job_id, 3)
            await store.submit(job, T0)
    finally:
        await store.engine.dispose()
    return ids


async def test_the_probes_count_what_the_plain_counts_do(pg_url: str) -> None:
    ids = await _fill(pg_url)
    db = await asyncpg.connect(pg_url)
    try:
        for job_id, (published, available, awaiting) in zip(ids, _OUTBOX, strict=False):
            await db.execute(
                f"UPDATE outbox SET published_at = {published}, available_at = {available},"
                f" awaiting_admission = {awaiting} WHERE job_id = $1",
                job_id,
            )
        for job_id, state in zip(ids[len(_OUTBOX) :], JobState, strict=False):
            terminal = state in (JobState.SUCCEEDED, JobState.QUARANTINED, JobState.CANCELLED)
            await db.execute(
                "UPDATE jobs SET state = $2, finished_at = CASE WHEN $3 THEN now() END"
                " WHERE id = $1",
                job_id,
                state.value,
                terminal,
            )
        plain = await db.fetchval("SELECT count(*) FROM outbox WHERE published_at IS NULL")
        assert plain == len(ids) - 1  # every row unpublished but the first
        assert await db.fetchval(pipeline_bench._UNPUBLISHED) == plain
        unfinished = await db.fetchval(
            "SELECT count(*) FROM jobs WHERE state NOT IN ('succeeded', 'quarantined', 'cancelled')"
        )
        assert await db.fetchval(_UNFINISHED) == unfinished
        # Read through the partial indexes, not the tables: the plans name no table scan.
        await db.execute("ANALYZE outbox; ANALYZE jobs")
        for query in (pipeline_bench._UNPUBLISHED, _UNFINISHED):
            await db.execute("SET enable_seqscan = off")  # would the planner have to scan?
            plan = "\n".join(r[0] for r in await db.fetch(f"EXPLAIN {query}"))
            assert "Seq Scan" not in plan, plan
    finally:
        await db.close()
