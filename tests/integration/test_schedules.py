"""Schedulers on a fixed clock, on SQLite and PostgreSQL: one job per tick however many run,
catch-up after an outage (skipped ticks recorded), pause and resume, and the tick's key.

The store's clock is injected and moved by hand; each scheduler pass is called directly
(``run_once``), so nothing sleeps. Real processes (several relays, ``kill -9``) are in
tests/acceptance/test_schedules.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import pytest
from pydantic import BaseModel
from sqlalchemy import func, select, update

import jobrelay
from jobrelay.admin.schedules import ScheduleOperator
from jobrelay.domain.schedules import tick_key
from jobrelay.maintenance.scheduler import Scheduler
from jobrelay.runtime.wiring import Runtime
from jobrelay.storage.tables import job_events, jobs, schedule_events, schedules

from .api_fixtures import T0, Clock, api_client, bearer, build_runtime, make_token


class Tick(BaseModel):
    label: str
    scheduled_at: datetime


app = jobrelay.App()


@app.job("ticks.note", params=Tick)
async def note(ctx: jobrelay.JobContext[Tick], params: Tick) -> None:
    return None


app.schedule(note, cron="* * * * *", params={"label": "every minute"}, name="minutely")


@pytest.fixture
async def runtime(database_url: str, tmp_path: Path) -> AsyncIterator[tuple[Runtime, Clock]]:
    clock = Clock(T0)
    rt = dataclasses.replace(build_runtime(database_url, tmp_path, clock=clock), app=app)
    try:
        yield rt, clock
    finally:
        await rt.engine.dispose()


def with_catchup(rt: Runtime, catchup: str) -> Runtime:
    settings = rt.settings.model_copy(update={"schedule_catchup": catchup})
    return dataclasses.replace(rt, settings=settings)


async def tick_jobs(rt: Runtime) -> dict[str, list[str]]:
    """idempotency key -> the job ids under it (a list, so a double would show)."""
    async with rt.engine.connect() as conn:
        rows = (
            await conn.execute(
                select(jobs.c.idempotency_key, jobs.c.id).where(
                    jobs.c.idempotency_key.like("schedule:minutely:%")
                )
            )
        ).all()
    out: dict[str, list[str]] = {}
    for key, job_id in rows:
        out.setdefault(key, []).append(job_id)
    return out


def minute(n: int) -> datetime:
    return T0 + timedelta(minutes=n)


async def schedule_timeline(rt: Runtime) -> list[tuple[str, dict[str, Any]]]:
    async with rt.engine.connect() as conn:
        rows = (
            await conn.execute(
                select(schedule_events.c.kind, schedule_events.c.detail).order_by(
                    schedule_events.c.id
                )
            )
        ).all()
    return [(r.kind, dict(r.detail)) for r in rows]


async def test_three_schedulers_make_one_job_per_tick(runtime: tuple[Runtime, Clock]) -> None:
    rt, clock = runtime
    schedulers = [Scheduler(rt, name=f"s{i}") for i in range(3)]
    await asyncio.gather(*(s.run_once() for s in schedulers))  # registers; ticks start at T0
    for n in range(1, 6):
        clock.now = minute(n) + timedelta(seconds=0.2)
        await asyncio.gather(*(s.run_once() for s in schedulers))
    found = await tick_jobs(rt)
    assert found == {
        tick_key("minutely", minute(n)): [found[tick_key("minutely", minute(n))][0]]
        for n in range(1, 6)
    }
    # Each job says which tick it is, in its params and in a `scheduled` event.
    job = await rt.store.get_job(found[tick_key("minutely", minute(3))][0])
    assert job is not None
    assert job.params == {"label": "every minute", "scheduled_at": "2026-01-01T12:03:00Z"}
    kinds = [e.kind for e in await rt.store.events(job.id)]
    assert kinds == ["accepted", "scheduled"]
    # One Metrics object for the three: each tick is counted once, by the one that wrote it.
    assert rt.metrics.schedule_ticks_enqueued.labels(schedule="minutely")._value.get() == 5


async def test_a_tick_enqueued_twice_is_one_job(runtime: tuple[Runtime, Clock]) -> None:
    rt, clock = runtime
    scheduler = Scheduler(with_catchup(rt, "all"))
    await scheduler.run_once()
    clock.now = minute(3)
    await scheduler.run_once()
    # As if a second scheduler had read the schedule before the first one moved its cursor
    # (a restored backup, a lost update): it enqueues the same ticks again.
    async with rt.engine.begin() as conn:
        await conn.execute(update(schedules).values(cursor_at=T0))
    result = await scheduler.advance(scheduler.schedules[0])
    assert [e.created for e in result.enqueued] == [False, False, False]
    assert sorted(await tick_jobs(rt)) == sorted(tick_key("minutely", minute(n)) for n in (1, 2, 3))
    assert all(len(ids) == 1 for ids in (await tick_jobs(rt)).values())


async def test_an_outage_catches_up_the_last_tick_and_records_the_skipped(
    runtime: tuple[Runtime, Clock],
) -> None:
    rt, clock = runtime
    scheduler = Scheduler(rt)  # JOBRELAY_SCHEDULE_CATCHUP=last, the default
    await scheduler.run_once()
    clock.now = minute(1)
    await scheduler.run_once()
    clock.now = minute(10) + timedelta(seconds=30)  # down from 12:01 to 12:10:30
    await scheduler.run_once()
    found = await tick_jobs(rt)
    assert sorted(found) == sorted(tick_key("minutely", minute(n)) for n in (1, 10))
    latest = found[tick_key("minutely", minute(10))][0]
    events = await rt.store.events(latest)
    skipped = next(e.detail for e in events if e.kind == "ticks_skipped")
    expected = [minute(n).isoformat() for n in range(2, 10)]
    assert (skipped["reason"], skipped["count"], skipped["ticks"]) == ("catchup", 8, expected)
    timeline = await schedule_timeline(rt)
    assert [kind for kind, _ in timeline] == ["ticks_skipped"]
    assert timeline[0][1]["jobId"] == latest and timeline[0][1]["ticks"] == expected
    metrics = scheduler.rt.metrics
    assert metrics.schedule_ticks_skipped.labels("minutely", "catchup")._value.get() == 8
    assert metrics.schedule_ticks_late.labels("minutely")._value.get() == 1  # 12:10, 30 s on


async def test_a_window_catches_up_every_tick_within_it(runtime: tuple[Runtime, Clock]) -> None:
    rt, clock = runtime
    scheduler = Scheduler(with_catchup(rt, "5m"))
    await scheduler.run_once()
    clock.now = minute(12)
    await scheduler.run_once()
    found = await tick_jobs(rt)
    assert sorted(found) == sorted(tick_key("minutely", minute(n)) for n in range(7, 13))
    timeline = await schedule_timeline(rt)
    assert timeline[0][1]["count"] == 6 and timeline[0][1]["last"] == minute(6).isoformat()


async def test_pause_skips_and_records_ticks_resume_does_not_catch_them_up(
    runtime: tuple[Runtime, Clock],
) -> None:
    rt, clock = runtime
    scheduler = Scheduler(with_catchup(rt, "all"))
    operator = ScheduleOperator(rt)
    await scheduler.run_once()
    clock.now = minute(1)
    await scheduler.run_once()
    paused = await operator.set_paused("minutely", True, actor="ops", reason="maintenance")
    assert paused.done
    again = await operator.set_paused("minutely", True, actor="ops", reason="twice")
    assert again.found and not again.done
    for n in (2, 3, 4):
        clock.now = minute(n)
        await scheduler.run_once()
    (row,) = await operator.rows()
    assert row.view.paused and row.next_tick is None
    assert row.view.skipped_while_paused is not None
    assert row.view.skipped_while_paused["count"] == 3
    clock.now = minute(5) + timedelta(seconds=10)  # 12:05 came due, no pass ran yet
    resumed = await operator.set_paused("minutely", False, actor="ops", reason="done")
    assert resumed.skipped is not None and resumed.skipped.count == 4
    clock.now = minute(6)
    await scheduler.run_once()
    assert sorted(await tick_jobs(rt)) == sorted(tick_key("minutely", minute(n)) for n in (1, 6))
    timeline = await schedule_timeline(rt)
    assert [kind for kind, _ in timeline] == ["paused", "ticks_skipped", "resumed"]
    assert timeline[0][1] == {"actor": "ops", "reason": "maintenance"}
    assert timeline[1][1]["ticks"] == [minute(n).isoformat() for n in (2, 3, 4, 5)]
    assert timeline[2][1]["actor"] == "ops" and timeline[2][1]["skipped"]["count"] == 4
    (row,) = await operator.rows()
    assert (row.view.last_tick_at, row.view.last_job_state) == (minute(6), "queued")
    assert row.next_tick == minute(7) and row.defined


async def test_pausing_an_unknown_schedule_changes_nothing(runtime: tuple[Runtime, Clock]) -> None:
    rt, _ = runtime
    outcome = await ScheduleOperator(rt).set_paused("nope", True, actor="ops", reason="x")
    assert not outcome.found and not outcome.done
    async with rt.engine.connect() as conn:
        assert await conn.scalar(select(func.count()).select_from(schedule_events)) == 0
        assert await conn.scalar(select(func.count()).select_from(job_events)) == 0


# --- the admin HTTP API -------------------------------------------------------------------


async def test_http_lists_pauses_and_resumes_for_admin_tokens_only(
    runtime: tuple[Runtime, Clock],
) -> None:
    rt, clock = runtime
    scheduler = Scheduler(rt)
    await scheduler.run_once()
    clock.now = minute(1)
    await scheduler.run_once()
    admin = bearer(await make_token(rt, None, admin=True))
    account = bearer(await make_token(rt, "acme"))
    async with api_client(rt) as client:
        assert (await client.get("/v1/schedules", headers=account)).status_code == 403
        assert (await client.get("/v1/schedules")).status_code == 401
        listed = (await client.get("/v1/schedules", headers=admin)).json()["schedules"]
        (one,) = listed
        job_id = (await tick_jobs(rt))[tick_key("minutely", minute(1))][0]
        assert (one["name"], one["cron"], one["timezone"]) == ("minutely", "* * * * *", "UTC")
        assert (one["lastTick"], one["lastJobId"], one["lastJobState"]) == (
            minute(1).isoformat(),
            job_id,
            "queued",
        )
        assert one["nextTick"] == minute(2).isoformat() and one["paused"] is False

        path = "/v1/schedules/minutely"
        blank = await client.post(f"{path}/pause", headers=admin, json={"reason": " "})
        assert blank.status_code == 422
        assert blank.headers["content-type"] == "application/problem+json"
        missing = await client.post("/v1/schedules/nope/pause", headers=admin, json={"reason": "x"})
        assert missing.status_code == 404
        assert (
            await client.post(f"{path}/pause", headers=account, json={"reason": "x"})
        ).status_code == 403
        assert (await schedule_timeline(rt)) == []  # none of those changed anything

        paused = await client.post(f"{path}/pause", headers=admin, json={"reason": "deploy"})
        assert paused.status_code == 200 and paused.json()["paused"] is True
        assert paused.json()["actor"].startswith("token#")
        twice = await client.post(f"{path}/pause", headers=admin, json={"reason": "deploy"})
        assert twice.status_code == 409
        clock.now = minute(3)
        await scheduler.run_once()
        resumed = await client.post(f"{path}/resume", headers=admin, json={"reason": "done"})
        assert resumed.status_code == 200 and resumed.json()["skipped"]["count"] == 2
        shown = (await client.get(path, headers=admin)).json()
        kinds = [e["kind"] for e in shown["events"]]
        assert kinds == ["resumed", "ticks_skipped", "paused"]  # newest first
        assert shown["events"][2]["detail"]["actor"] == paused.json()["actor"]
        assert (await client.get("/v1/schedules/nope", headers=admin)).status_code == 404
        spec = (await client.get("/openapi.json")).json()["paths"]
        assert {"/v1/schedules", "/v1/schedules/{name}/pause"} <= set(spec)


# --- DST through the whole scheduler, on a fixed clock ------------------------------------

berlin = jobrelay.App()


@berlin.job("ticks.berlin", params=Tick)
async def berlin_note(ctx: jobrelay.JobContext[Tick], params: Tick) -> None:
    return None


berlin.schedule(berlin_note, cron="30 2 * * *", params={"label": "n"}, timezone="Europe/Berlin")
berlin.schedule(
    berlin_note, cron="0 * * * *", params={"label": "h"}, timezone="Europe/Berlin", name="hourly"
)


async def keyed(rt: Runtime, name: str) -> list[str]:
    async with rt.engine.connect() as conn:
        found = await conn.execute(
            select(jobs.c.idempotency_key).where(jobs.c.idempotency_key.like(f"schedule:{name}:%"))
        )
        return sorted(k.removeprefix(f"schedule:{name}:") for (k,) in found)


@pytest.mark.parametrize(
    ("start", "nightly", "hourly_local"),
    [
        # Spring forward: 02:30 does not exist; the nightly job runs once, at 03:00 CEST, and
        # the hourly one has no 02:00.
        ("2026-03-28T22:00:00+00:00", ["2026-03-29T01:00:00+00:00"], [0, 1, 3, 4, 5]),
        # Fall back: 02:30 happens twice; the nightly job runs once, at the first. The
        # hourly one runs at both 02:00s (CEST, then CET).
        ("2026-10-24T22:00:00+00:00", ["2026-10-25T00:30:00+00:00"], [1, 2, 2, 3, 4]),
    ],
)
async def test_dst_nights_pass_through_the_scheduler_once(
    database_url: str, tmp_path: Path, start: str, nightly: list[str], hourly_local: list[int]
) -> None:
    clock = Clock(datetime.fromisoformat(start))
    rt = dataclasses.replace(build_runtime(database_url, tmp_path, clock=clock), app=berlin)
    try:
        scheduler = Scheduler(rt)
        await scheduler.run_once()
        for _ in range(5 * 12):  # five hours in five-minute steps, a pass at each
            clock.advance(300)
            await scheduler.run_once()
        assert await keyed(rt, "ticks.berlin") == nightly
        hours = [
            datetime.fromisoformat(k).astimezone(ZoneInfo("Europe/Berlin")).hour
            for k in await keyed(rt, "hourly")
        ]
        assert hours == hourly_local
    finally:
        await rt.engine.dispose()


async def test_ticks_due_before_a_pause_are_caught_up_not_counted_as_paused(
    runtime: tuple[Runtime, Clock],
) -> None:
    rt, clock = runtime
    await Scheduler(rt).run_once()  # registered at 12:00; then no scheduler runs
    clock.now = minute(5) + timedelta(seconds=30)
    operator = ScheduleOperator(rt)
    assert (await operator.set_paused("minutely", True, actor="ops", reason="x")).done
    # Catch-up `last` at the pause: 12:05 enqueued, 12:01-12:04 skipped as catch-up.
    assert sorted(await tick_jobs(rt)) == [tick_key("minutely", minute(5))]
    clock.now = minute(7) + timedelta(seconds=30)
    resumed = await operator.set_paused("minutely", False, actor="ops", reason="y")
    assert resumed.skipped is not None
    assert (resumed.skipped.count, resumed.skipped.first) == (2, minute(6))
    timeline = await schedule_timeline(rt)
    assert [(kind, d["reason"]) for kind, d in timeline] == [
        ("ticks_skipped", "catchup"),
        ("paused", "x"),
        ("ticks_skipped", "paused"),
        ("resumed", "y"),
    ]
    assert timeline[0][1]["count"] == 4


async def test_one_failing_schedule_does_not_stop_the_others_in_a_pass(
    runtime: tuple[Runtime, Clock],
) -> None:
    """Issue 21, item 10: a schedule whose tick job cannot be built (here: its params raise)
    is logged and counted; the schedules after it in the same pass still get their ticks."""
    rt, clock = runtime
    scheduler = Scheduler(rt)
    [good] = scheduler.schedules

    def broken_params(tick: datetime) -> dict[str, Any]:
        raise ValueError("this schedule's params cannot be built")

    broken = dataclasses.replace(good, name="broken")
    object.__setattr__(broken, "tick_params", broken_params)
    scheduler.schedules = [broken, good]  # the broken one first: it must not stop the pass
    await scheduler.run_once()  # registers
    clock.now = minute(1) + timedelta(seconds=0.2)
    pause = await scheduler.run_once()
    assert list(await tick_jobs(rt)) == [tick_key("minutely", minute(1))]
    assert rt.metrics.schedule_failures.labels(schedule="broken")._value.get() >= 1
    assert rt.metrics.schedule_failures.labels(schedule="minutely")._value.get() == 0
    assert pause <= 1.01  # it comes back soon (ERROR_SLEEP) for the broken one
