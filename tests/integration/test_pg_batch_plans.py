"""On PostgreSQL a batch's statements find its jobs by primary key, with or without statistics.

The driver's claim, completion and renewal (``storage.drivers.pg_statements``) name their
jobs by id. On a database never analysed (fresh, or autovacuum late or off, as on the bench
machine) the planner once took the guards' ``state IN (…)`` for a match of the partial index
``ix_jobs_account_unfinished`` and scanned every unfinished job per batch, or scanned the
whole table to join the batch's ids: the no-op drain fell from 3,150 to 1,742 jobs/s with
20,000 jobs queued. The plan is PostgreSQL's own answer, so it is asked here, with the
bench's 20,000 jobs queued and no statistics.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import asyncpg
import pytest
from sqlalchemy import text
from sqlalchemy.dialects.postgresql import asyncpg as asyncpg_dialect

from jobrelay.maintenance.reconcile import Reconciler
from jobrelay.storage import admission
from jobrelay.storage.drivers import pg_statements
from jobrelay.storage.drivers.compiled import CompiledStatement
from tests.integration.api_fixtures import build_runtime
from tests.integration.ops_fixtures import eventually

IDS = [str(uuid.uuid4()) for _ in range(16)]
NOW = datetime(2026, 1, 1, tzinfo=UTC)

CLAIM = {
    "b_ids": IDS[:8],
    "b_types": ["bench.noop"] * 8,
    "b_workers": ["w"] * 8,
    "b_details": ["{}"] * 8,
    "b_seen_states": [None] * 8,
    "b_seen_attempts": [None] * 8,
    "b_alone": [0] * 8,
    "b_now": NOW,
    "b_lease": timedelta(seconds=30),
    "b_slack": timedelta(seconds=1),
    "b_clock": None,
    # The settles riding on the claim (``worker.timeline``), each looked up by id.
    "e_jobs": IDS,
    "e_ats": [NOW] * 16,
    "e_kinds": ["ack_sent"] * 16,
    "e_details": ["{}"] * 16,
}
COMPLETE = {
    "d_ids": IDS[8:],
    "d_attempts": [1] * 8,
    "d_workers": ["w"] * 8,
    "d_keys": [None] * 8,
    "d_metas": ["{}"] * 8,
    "d_values": [None] * 8,
    "d_details": ["{}"] * 8,
    "d_dones": [None] * 8,
    "d_totals": [None] * 8,
    "d_settles": False,
}

STATEMENTS: Mapping[str, tuple[CompiledStatement, dict[str, Any]]] = {
    "claim": (pg_statements.CLAIM_MANY, CLAIM),
    "complete": (pg_statements.COMPLETE_MANY, {**COMPLETE, "b_now": NOW}),
    # A worker's turn: the completions of one batch and the claims of the next.
    "turn": (pg_statements.TURN, {**CLAIM, **COMPLETE}),
    "renew": (
        pg_statements.RENEW_MANY,
        {
            "b_ids": IDS,
            "b_attempts": [1] * 16,
            "b_workers": ["w"] * 16,
            "b_lease": timedelta(seconds=30),
            "b_now": NOW,
            "b_clock": None,
        },
    ),
}


@pytest.mark.parametrize("name", sorted(STATEMENTS))
async def test_a_batch_statement_looks_its_jobs_up_by_id(pg_url: str, name: str) -> None:
    conn = await asyncpg.connect(pg_url)
    try:
        await conn.execute(
            """INSERT INTO jobs (id, type, params, request_hash, state, attempt, max_attempts,
                                 created_at, updated_at)
               SELECT gen_random_uuid()::text, 'bench.noop', '{}', 'h', 'queued', 0, 3,
                      now(), now()
               FROM generate_series(1, 20000)"""
        )
        statement, params = STATEMENTS[name]
        async with conn.transaction():
            rows = await conn.fetch(f"EXPLAIN {statement.sql}", *statement.args(params))
        plan = "\n".join(row[0] for row in rows)
    finally:
        await conn.close()
    assert "ix_jobs_account_unfinished" not in plan, plan
    assert "Seq Scan on jobs" not in plan, plan
    assert "pk_jobs" in plan, plan


async def test_the_relays_claim_reads_no_job_and_no_row_awaiting_admission(pg_url: str) -> None:
    """The relay's outbox claim skips a backlog held for its limits without reading it.

    Old code: the claim judged each waiting row by a lookup of its job (``NOT EXISTS`` over
    ``jobs``); on a database never analysed the planner scanned the unfinished jobs per row,
    240 ms a claim over 1,000 held rows, so a key's freed slot waited behind it. Now the row
    carries ``awaiting_admission`` and the relay's partial index leaves such rows out."""
    conn = await asyncpg.connect(pg_url)
    try:
        await conn.execute(
            """WITH j AS (
                 INSERT INTO jobs (id, type, params, request_hash, state, attempt,
                                   max_attempts, created_at, updated_at, limits, turn_key)
                 SELECT gen_random_uuid()::text, 'bench.bound', '{}', 'h', 'queued', 0, 3,
                        now(), now(), '[]', 'k' || (g % 10)
                 FROM generate_series(1, 5000) AS g
                 RETURNING id)
               INSERT INTO outbox (job_id, destination, body, headers, created_at,
                                   awaiting_admission)
               SELECT id, 'work', '{}', '{}', now(), true FROM j"""
        )
        statement = pg_statements.CLAIM_OUTBOX
        params = {
            "o_relay": "r",
            "o_limit": 256,
            "o_claim_for": timedelta(seconds=30),
            "o_clock": None,
        }
        async with conn.transaction():
            rows = await conn.fetch(
                f"EXPLAIN (ANALYZE, FORMAT JSON) {statement.sql}", *statement.args(params)
            )
    finally:
        await conn.close()
    plan = json.loads(rows[0][0]) if isinstance(rows[0][0], str) else rows[0][0]
    text = json.dumps(plan)
    assert '"Relation Name": "jobs"' not in text, text
    assert "ix_outbox_unpublished" in text, text
    # Rows the claim read from the outbox: none of the 5,000 held ones.
    assert max(_rows_read(plan[0]["Plan"])) < 100, text


