"""``jobrelay.testing`` (issue 40, item 1): an app's jobs run in the test's process with the
full semantics (claim, fenced outcome, retries, follow-ups, ``after=``), a fake clock for
delays and schedules, ``enqueued`` for what code enqueued; and one scenario run through the
runner and through the real pipeline (relay + worker on the real clock), on both backends,
ending the same way."""

from __future__ import annotations

import asyncio
import dataclasses
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from pydantic import BaseModel

import jobrelay
from jobrelay.domain.states import JobState
from jobrelay.library.hooks import JobOutcome
from jobrelay.testing import DrainTimeout, FakeClock, enqueued, run_jobs

from .ops_fixtures import eventually

pytestmark = pytest.mark.timeout(120)


class Order(BaseModel):
    n: int = 0
    fail: int = 0  # how many attempts fail before one succeeds


app = jobrelay.App()
hooked: list[tuple[str, str]] = []


@app.job("shop.charge", params=Order, max_attempts=3, retry_delays=(1,))
async def charge(ctx: jobrelay.JobContext[Order], p: Order) -> jobrelay.Result:
    if ctx.attempt <= p.fail:
        raise jobrelay.Retry(f"the bank is busy ({ctx.attempt})")
    ctx.follow_up(receipt, Order(n=p.n))
    return jobrelay.Result(value={"charged": p.n, "attempt": ctx.attempt})


@app.job("shop.receipt", params=Order)
async def receipt(ctx: jobrelay.JobContext[Order], p: Order) -> dict[str, int]:
    return {"receipt": p.n}


@app.job("shop.ship", params=Order)
async def ship(ctx: jobrelay.JobContext[Order], p: Order) -> dict[str, int]:
    return {"shipped": p.n}


@app.job(
    "shop.remind",
    params=Order,
    max_attempts=4,
    retry=jobrelay.Backoff(base=3600, factor=2, max=86400, jitter=0),
)
async def remind(ctx: jobrelay.JobContext[Order], p: Order) -> dict[str, int]:
    if ctx.attempt <= p.fail:
        raise RuntimeError("the mail server is down")
    return {"attempt": ctx.attempt}


@app.on_success(type=receipt)
def record(outcome: JobOutcome) -> None:
    hooked.append((outcome.outcome, outcome.job.id))


async def _order(runner: Any, n: int, fail: int) -> tuple[str, str]:
    """A charge, and a shipment that runs after it: the application's own transaction."""
    async with runner.engine.begin() as conn:
        paid = await charge.enqueue(conn, Order(n=n, fail=fail))
        shipped = await ship.enqueue(conn, Order(n=n), after=[paid])
    return paid, shipped


async def test_drain_runs_retries_follow_ups_and_dependants_to_their_end() -> None:
    hooked.clear()
    async with run_jobs(app) as runner:
        started = runner.clock()
        paid, shipped = await _order(runner, 7, fail=1)
        await runner.drain()
        job = await runner.job(paid)
        assert (job.state, job.attempt, job.result) == (
            JobState.SUCCEEDED,
            2,
            {"charged": 7, "attempt": 2},
        )
        assert (await runner.job(shipped)).state is JobState.SUCCEEDED
        [made] = await runner.jobs(type=receipt)
        assert (made.state, made.result) == (JobState.SUCCEEDED, {"receipt": 7})
        # The hook ran before drain returned; the retry's second was the clock's, not ours.
        assert hooked == [("succeeded", made.id)]
        assert runner.clock() >= started + timedelta(seconds=1)
        kinds = [e.kind for e in await runner.events(paid)]
        assert kinds.count("claimed") == 2 and "retry_scheduled" in kinds
        # The app's own calls reach the runner's database while it is open.
        assert await app.result(paid, timeout=5) == {"charged": 7, "attempt": 2}


