"""The bench's completion probes count exactly what the plain counts do, through indexes.

``bench/pipeline_bench.py`` and ``bench/embedded_bench.py`` poll every 50 ms while they
measure (``bench/bench_probes.py``, which imports no application: a bench's job types would
otherwise join this test process's registry). A probe that reads every outbox row's body or
every job (``published_at IS NULL`` matches none of the relay's partial indexes; the jobs by
state is a full scan) spent the cores under test. The cheap probes must still be right: an
outbox row in each of the relay's states, a job in each state, on the partial indexes they
were written for.
"""

from __future__ import annotations

import sqlite3
import sys
import uuid
from pathlib import Path

import asyncpg
import pytest

from jobrelay.domain.states import TERMINAL_STATES, JobState
from jobrelay.storage.engine import create_engine
from jobrelay.storage.store import NewJob, Store

from .api_fixtures import T0

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import bench_probes  # the bench is not a package: by path

# (published_at, available_at, awaiting_admission) of each outbox row: published, due,
# held for a time, awaiting admission, and held for a time while awaiting admission.
_OUTBOX = [
    ("now()", "NULL", "false"),
    ("NULL", "NULL", "false"),
    ("NULL", "now()", "false"),
    ("NULL", "NULL", "true"),
    ("NULL", "now()", "true"),
]


async def _fill(url: str) -> list[str]:
    """A job per outbox case and per state, each moved there as its store would write it."""
    store = Store(create_engine(url))
    ids = [str(uuid.uuid4()) for _ in range(len(_OUTBOX) + len(JobState))]
    try:
        for job_id in ids:
            await store.submit(NewJob(job_id, "bench.noop", None, {}, job_id, 3), T0)
    finally:
        await store.engine.dispose()
    return ids


def _states(ids: list[str]) -> list[tuple[str, str, bool]]:
    return [
        (job_id, state.value, state in TERMINAL_STATES)
        for job_id, state in zip(ids[len(_OUTBOX) :], JobState, strict=True)
    ]


@pytest.mark.postgres
async def test_the_pipeline_probes_count_what_the_plain_counts_do(pg_url: str) -> None:
    ids = await _fill(pg_url)
    db = await asyncpg.connect(pg_url)
    try:
        for job_id, (published, available, awaiting) in zip(ids, _OUTBOX, strict=False):
            await db.execute(
                f"UPDATE outbox SET published_at = {published}, available_at = {available},"
                f" awaiting_admission = {awaiting} WHERE job_id = $1",
                job_id,
            )
        for job_id, state, terminal in _states(ids):
            await db.execute(
                "UPDATE jobs SET state = $2, finished_at = CASE WHEN $3 THEN now() END"
                " WHERE id = $1",
                job_id,
                state,
                terminal,
            )
        plain = await db.fetchval("SELECT count(*) FROM outbox WHERE published_at IS NULL")
        assert plain == len(ids) - 1  # every row unpublished but the first
        assert await db.fetchval(bench_probes.UNPUBLISHED) == plain
        unfinished = sum(not terminal for _, _, terminal in _states(ids)) + len(_OUTBOX)
        assert await db.fetchval(bench_probes.UNFINISHED) == unfinished
        # Through the partial indexes: with table scans priced out, a probe that no partial
        # index serves would read a whole index (the primary key) instead, named here.
        await db.execute("ANALYZE outbox; ANALYZE jobs; SET enable_seqscan = off")
        for query, indexes in (
            (
                bench_probes.UNPUBLISHED,
                {"ix_outbox_unpublished", "ix_outbox_delayed", "ix_outbox_awaiting"},
            ),
            (bench_probes.UNFINISHED, {"ix_jobs_account_unfinished"}),
        ):
            plan = "\n".join(r[0] for r in await db.fetch(f"EXPLAIN {query}"))
            used = {word for word in plan.replace("(", " ").split() if word.startswith("ix_")}
            assert used == indexes, plan
            assert "Seq Scan" not in plan and "pk_" not in plan, plan
    finally:
        await db.close()


async def test_the_embedded_probe_counts_by_state_only_once_all_have_finished(
    sqlite_url: str,
) -> None:
    ids = await _fill(sqlite_url)
    path = Path(sqlite_url.removeprefix("sqlite:///"))
    with sqlite3.connect(path) as db:
        for job_id, state, terminal in _states(ids):
            db.execute(
                "UPDATE jobs SET state = ?, finished_at = CASE WHEN ? THEN '2026-01-01' END"
                " WHERE id = ?",
                (state, terminal, job_id),
            )
    unfinished = sum(not terminal for _, _, terminal in _states(ids)) + len(_OUTBOX)
    assert bench_probes.sqlite_succeeded(path, by_state=False) == (0, 0, unfinished)
    assert bench_probes.sqlite_succeeded(path) == (1, 1, unfinished)  # a look for a quarantine
    with sqlite3.connect(path) as db:
        db.execute("UPDATE jobs SET state = 'succeeded', finished_at = '2026-01-01'")
    assert bench_probes.sqlite_succeeded(path, by_state=False) == (len(ids), 0, 0)
