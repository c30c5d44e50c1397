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

import uuid
from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg
import pytest

from jobrelay.storage.drivers import pg_statements
from jobrelay.storage.drivers.compiled import CompiledStatement

IDS = [str(uuid.uuid4()) for _ in range(16)]
NOW = datetime(2026, 1, 1, tzinfo=UTC)

STATEMENTS: Mapping[str, tuple[CompiledStatement, dict[str, Any]]] = {
    "claim": (
        pg_statements.CLAIM_MANY,
        {
            "b_ids": IDS,
            "b_types": ["bench.noop"] * 16,
            "b_workers": ["w"] * 16,
            "b_details": ["{}"] * 16,
            "b_seen_states": [None] * 16,
            "b_seen_attempts": [None] * 16,
            "b_alone": [0] * 16,
            "b_now": NOW,
            "b_lease": timedelta(seconds=30),
            "b_slack": timedelta(seconds=1),
            "b_clock": None,
        },
    ),
    "complete": (
        pg_statements.COMPLETE_MANY,
        {
            "b_ids": IDS,
            "b_attempts": [1] * 16,
            "b_workers": ["w"] * 16,
            "b_keys": [None] * 16,
            "b_metas": ["{}"] * 16,
            "b_details": ["{}"] * 16,
            "b_now": NOW,
        },
    ),
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
