"""Priority inside a queue (issue 40, item 5), on both backends through the relay, the broker
and a real worker: a job of high priority enqueued behind a backlog of low-priority jobs of
the same queue runs after at most ``priority_ahead`` of them (those already handed to the
broker, plus one admission round), not after the backlog."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel
from sqlalchemy import select
from typer.testing import CliRunner

import jobrelay
from jobrelay.cli.main import app as cli_app
from jobrelay.domain.states import JobState
from jobrelay.storage.engine import create_engine
from jobrelay.storage.store import Store
from jobrelay.storage.tables import job_events, jobs

from .ops_fixtures import eventually

pytestmark = pytest.mark.timeout(180)

BACKLOG = 300
AHEAD = 8


class Item(BaseModel):
    n: int = 0


app = jobrelay.App()


@app.job("lab.bulk", params=Item, priority=0)
async def bulk(ctx: jobrelay.JobContext[Item], p: Item) -> None:
    await asyncio.sleep(0.01)  # a backlog that drains at a pace the test can watch


@app.job("lab.urgent", params=Item, priority=9)
async def urgent(ctx: jobrelay.JobContext[Item], p: Item) -> None:
    return None


async def test_a_high_priority_job_overtakes_the_backlog_of_its_queue(
    make_pipeline: Any,
) -> None:
    async with make_pipeline(priority_ahead=str(AHEAD), concurrency="4") as p:
        p.rt = dataclasses.replace(p.rt, app=app)
        async with p.rt.engine.begin() as conn:
            backlog = await bulk.enqueue_many(conn, [Item(n=i) for i in range(BACKLOG)])
        p.start_relay()
        await p.start_worker()

        async def some_done() -> bool:
            async with p.rt.engine.connect() as conn:
                done = await conn.scalar(
                    select(jobs.c.id).where(jobs.c.state == "succeeded").limit(1).offset(19)
                )
            return done is not None

        await eventually(some_done, timeout=60)
        async with p.rt.engine.begin() as conn:
            first = await urgent.enqueue(conn, Item())
            # A bulk job asked at a higher priority at its enqueue overtakes too.
            second = await bulk.enqueue(conn, Item(n=-1), priority=5)
        await p.wait_for(first, lambda j: j.state is JobState.SUCCEEDED, timeout=60)
        await p.wait_for(second, lambda j: j.state is JobState.SUCCEEDED, timeout=60)
        await p.stop_all()
        async with p.rt.engine.connect() as conn:
            events = (
                await conn.execute(
                    select(job_events.c.id, job_events.c.job_id, job_events.c.kind).order_by(
                        job_events.c.id
                    )
                )
            ).all()
            priorities = dict(
                (
                    await conn.execute(
                        select(jobs.c.id, jobs.c.priority).where(
                            jobs.c.id.in_([first, second, backlog[0]])
                        )
                    )
                ).all()
            )
    assert priorities == {first: 9, second: 5, backlog[0]: 0}
    accepted = next(e.id for e in events if e.job_id == first and e.kind == "accepted")
    claimed = next(e.id for e in events if e.job_id == first and e.kind == "claimed")
    bulk_ids = set(backlog)
    overtaken_by = [
        e.job_id
        for e in events
        if accepted < e.id < claimed and e.kind == "claimed" and e.job_id in bulk_ids
    ]
    still_waiting = bulk_ids - {e.job_id for e in events if e.id < claimed and e.kind == "claimed"}
    # The bound: those already admitted (at most AHEAD), and those a round that had not
    # seen the urgent job yet admitted as slots came free (at most AHEAD again).
    assert len(overtaken_by) <= 2 * AHEAD, len(overtaken_by)
    # ... while most of the backlog was still waiting: without priorities it would have
    # run after all of it.
    assert len(still_waiting) > BACKLOG // 2, len(still_waiting)
    second_claimed = next(e.id for e in events if e.job_id == second and e.kind == "claimed")
    behind_second = [
        e.job_id
        for e in events
        if accepted < e.id < second_claimed and e.kind == "claimed" and e.job_id in bulk_ids
    ]
    assert len(behind_second) <= 2 * AHEAD + 1, len(behind_second)


def test_a_priority_is_checked_where_it_is_written() -> None:
    other = jobrelay.App()
    with pytest.raises(jobrelay.ConfigError, match=r"0\.\.9"):
        other.job("lab.p", params=Item, priority=10)
    with pytest.raises(jobrelay.ConfigError, match=r"0\.\.9"):
        other.job("lab.q", params=Item, priority=True)  # type: ignore[arg-type]

    @other.job("lab.plain", params=Item)
    async def plain(ctx: Any, p: Item) -> None:
        return None

    # A queue without priorities: nothing would order the job, so asking one is refused.
    with pytest.raises(jobrelay.ConfigError, match="has no priorities"):
        plain.new_job(Item(), priority=3)
    assert plain.new_job(Item()).limits == ()
    with pytest.raises(jobrelay.ConfigError, match=r"0\.\.9"):
        bulk.new_job(Item(), priority=-1)
    job = bulk.new_job(Item())
    assert job.priority == 0 and [limit.limit_id for limit in job.limits] == ["queue:default"]
    assert urgent.new_job(Item()).priority == 9


def test_operators_see_a_prioritized_queue_and_cannot_override_its_order(
    database_url: str, tmp_path: Path
) -> None:
    env = {
        "JOBRELAY_DATABASE_URL": database_url,
        "JOBRELAY_RESULTS_URL": f"file://{tmp_path}/exports",
        "JOBRELAY_BROKER_URL": "local",
    }

    async def seed() -> str:
        engine = create_engine(database_url)
        try:
            store = Store(engine)
            for n in range(3):
                await store.submit(bulk.new_job(Item(n=n)), store.local_now())
            urgent_id, _ = await store.submit(urgent.new_job(Item()), store.local_now())
            await store.admit_waiting(100, priority_ahead=2)
            return str(urgent_id)
        finally:
            await engine.dispose()

    urgent_id = asyncio.run(seed())
    runner = CliRunner()
    shown = runner.invoke(cli_app, ["job", "show", urgent_id], env=env)
    assert shown.exit_code == 0, (shown.stdout, shown.stderr)
    assert "queue:default (by priority)" in shown.stdout
    assert "9 in its queue (0..9, higher runs first)" in shown.stdout
    listed = runner.invoke(cli_app, ["limits", "list"], env=env)
    assert listed.exit_code == 0, (listed.stdout, listed.stderr)
    assert "queue:default" in listed.stdout
    refused = runner.invoke(
        cli_app,
        ["limits", "set", "queue:default", "--concurrency", "4", "--reason", "faster"],
        env=env,
    )
    assert refused.exit_code == 2, refused.stdout
    assert "JOBRELAY_PRIORITY_AHEAD" in refused.stderr
