"""On PostgreSQL the hot statements are planned once per connection, generically (issue 41).

Left to choose (``plan_cache_mode = auto``), PostgreSQL plans a prepared statement afresh
for its first five runs on a connection, and after that for as long as the custom plan looks
cheaper than the generic one. auto_explain showed the batched claim, and every turn run in
its completions' transaction (``report.export``'s, which publish a file), custom-planned
through the whole export drain: about a millisecond of planning a statement. These
statements are written for one plan (a batch of 1 and of 100 alike, ids an index condition
whatever the statistics say), so the held connections and such a transaction ask for it.
Each test reads PostgreSQL's own count of the plans of each prepared statement
(``pg_prepared_statements``) on the connections that ran them.
"""

from __future__ import annotations

from pathlib import Path

import asyncpg
import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import create_async_engine

from jobrelay.storage.engine import async_url
from jobrelay.storage.store import CompleteRequest, Store

from .test_batches import LEASE, ask
from .test_claims import runtime_for, submit

# The batched claim's text, and the completion's (a turn holds both).
_CLAIM = "%asked AS (%"
_COMPLETION = "%d_req AS (%"
_PLANS = (
    "SELECT coalesce(sum(generic_plans), 0), coalesce(sum(custom_plans), 0)"
    " FROM pg_prepared_statements WHERE statement LIKE $1"
)


@pytest.mark.postgres
async def test_the_held_connections_plan_the_batched_claim_once(
    pg_url: str, tmp_path: Path
) -> None:
    """Twelve claims on the worker's held connections: twelve runs of one generic plan, no
    custom one. Old code: the first five runs on each connection at least were planned
    afresh."""
    rt = runtime_for(pg_url, tmp_path)
    try:
        ids = [await submit(rt, period=f"2020-{m:02d}") for m in range(1, 13)]
        async with rt.store.hot_connections():
            for job_id in ids:
                [claimed] = await rt.store.claim_many([ask(job_id)], rt.clock(), LEASE)
                assert claimed is not None
            pool = rt.store.driver.hot._shared.value
            assert isinstance(pool, asyncpg.Pool)
            held = [await pool.acquire() for _ in range(pool.get_size())]
            try:
                plans = [await conn.fetchrow(_PLANS, _CLAIM) for conn in held]
            finally:
                for conn in held:
                    await pool.release(conn)
        assert (sum(p[0] for p in plans), sum(p[1] for p in plans)) == (12, 0)
    finally:
        await rt.engine.dispose()


@pytest.mark.postgres
async def test_a_turn_in_its_completions_transaction_is_planned_once(
    pg_url: str, tmp_path: Path
) -> None:
    """Eight turns whose completion publishes a result, each a write transaction with the
    next claim in it, on one connection: eight runs of one generic plan. Old code: planned
    afresh at least five times (the claims did not ride there then; the completion did)."""
    rt = runtime_for(pg_url, tmp_path)
    engine = create_async_engine(async_url(pg_url), pool_size=1, max_overflow=0)
    store = Store(engine, clock=rt.clock)
    published: list[str] = []
    try:
        ids = [await submit(rt, period=f"2021-{m:02d}") for m in range(1, 10)]
        [first] = await store.claim_many([ask(ids[0])], rt.clock(), LEASE)
        assert first is not None
        claim = first[0]
        for job_id in ids[1:]:

            async def publish(key: str = f"k-{claim.job_id}") -> None:
                published.append(key)

            completion = CompleteRequest(claim, f"k-{claim.job_id}", {}, publish=publish)
            [claimed], done = await store.turn([ask(job_id)], [completion], rt.clock(), LEASE)
            assert done == {claim.job_id} and claimed is not None
            claim = claimed[0]
        async with engine.connect() as conn:
            generic, custom = (
                await conn.execute(text(_PLANS.replace("$1", ":p")), {"p": _COMPLETION})
            ).one()
        assert (generic, custom) == (8, 0)
        assert len(published) == 8
    finally:
        await engine.dispose()
        await rt.engine.dispose()