async def test_delays_are_honoured_when_asked_and_the_clock_moves_them() -> None:
    start = datetime(2030, 1, 1, tzinfo=UTC)
    async with run_jobs(app, start=start) as runner:
        async with runner.engine.begin() as conn:
            later = await ship.enqueue(conn, Order(n=1), delay=timedelta(hours=2))
        reminded = await app.enqueue("shop.remind", Order(n=2, fail=2))
        await runner.drain(skip_delays=False)
        # A back-off of an hour: its retry waits on the fake clock, as the delayed job does.
        assert (await runner.job(later)).state is JobState.QUEUED
        waiting = await runner.job(reminded)
        assert (waiting.state, waiting.attempt) == (JobState.RETRY_WAIT, 1)
        assert waiting.next_attempt_at == start + timedelta(hours=1)
        runner.advance(timedelta(hours=1))
        await runner.drain(skip_delays=False)
        again = await runner.job(reminded)
        assert (again.state, again.attempt) == (JobState.RETRY_WAIT, 2)
        assert again.next_attempt_at == start + timedelta(hours=3)  # 1 h, then 2 h more
        assert (await runner.job(later)).state is JobState.QUEUED  # due at 2 h
        await runner.drain()  # skip the rest: the delayed job at 2 h, the retry at 3 h
        assert (await runner.job(later)).state is JobState.SUCCEEDED
        done = await runner.job(reminded)
        assert (done.state, done.attempt) == (JobState.SUCCEEDED, 3)
        assert runner.clock() == start + timedelta(hours=3)


async def test_schedules_fire_as_the_fake_clock_passes_their_ticks() -> None:
    timed = jobrelay.App()

    @timed.job("lab.tick", params=Order, schedule="*/10 * * * *")
    async def tick(ctx: jobrelay.JobContext[Order], p: Order) -> None:
        return None

    async with run_jobs(timed, start=datetime(2030, 1, 1, 0, 1, tzinfo=UTC)) as runner:
        await runner.drain()
        assert await runner.jobs(type=tick) == []  # the first tick is at 00:10
        for _ in range(3):
            runner.advance(timedelta(minutes=10))
            await runner.drain()
        done = await runner.jobs(type=tick, state="succeeded")
        assert len(done) == 3  # 00:10, 00:20, 00:30
        # A jump over several ticks is a scheduler that was away: the catch-up policy
        # (JOBRELAY_SCHEDULE_CATCHUP) decides, as in production.
        runner.advance(timedelta(hours=1))
        await runner.drain()
        assert 4 <= len(await runner.jobs(type=tick, state="succeeded")) <= 9


async def test_enqueued_records_without_running_and_refuses_to_drain() -> None:
    async with enqueued(app) as recorded:
        paid, _ = await _order(recorded, 3, fail=0)
        jobs = await recorded.jobs()
        assert [(j.type, j.state) for j in jobs] == [
            ("shop.charge", JobState.QUEUED),
            ("shop.ship", JobState.WAITING),
        ]
        assert (await recorded.job(paid)).params == {"n": 3, "fail": 0}
        with pytest.raises(jobrelay.ConfigError, match="run_jobs"):
            await recorded.drain()
        with pytest.raises(jobrelay.ConfigError, match="is none of"):
            await recorded.jobs(state="done")
        with pytest.raises(jobrelay.JobNotFound):
            await recorded.job("nope")


async def test_a_drain_that_cannot_finish_says_which_jobs_are_left() -> None:
    stuck = jobrelay.App()
    release = asyncio.Event()

    @stuck.job("lab.stuck", params=Order)
    async def wait_forever(ctx: jobrelay.JobContext[Order], p: Order) -> None:
        await release.wait()

    async with run_jobs(stuck) as runner:
        await stuck.enqueue("lab.stuck", Order(n=1))
        with pytest.raises(DrainTimeout, match=r"1 job\(s\) had not ended: lab.stuck .* running"):
            await runner.drain(timeout=0.5)
        release.set()
        await runner.drain()
        with pytest.raises(jobrelay.ConfigError, match="bound already"):
            async with stuck.bind(runner.settings, runner.engine):
                pass


async def test_a_rate_limit_is_drained_on_the_fake_clock() -> None:
    limited = jobrelay.App()

    @limited.job("lab.mail", params=Order, limits=[jobrelay.RateLimit("1/minute", burst=1)])
    async def mail(ctx: jobrelay.JobContext[Order], p: Order) -> None:
        return None

    start = datetime(2030, 1, 1, tzinfo=UTC)
    async with run_jobs(limited, start=start) as runner:
        for n in range(3):
            await limited.enqueue("lab.mail", Order(n=n))
        await runner.drain(timeout=20)
        assert len(await runner.jobs(state="succeeded")) == 3
        # One a minute: the third one's token came two minutes after the first.
        assert timedelta(minutes=2) <= runner.clock() - start < timedelta(minutes=3)


async def test_the_app_closing_its_engine_inside_a_runner_keeps_the_runner_working() -> None:
    async with run_jobs(app) as runner:
        job_id = await app.enqueue("shop.ship", Order(n=4))
        await app.aclose()  # as an application's shutdown would
        await runner.drain()
        assert (await app.get_job(job_id)) is not None
        assert (await runner.job(job_id)).state is JobState.SUCCEEDED
    assert app._bound is None and app._clock is None


