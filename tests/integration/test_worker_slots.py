"""The broker window is not the concurrency (issue 23, item 1).

A worker holds up to ``prefetch`` deliveries but starts at most ``concurrency`` of them per
queue, and claims a job only when it starts it: the rest wait unclaimed, so a worker that
dies never spends an attempt of a job it had not started. On SQLite + the local transport
and on PostgreSQL + RabbitMQ (``backend``). Jobs are held by this module's own job type,
which waits on an event the test sets: nothing here depends on a job being slow.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections import defaultdict
from typing import Any

import pytest
from pydantic import BaseModel
from sqlalchemy import select

import jobrelay
from jobrelay.domain.states import JobState
from jobrelay.runtime.wiring import build_transport
from jobrelay.storage.tables import jobs
from jobrelay.worker.consumer import Worker

from .ops_fixtures import eventually

pytestmark = pytest.mark.timeout(120)

app = jobrelay.App()
gates: defaultdict[str, asyncio.Event] = defaultdict(asyncio.Event)
JOBS = 6
CONCURRENCY = 2


class Hold(BaseModel):
    name: str


@app.job("test.slot_hold", params=Hold, max_attempts=1)
async def hold(ctx: jobrelay.JobContext[Hold], params: Hold) -> None:
    await gates[params.name].wait()


async def test_a_worker_runs_and_claims_no_more_than_its_concurrency(make_pipeline: Any) -> None:
    gates.clear()
    async with make_pipeline(
        prefetch="10",
        concurrency=str(CONCURRENCY),
        lease_seconds="10",
        visibility_seconds="10",
        reconcile_seconds="0",
    ) as p:
        rt = p.rt
        p.start_relay()
        transport = build_transport(rt.settings, rt.engine, rt.clock)
        await transport.connect()
        p.worker_transports.append(transport)
        worker = Worker(
            dataclasses.replace(rt, transport=transport), registry=app.registry(rt.settings)
        )
        stop = asyncio.Event()
        p.stops.append(stop)
        p.workers.append(asyncio.create_task(worker.run(stop)))
        ids = []
        for i in range(JOBS):
            async with rt.engine.begin() as conn:
                ids.append(await hold.enqueue(conn, Hold(name=f"j{i}"), key=f"j{i}"))
        most = 0

        async def counted(done: int) -> bool:
            """Every look: never more claimed than the slots; True once ``done`` finished.

            The states are read in ONE statement (one snapshot): read job by job, a job that
            finished after its read and the job claimed into its slot before the next read
            looked like three running at once."""
            nonlocal most
            async with rt.engine.connect() as conn:
                query = select(jobs.c.id, jobs.c.state).where(jobs.c.id.in_(ids))
                rows = {row.id: row.state for row in await conn.execute(query)}
            states = [JobState(rows[j]) for j in ids]
            claimed = states.count(JobState.RUNNING)
            assert claimed <= CONCURRENCY, states
            most = max(most, claimed)
            return states.count(JobState.SUCCEEDED) == done and claimed == min(
                CONCURRENCY, JOBS - done
            )

        await eventually(lambda: counted(0), what="both slots busy")
        await eventually(
            lambda: p.wait_for(ids[-1], lambda j: j.published, timeout=1), what="all published"
        )
        for done in range(1, JOBS + 1):
            running = [j for j in ids if (await rt.store.get_job(j)).state is JobState.RUNNING]
            gates[(await rt.store.get_job(running[0])).params["name"]].set()
            await eventually(lambda d=done: counted(d), what=f"{done} finished, slots refilled")
        assert most == CONCURRENCY
        for job_id in ids:
            job = await rt.store.get_job(job_id)
            assert job.state is JobState.SUCCEEDED and job.attempt == 1, job
