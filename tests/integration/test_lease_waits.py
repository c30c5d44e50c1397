"""A lease renewal that has to wait is no lost lease (issue 34, items 1 and 2).

While SQLite's one write lock is held by another connection, or while PostgreSQL's row of one
job is locked by its own completion, nobody can take a claim over either: the renewal of
every other claim must not be lost to it. Hand-driven on the real store: one worker runs
three jobs; the lock is held for three leases; every job then succeeds at attempt 1.
"""

from __future__ import annotations

import asyncio
import dataclasses
import sqlite3
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from sqlalchemy import text

from jobrelay.library.operations import OperationContext, OperationResult
from jobrelay.runtime.wiring import Runtime

from .ops_fixtures import held_runs
from .test_claims import eventually, runtime_for

LEASE = 1.5
HOLD = 3


async def _three_jobs_through(
    rt: Runtime, held_lock: Callable[[list[str], Callable[[], Awaitable[None]]], Awaitable[None]]
) -> list[str]:
    """Run three jobs, held until ``held_lock`` (given the job ids and a wait for a renewal
    to be under way) has held its lock and let it go; then every job must succeed at
    attempt 1 with no lost lease."""
    held = await held_runs(rt)
    runs = held.runs
    await held.all_running()
    renewer = held.worker.deliveries.leases

    async def renewal_under_way() -> None:
        sent = renewer.statements
        await eventually(lambda: asyncio.sleep(0, renewer.statements > sent), "a renewal")
        # The scenario itself: the lock stays held three leases long, well past every
        # lease's end and every renewal's former client timeout.
        await asyncio.sleep(HOLD * LEASE)
        assert not any(run.done() for run in runs), "a run was stopped while the lock was held"

    await held_lock(held.job_ids, renewal_under_way)
    # The lock is free: the next renewal's answer (not a client timeout) decides.
    after = renewer.statements

    async def renewed_since() -> bool:
        return renewer.statements > after or any(run.done() for run in runs)

    await eventually(renewed_since, "a renewal after the lock")
    assert not any(run.done() for run in runs), "a run was stopped once the lock was let go"
    await held.all_succeed()
    return held.job_ids


async def test_sqlite_write_lock_held_past_the_lease_loses_no_claim(
    sqlite_url: str, tmp_path: Path
) -> None:
    """Another connection holds the write lock (BEGIN IMMEDIATE: the application's long
    transaction) for three leases while three jobs run: the renewal waits for the lock
    instead of giving their leases up, and all three succeed at attempt 1."""
    rt = runtime_for(sqlite_url, tmp_path, lease_seconds=LEASE)
    path = sqlite_url.removeprefix("sqlite:///")

    async def held_lock(job_ids: list[str], wait: Callable[[], Awaitable[None]]) -> None:
        # Blocking calls, so off the loop: a worker's write transaction open at that moment
        # must be able to commit meanwhile; and SQLite's own 30 s, not the 5 s default.
        other = sqlite3.connect(path, timeout=30, isolation_level=None, check_same_thread=False)
        try:
            await asyncio.to_thread(other.execute, "BEGIN IMMEDIATE")
            await wait()
            await asyncio.to_thread(other.execute, "ROLLBACK")
        finally:
            other.close()

    await _three_jobs_through(rt, held_lock)
    await rt.engine.dispose()


async def test_postgres_one_locked_row_holds_up_no_other_renewal(
    pg_url: str, tmp_path: Path
) -> None:
    """One job's row stays locked (as its completion holds it) for three leases while all
    three run: the renewal skips that row instead of waiting on it; its neighbours keep their
    leases, the locked one is not lost either, and all three succeed at attempt 1."""
    rt = runtime_for(pg_url, tmp_path, lease_seconds=LEASE)

    async def held_lock(job_ids: list[str], wait: Callable[[], Awaitable[None]]) -> None:
        async with rt.engine.connect() as conn, conn.begin():
            locked: Any = await conn.execute(
                text("SELECT id FROM jobs WHERE id = :id FOR NO KEY UPDATE"), {"id": job_ids[1]}
            )
            assert locked.scalar_one() == job_ids[1]
            await wait()

    await _three_jobs_through(rt, held_lock)
    await rt.engine.dispose()


class _SlowPublish:
    """The runtime's results, whose publication (inside the fenced completion, under the
    job's row lock on PostgreSQL, the write lock on SQLite) waits until ``gate`` is set:
    a completion that holds its lock as long as the test says."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.entered = asyncio.Event()
        self.gate = asyncio.Event()

    def writer(self, key: str, *, staged: bool = False, attempt: int | None = None) -> Any:
        return _SlowSession(self, self._inner.writer(key, staged=staged, attempt=attempt))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class _SlowSession:
    def __init__(self, owner: _SlowPublish, inner: Any) -> None:
        self._owner = owner
        self._inner = inner

    async def __aenter__(self) -> Any:
        return await self._inner.__aenter__()

    async def __aexit__(self, *exc: object) -> None:
        await self._inner.__aexit__(*exc)

    async def publish(self) -> None:
        self._owner.entered.set()
        await self._owner.gate.wait()
        await self._inner.publish()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


async def test_a_completion_holding_its_lock_past_the_lease_costs_no_neighbour_its_lease(
    database_url: str, tmp_path: Path
) -> None:
    """One job's completion holds its lock (a slow result store's publication) for three
    leases while its two neighbours run: they keep their leases, and all three succeed at
    attempt 1 with no lost lease."""
    rt = runtime_for(database_url, tmp_path, lease_seconds=LEASE)
    slow = _SlowPublish(rt.results)
    rt = dataclasses.replace(rt, results=slow)

    async def writes(ctx: OperationContext) -> OperationResult:
        key = f"exports/acme/{ctx.job.id}.csv"
        async with ctx.results.writer(key) as out:
            await out.write(b"entry_id,amount\r\n")
        return OperationResult(key, {"rows": 0})

    held = await held_runs(rt, steps={"2020-02": writes})
    runs = held.runs
    await asyncio.wait_for(slow.entered.wait(), 30)  # the completion holds its lock now
    renewer = held.worker.deliveries.leases
    neighbours = [runs[0], runs[2]]

    async def renewed_since(count: int) -> bool:
        return renewer.statements > count or any(run.done() for run in neighbours)

    sent = renewer.statements
    await eventually(lambda: renewed_since(sent), "a renewal while the lock is held")
    await asyncio.sleep(HOLD * LEASE)  # the scenario: the lock held three leases long
    assert not any(run.done() for run in neighbours), "a neighbour stopped behind the lock"
    slow.gate.set()
    await asyncio.wait_for(runs[1], 30)
    after = renewer.statements
    await eventually(lambda: renewed_since(after), "a renewal after the lock")
    assert not any(run.done() for run in neighbours), "a neighbour stopped after the lock"
    await held.all_succeed()
    await rt.engine.dispose()