async def test_a_fixed_delay_follows_the_fake_clock_on_both_backends(
    backend: tuple[str, str],
) -> None:
    slow = jobrelay.App()

    @slow.job("lab.once", params=Order, retry_delays=(300,))
    async def once(ctx: jobrelay.JobContext[Order], p: Order) -> int:
        if ctx.attempt == 1:
            raise jobrelay.Retry("not yet")
        return ctx.attempt

    database_url, broker_url = backend
    async with run_jobs(slow, database_url=database_url, broker_url=broker_url) as runner:
        job_id = await slow.enqueue("lab.once", Order())
        await runner.drain(skip_delays=False)
        waiting = await runner.job(job_id)
        assert waiting.state is JobState.RETRY_WAIT
        runner.advance(300)  # five minutes of the fake clock, not of the test's
        await runner.drain(skip_delays=False, timeout=20)
        done = await runner.job(job_id)
        assert (done.state, done.result) == (JobState.SUCCEEDED, 2)


def test_the_fake_clock_only_moves_forward() -> None:
    clock = FakeClock(datetime(2030, 1, 1, tzinfo=UTC))
    assert clock.advance(5) == datetime(2030, 1, 1, 0, 0, 5, tzinfo=UTC)
    assert clock.move_to(datetime(2029, 1, 1, tzinfo=UTC)) == clock()
    with pytest.raises(ValueError, match="forward"):
        clock.advance(-1)
    with pytest.raises(ValueError, match="aware"):
        FakeClock(datetime(2030, 1, 1))


# --- the runner and the real pipeline agree ---------------------------------------------------


def _summary(jobs: list[Any]) -> list[tuple[str, str, int, Any]]:
    """What a scenario ended as, whatever ids and times it got."""
    return sorted(((j.type, j.state.value, j.attempt, j.result) for j in jobs), key=repr)


async def _scenario(runner_or_pipeline: Any) -> list[str]:
    ids: list[str] = []
    for n, fail in ((1, 0), (2, 1), (3, 3)):  # succeeds; after a retry; quarantined
        ids.extend(await _order(runner_or_pipeline, n, fail))
    return ids


EXPECTED = sorted(
    [
        ("shop.charge", "quarantined", 3, None),
        ("shop.charge", "succeeded", 1, {"charged": 1, "attempt": 1}),
        ("shop.charge", "succeeded", 2, {"charged": 2, "attempt": 2}),
        ("shop.receipt", "succeeded", 1, {"receipt": 1}),
        ("shop.receipt", "succeeded", 1, {"receipt": 2}),
        ("shop.ship", "cancelled", 0, None),
        ("shop.ship", "succeeded", 1, {"shipped": 1}),
        ("shop.ship", "succeeded", 1, {"shipped": 2}),
    ],
    key=repr,
)


async def test_the_runner_and_the_real_pipeline_end_the_same_way(
    backend: tuple[str, str], make_pipeline: Any
) -> None:
    database_url, broker_url = backend
    async with make_pipeline() as p:
        p.rt = dataclasses.replace(p.rt, app=app)
        p.start_relay()
        await p.start_worker()

        class Engine:
            engine = p.rt.engine

        ids = await _scenario(Engine)
        for job_id in ids:
            await p.wait_for(job_id, lambda j: j.state.is_terminal, timeout=60)

        async def all_ended() -> list[Any] | None:
            found = await app_jobs(p.rt.store, p.rt.engine)  # the follow-ups too
            return found if all(j.state.is_terminal for j in found) else None

        pipeline = await eventually(all_ended, timeout=30)
        await p.stop_all()
        # The same database again, emptied: the runner's jobs are all it finds there.
        async with p.rt.engine.begin() as conn:
            for table in ("job_events", "job_slots", "outbox", "jobs"):
                await conn.exec_driver_sql(f"DELETE FROM {table}")
    assert _summary(pipeline) == EXPECTED
    async with run_jobs(app, database_url=database_url, broker_url=broker_url) as runner:
        await _scenario(runner)
        await runner.drain()
        assert _summary(await runner.jobs()) == EXPECTED


async def app_jobs(store: Any, engine: Any) -> list[Any]:
    from sqlalchemy import select

    from jobrelay.storage.tables import jobs

    async with engine.connect() as conn:
        ids = (await conn.scalars(select(jobs.c.id))).all()
    return [job for job in [await store.get_job(i) for i in ids] if job is not None]
