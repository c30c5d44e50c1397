"""A pause never moves a message toward the quarantine (issue 21, item 4).

On SQLite + the local transport and on PostgreSQL + RabbitMQ (``backend``). Jobs are held
mid-work by this module's own job type, which waits on an event the test sets: nothing here
depends on a job being slow. With prefetch 3 and a delivery limit of 1, three long jobs fill
every slot; three more wait in the broker; the queue is paused and resumed three times, and
after each resume one long job ends. A session that prefetched a full prefetch on resume
held messages it could not start, and each pause gave them back counted, so the third
dead-lettered a job that never ran; a consumer closed after the grace requeued the long jobs
in flight. Now every job succeeds on its first attempt and nothing reaches the quarantine.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections import defaultdict
from typing import Any

import pytest
from pydantic import BaseModel

import jobrelay
from jobrelay.domain.states import JobState
from jobrelay.runtime.wiring import build_transport
from jobrelay.storage.queue_pauses import set_paused
from jobrelay.worker.consumer import Worker

from .ops_fixtures import eventually

pytestmark = pytest.mark.timeout(180)

app = jobrelay.App()
gates: defaultdict[str, asyncio.Event] = defaultdict(asyncio.Event)


class Hold(BaseModel):
    name: str


@app.job("test.hold", params=Hold, max_attempts=1)
async def hold(ctx: jobrelay.JobContext[Hold], params: Hold) -> None:
    await gates[params.name].wait()


async def enqueue(rt: Any, name: str) -> str:
    async with rt.engine.begin() as conn:
        return await hold.enqueue(conn, Hold(name=name), key=name, account="acme")


async def start_worker(p: Any) -> Worker:
    rt = p.rt
    transport = build_transport(rt.settings, rt.engine, rt.clock)
    await transport.connect()
    p.worker_transports.append(transport)
    worker = Worker(
        dataclasses.replace(rt, transport=transport), registry=app.registry(rt.settings)
    )
    stop = asyncio.Event()
    p.stops.append(stop)
    p.workers.append(asyncio.create_task(worker.run(stop)))
    return worker


async def states(rt: Any, job_ids: list[str]) -> list[JobState]:
    return [(await rt.store.get_job(j)).state for j in job_ids]


async def test_pause_and_resume_cycles_never_count_a_delivery(make_pipeline: Any) -> None:
    gates.clear()
    # A lease of 10 s, not the suite's 1.5: the long jobs are held through three pause
    # cycles, and on a loaded CI machine a SQLite renewal once took longer than 1.5 s allows
    # (the job lost its lease and, with one attempt, was quarantined): leases are not what
    # this test is about.
    async with make_pipeline(
        queue_pause_poll_seconds="0.05",
        prefetch="3",
        delivery_limit="1",
        reconcile_seconds="0",
        lease_seconds="10",
        visibility_seconds="10",
    ) as p:
        rt = p.rt
        p.start_relay()
        worker = await start_worker(p)
        long = [await enqueue(rt, f"long-{i}") for i in range(3)]

        async def all_running() -> bool:
            return await states(rt, long) == [JobState.RUNNING] * 3

        await eventually(all_running, what="three long jobs in every slot")
        short = [await enqueue(rt, f"short-{i}") for i in range(3)]
        await eventually(
            lambda: p.wait_for(short[-1], lambda j: j.published, timeout=1),
            what="the short jobs published",
        )
        for cycle in range(3):
            await set_paused(rt.store, "default", True, actor="t", reason="r", now=rt.clock())
            await eventually(lambda: _true(worker.gate.is_paused("default")), what="pause")
            await set_paused(rt.store, "default", False, actor="t", reason="r", now=rt.clock())
            await eventually(lambda: _true(not worker.gate.is_paused("default")), what="resume")
            gates[f"long-{cycle}"].set()  # one slot frees: one short job may start
            await p.wait_for(long[cycle], lambda j: j.state is JobState.SUCCEEDED)

            async def started(n: int = cycle + 1) -> bool:
                return (await states(rt, short)).count(JobState.RUNNING) == n

            await eventually(started, what=f"{cycle + 1} short job(s) running")
        for name in ("short-0", "short-1", "short-2"):
            gates[name].set()
        for job_id in long + short:
            job = await p.wait_for(job_id, lambda j: j.state is JobState.SUCCEEDED)
            assert job.attempt == 1, job
            assert (await p.kinds(job_id)).count("claimed") == 1, await p.kinds(job_id)
        assert await rt.transport.quarantine_depth() == 0


async def _true(value: bool) -> bool:
    return value
