"""One lease renewer per worker (issue 23, item 3): every running claim renewed in one fenced
statement, and a lost lease cancels exactly the job whose lease it was.

Hand-driven, on SQLite and PostgreSQL: one worker runs three jobs at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from sqlalchemy import update

from jobrelay.domain.states import JobState
from jobrelay.library.operations import OperationResult
from jobrelay.storage.store import Claim
from jobrelay.storage.tables import jobs

from .ops_fixtures import PERIODS, held_runs
from .test_claims import events_of, job_state, runtime_for


async def test_a_lost_lease_in_a_batch_cancels_only_that_job(
    database_url: str, tmp_path: Path
) -> None:
    """Three jobs run at once and their leases are renewed together (one statement for the
    three). Another claim takes one of them over: the next renewal cancels that run alone
    (``lease_lost``, acked); the other two keep running, are renewed, and succeed at attempt 1."""
    rt = runtime_for(database_url, tmp_path, lease_seconds=1.5)
    store: Any = rt.store
    renew = store.renew_leases
    sizes: list[int] = []

    async def counted(claims: Sequence[Claim], *args: Any) -> set[Claim]:
        sizes.append(len(claims))
        won: set[Claim] = await renew(claims, *args)
        return won

    store.renew_leases = counted
    held = await held_runs(
        rt, lambda ctx: OperationResult(f"exports/{ctx.job.params['period']}.csv", {"rows": 1})
    )
    job_ids, deliveries, runs = held.job_ids, held.deliveries, held.runs
    victim = job_ids[1]
    await held.all_running()
    async with rt.engine.begin() as conn:  # another worker's claim of the victim
        await conn.execute(
            update(jobs).where(jobs.c.id == victim).values(attempt=2, lease_owner="w-thief")
        )
    await asyncio.wait_for(runs[1], timeout=30)  # its run was stopped; the others still run
    assert not runs[0].done() and not runs[2].done()
    held.release.set()
    await asyncio.wait_for(asyncio.gather(*runs), timeout=30)

    lost = await events_of(rt, victim, "lease_lost")
    assert [(e["attempt"], e["currentAttempt"]) for e in lost] == [(1, 2)]
    assert deliveries[1].outcomes == ["ack"]
    for i in (0, 2):
        assert await job_state(rt, job_ids[i]) == (JobState.SUCCEEDED, 1)
        assert deliveries[i].outcomes == ["ack"]
        assert await events_of(rt, job_ids[i], "lease_lost") == []
    assert await events_of(rt, victim, "result_saved") == []
    assert held.operation.runs == {period: 1 for period in PERIODS}
    assert 3 in sizes, sizes  # the three leases went in one statement
    await rt.engine.dispose()