# Every job with its rows, as retention deletes them (no foreign key cascades, migration 0023).
_DELETE_JOBS = "DELETE FROM job_events; DELETE FROM outbox; DELETE FROM jobs"


def _rows_read(node: Mapping[str, Any]) -> list[float]:
    """The rows each node of an ``EXPLAIN ANALYZE`` plan produced (with those it removed)."""
    own = float(node.get("Actual Rows", 0)) + float(node.get("Rows Removed by Filter", 0))
    return [own, *(n for child in node.get("Plans", ()) for n in _rows_read(child))]


async def test_the_admissions_ranking_reads_each_waiting_job_once_on_stale_statistics(
    pg_url: str,
) -> None:
    """The admission ranks the waiting jobs with one pass over them, whatever the statistics.

    Old code: when ``VACUUM`` had last seen the tables holding pages but no live row (the
    relay leader's startup ``VACUUM (ANALYZE)`` after a bench's previous sitting, autovacuum
    off or late), ``pg_class.reltuples`` said 0 while the tables held thousands of rows; the
    planner took one waiting row for the estimate and joined ``jobs`` in a nested loop that
    read the whole primary key index per waiting row: 1.3-7.5 s a round in the bench's slow
    sittings, while every key waited. The statistics are made so here, as the bench made
    them, and PostgreSQL's own ``EXPLAIN ANALYZE`` says how many rows the ranking read."""
    waiting = 3000
    conn = await asyncpg.connect(pg_url)
    try:
        await conn.execute(_LIMITED_JOBS, 100)
        await conn.execute(_DELETE_JOBS)
        await conn.execute("VACUUM (TRUNCATE false) jobs, outbox")
        await conn.execute(_LIMITED_JOBS, waiting)
        stats = await conn.fetch(
            "SELECT relname, reltuples FROM pg_class WHERE relname IN ('jobs', 'outbox')"
        )
        assert all(r["reltuples"] == 0 for r in stats), stats  # the stale statistics
        ranking = admission.waiting_ranked(NOW, admission.PER_KEY, 256)
        ranked = await conn.fetch(*_compiled(ranking))
        plans = {
            "ranking": await _explain(conn, ranking),
            "jobs": await _explain(conn, admission.waiting_jobs([r[1] for r in ranked])),
        }
    finally:
        await conn.close()
    assert len(ranked) == 256
    for name, plan in plans.items():
        read = sum(_rows_touched(plan[0]["Plan"]))
        # Each waiting job and its outbox row read about once (a sort and a window pass more).
        assert read < 10 * waiting, (name, json.dumps(plan))


def _compiled(statement: Any) -> tuple[Any, ...]:
    compiled = statement.compile(
        dialect=asyncpg_dialect.dialect(), compile_kwargs={"render_postcompile": True}
    )
    return (compiled.string, *(compiled.params[n] for n in compiled.positiontup or ()))


async def _explain(conn: asyncpg.Connection, statement: Any) -> Any:
    sql, *args = _compiled(statement)
    async with conn.transaction():
        rows = await conn.fetch(f"EXPLAIN (ANALYZE, FORMAT JSON) {sql}", *args)
    return json.loads(rows[0][0]) if isinstance(rows[0][0], str) else rows[0][0]


