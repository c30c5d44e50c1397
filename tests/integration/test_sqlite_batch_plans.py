"""On SQLite a batch's statements find its jobs by primary key, whatever else is queued.

The batched claim, completion and renewal (``storage.drivers.sqlite_statements``) join the
jobs to the batch's JSON array (``json_each``). Without statistics SQLite's planner takes the
guard's ``state IN (…)`` for the better index and then reads every queued (or running) job once per
request of the batch: measured at 19 ms for a batch of 15 with 3,000 jobs queued, the
embedded default's largest cost. The plan is SQLite's own answer, so it is checked here on a
migrated database, with no statistics, as ``jobrelay up`` has after ``db upgrade``.
"""

from __future__ import annotations

import sqlite3
from typing import Any

import pytest
from sqlalchemy.dialects import sqlite

from jobrelay.storage.drivers import sqlite_statements

STATEMENTS = {
    "states": sqlite_statements.STATES,
    "claim": sqlite_statements.CLAIM_MANY,
    "complete": sqlite_statements.COMPLETE_MANY,
    "renew": sqlite_statements.RENEW_MANY,
}


def _plan(path: str, statement: Any) -> list[str]:
    compiled = statement.compile(dialect=sqlite.dialect())
    sql = str(compiled).split("RETURNING")[0]  # EXPLAIN QUERY PLAN of the search itself
    with sqlite3.connect(path) as db:
        rows = db.execute(f"EXPLAIN QUERY PLAN {sql}", ["[]"] * sql.count("?")).fetchall()
    return [str(row[3]) for row in rows]


@pytest.mark.parametrize("name", sorted(STATEMENTS))
def test_a_batch_statement_looks_its_jobs_up_by_id(sqlite_url: str, name: str) -> None:
    """Old form (the guards' ``jobs.state`` left open to index choice): the claim and the
    completion searched ``ix_jobs_state_updated`` and scanned the batch per job."""
    plan = _plan(sqlite_url.removeprefix("sqlite:///"), STATEMENTS[name])
    jobs_steps = [step for step in plan if " jobs " in f" {step} "]
    assert jobs_steps, plan
    assert all("USING INDEX sqlite_autoindex_jobs_1 (id=?)" in step for step in jobs_steps), plan
    assert plan[0].startswith("SCAN json_each"), plan
