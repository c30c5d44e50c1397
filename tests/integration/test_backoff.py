"""Back-off with jitter (issue 40, item 3), on both backends through the relay, the broker
and a real worker: jobs that fail together retry spread apart, each retry is held in the
outbox until due (no delay queue holds an arbitrary delay), then runs from its work queue."""

from __future__ import annotations

import dataclasses
import statistics
from datetime import timedelta
from typing import Any

import pytest
from pydantic import BaseModel
from sqlalchemy import select

import jobrelay
from jobrelay.domain.queues import destination
from jobrelay.domain.states import JobState
from jobrelay.storage.tables import job_events, jobs, outbox

from .ops_fixtures import eventually

pytestmark = pytest.mark.timeout(180)

N = 500
SPREAD = jobrelay.Backoff(base=60, factor=2, max=3600, jitter=0.2)


class Ask(BaseModel):
    n: int = 0


app = jobrelay.App()


@app.job("lab.outage", params=Ask, max_attempts=3, retry=SPREAD)
async def outage(ctx: jobrelay.JobContext[Ask], p: Ask) -> None:
    raise RuntimeError("the ledger is down")


@app.job("lab.blip", params=Ask, max_attempts=3, retry=jobrelay.Backoff(base=3, jitter=0))
async def blip(ctx: jobrelay.JobContext[Ask], p: Ask) -> dict[str, int]:
    if ctx.attempt == 1:
        raise RuntimeError("a blip")
    return {"attempt": ctx.attempt}


async def test_jobs_failing_together_spread_their_retries(make_pipeline: Any) -> None:
    async with make_pipeline() as p:
        p.rt = dataclasses.replace(p.rt, app=app)
        async with p.rt.engine.begin() as conn:
            ids = await outage.enqueue_many(conn, [Ask(n=i) for i in range(N)])
        p.start_relay()
        await p.start_worker()

        async def all_waiting() -> bool:
            async with p.rt.engine.connect() as conn:
                states = (await conn.execute(select(jobs.c.state).where(jobs.c.id.in_(ids)))).all()
            return all(s == JobState.RETRY_WAIT.value for (s,) in states)

        await eventually(all_waiting, timeout=150)
        await p.stop_all()
        async with p.rt.engine.connect() as conn:
            due = dict((await conn.execute(select(jobs.c.id, jobs.c.next_attempt_at))).all())
            delays = [
                float(d["delaySeconds"])
                for (d,) in (
                    await conn.execute(
                        select(job_events.c.detail).where(job_events.c.kind == "retry_scheduled")
                    )
                ).all()
            ]
            held = (
                await conn.execute(
                    select(outbox.c.job_id, outbox.c.destination, outbox.c.available_at).where(
                        outbox.c.published_at.is_(None)
                    )
                )
            ).all()
    assert len(delays) == N
    # 60 s +/- 20%: every delay inside the band, spread across it rather than one value.
    assert all(48 <= d <= 72 for d in delays), (min(delays), max(delays))
    assert max(delays) - min(delays) > 20, (min(delays), max(delays))
    assert len({round(d, 2) for d in delays}) > N // 2
    assert statistics.pstdev(delays) > 4  # a uniform band of 24 s: about 6.9 s
    # The due times themselves spread as far: a thousand clients do not come back at once.
    times = sorted(due[i] for i in ids)
    assert times[-1] - times[0] > timedelta(seconds=15), (times[0], times[-1])
    # Each retry waits in the outbox until due, addressed to the work queue itself.
    assert sorted(r.job_id for r in held) == sorted(ids)
    assert {r.destination for r in held} == {destination("default")}
    assert all(r.available_at == due[r.job_id] for r in held)


async def test_a_held_retry_runs_when_due_with_a_delay_no_tier_has(make_pipeline: Any) -> None:
    # The pipeline's only delay tier is 1 s: the back-off's 3 s is carried by the outbox.
    async with make_pipeline() as p:
        p.rt = dataclasses.replace(p.rt, app=app)
        job_id, _ = await p.store.submit(blip.new_job(Ask()), p.rt.clock())
        p.start_relay()
        await p.start_worker()
        job = await p.wait_for(job_id, lambda j: j.state is JobState.SUCCEEDED)
        events = await p.store.events(job_id)
    assert job.attempt == 2
    scheduled = next(e for e in events if e.kind == "retry_scheduled")
    assert scheduled.detail["delaySeconds"] == 3
    claims = [e for e in events if e.kind == "claimed"]
    assert len(claims) == 2
    assert claims[1].at >= scheduled.at + timedelta(seconds=3) - timedelta(seconds=1)