_LIMITED_JOBS = """
    WITH j AS (
      INSERT INTO jobs (id, type, params, request_hash, state, attempt, max_attempts,
                        created_at, updated_at, limits, turn_key)
      SELECT gen_random_uuid()::text, 'bench.bound', '{}', 'h', 'queued', 0, 3, now(), now(),
             '[{"kind": "concurrency", "limit_id": "c:k", "max": 2}]', 'k' || (g % 10)
      FROM generate_series(1, $1::int) AS g
      RETURNING id)
    INSERT INTO outbox (job_id, destination, body, headers, created_at, awaiting_admission)
    SELECT id, 'work', '{}', '{}', now(), true FROM j"""


def _rows_touched(node: Mapping[str, Any]) -> list[float]:
    """Every row each node of an ``EXPLAIN ANALYZE`` plan produced or removed, over all of its
    loops (a nested loop's inner side counts once per outer row)."""
    loops = float(node.get("Actual Loops", 1))
    own = loops * sum(
        float(node.get(k, 0))
        for k in ("Actual Rows", "Rows Removed by Filter", "Rows Removed by Join Filter")
    )
    return [own, *(n for child in node.get("Plans", ()) for n in _rows_touched(child))]


async def test_the_leader_analyzes_tables_whose_statistics_say_they_are_empty(
    pg_url: str, tmp_path: Path
) -> None:
    """Statistics a ``VACUUM`` took of an empty queue are refreshed by the leader within
    seconds of a burst, so the relay's claim goes back to reading the few unpublished rows.

    Old code: nothing analyzed them until the next prune (a minute) or autovacuum (off on
    the bench machine, a minute's nap when on); meanwhile the claim, planned for a table of
    one row, read every outbox row through the primary key per claim, and a drain of 5,000
    jobs ran at ~360 jobs/s instead of ~1,200."""
    rt = build_runtime(pg_url, tmp_path)
    stop = asyncio.Event()
    task = asyncio.create_task(Reconciler(rt).run(stop))
    try:

        async def stat(query: str) -> Any:
            async with rt.engine.connect() as c:
                return await c.scalar(text(query))

        async def vacuumed() -> bool:
            q = "SELECT vacuum_count FROM pg_stat_user_tables WHERE relname = 'outbox'"
            return bool(await stat(q))

        await eventually(vacuumed, what="the leader's first pass (a prune and a VACUUM)")
        # Then, between two passes, a VACUUM sees the queue with pages and no live row (as
        # autovacuum does between bursts), and a burst arrives.
        conn = await asyncpg.connect(pg_url)
        try:
            await conn.execute(_LIMITED_JOBS, 100)
            await conn.execute(_DELETE_JOBS)
            await conn.execute("VACUUM (TRUNCATE false) jobs, outbox")
            await conn.execute(_LIMITED_JOBS, 3000)
            # Published, as a drained backlog is, but for ten rows a relay would claim now.
            await conn.execute(
                "UPDATE outbox SET awaiting_admission = false,"
                " published_at = CASE WHEN id % 300 = 0 THEN NULL ELSE now() END"
            )
        finally:
            await conn.close()  # its counts reach PostgreSQL's statistics as it ends
        assert sum(_rows_touched(await _claim_plan(pg_url))) > 3000  # the trap, as met

        async def analyzed() -> bool:
            q = "SELECT reltuples FROM pg_class WHERE relname = 'outbox'"
            return bool(await stat(q) > 1000)

        await eventually(analyzed, what="the leader to analyze the outbox")
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
        await rt.engine.dispose()
    plan = await _claim_plan(pg_url)
    assert sum(_rows_touched(plan)) < 500, json.dumps(plan)


async def _claim_plan(pg_url: str) -> Mapping[str, Any]:
    """The relay's claim of 256 rows, as PostgreSQL ran it (rolled back)."""
    statement = pg_statements.CLAIM_OUTBOX
    params = {"o_relay": "r", "o_limit": 256, "o_claim_for": timedelta(seconds=30), "o_clock": None}
    conn = await asyncpg.connect(pg_url)
    try:
        tx = conn.transaction()
        await tx.start()
        rows = await conn.fetch(
            f"EXPLAIN (ANALYZE, FORMAT JSON) {statement.sql}", *statement.args(params)
        )
        await tx.rollback()
    finally:
        await conn.close()
    plan = json.loads(rows[0][0]) if isinstance(rows[0][0], str) else rows[0][0]
    return plan[0]["Plan"]  # type: ignore[no-any-return]
