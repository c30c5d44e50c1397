"""Time limits (issue 24, item 4; issue 34, items 4 and 5): ``@app.job(timeout=)`` and
``JOBRELAY_JOB_TIMEOUT``.

An attempt still running at its limit is stopped, its staged result discarded, and it counts
as a failed attempt with the reason ``time limit of 0.5 s exceeded``: retried, then
quarantined once its attempts are used. An ``async def`` that blocks the event loop past its
limit (the timer cannot fire) fails the same way when it returns, and the worker's loop
watchdog names it. A ``def`` job takes a thread of the worker's pool before it is claimed (a
job waiting for a thread is not claimed and its limit does not run) and cannot be
interrupted: its attempt is recorded as failed at the limit, its thread is abandoned
(``ctx.cancelled`` set, whatever it returns later discarded), counted and replaced, up to
``JOBRELAY_SYNC_ABANDONED_MAX``; past it the abandoned thread keeps its slot and ``def`` jobs
wait unclaimed. The worker tests run on SQLite and PostgreSQL (``database_url``); the retry
and the watchdog through the broker on SQLite + local transport and on PostgreSQL + RabbitMQ
(``backend``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

import jobrelay
from jobrelay.domain.states import JobState
from jobrelay.errors import ConfigError
from jobrelay.runtime.wiring import Runtime
from jobrelay.worker.consumer import Worker

from .api_fixtures import build_runtime
from .ops_fixtures import eventually
from .test_library import Delivery  # a delivery that records its ack or reject

pytestmark = pytest.mark.timeout(120)
S = JobState
APP = "tests.integration.test_time_limits:app"
REASON = "time limit of 0.5 s exceeded"


class Item(BaseModel):
    n: int = 0


app = jobrelay.App()
stuck_started = threading.Event()
stuck_release = threading.Event()
quick_started = threading.Event()
hold_started = threading.Event()
returned: list[bool] = []  # the abandoned def body returned, seeing ctx.cancelled


@app.job("limits.slow", params=Item, timeout=0.5, max_attempts=2, retry_delays=(1,))
async def slow(ctx: jobrelay.JobContext[Item], params: Item) -> jobrelay.Result:
    key = ctx.result_key("out.csv")
    async with ctx.writer(key) as w:  # staged: visible only with a committed success
        await w.write(b"partial\n")
    await asyncio.Event().wait()  # never returns by itself
    return jobrelay.Result(key=key)


@app.job("limits.unlimited", params=Item, max_attempts=2)
async def unlimited(ctx: jobrelay.JobContext[Item], params: Item) -> None:
    await asyncio.Event().wait()  # stopped only by JOBRELAY_JOB_TIMEOUT


@app.job("limits.stuck", params=Item, timeout=0.5, max_attempts=3)
def stuck(ctx: jobrelay.SyncJobContext[Item], params: Item) -> jobrelay.Result:
    stuck_started.set()
    stuck_release.wait(60)  # a body that cannot be interrupted
    returned.append(ctx.cancelled.is_set())
    return jobrelay.Result(key="late", meta={"late": True})


@app.job("limits.quick", params=Item)
def quick(ctx: jobrelay.SyncJobContext[Item], params: Item) -> jobrelay.Result:
    quick_started.set()
    return jobrelay.Result(meta={"n": params.n})


@app.job("limits.hold", params=Item)
def hold(ctx: jobrelay.SyncJobContext[Item], params: Item) -> jobrelay.Result:
    hold_started.set()
    stuck_release.wait(60)  # holds the pool's one thread until the test lets it go
    return jobrelay.Result(meta={"held": True})


@app.job("limits.brief", params=Item, timeout=1)
def brief(ctx: jobrelay.SyncJobContext[Item], params: Item) -> jobrelay.Result:
    quick_started.set()
    return jobrelay.Result(meta={"n": params.n})


hung_started: list[int] = []


@app.job("limits.hung", params=Item, timeout=0.5, max_attempts=1)
def hung(ctx: jobrelay.SyncJobContext[Item], params: Item) -> None:
    hung_started.append(params.n)
    stuck_release.wait(60)  # hangs past its limit until the test lets it go


@app.job("limits.healthy", params=Item, timeout=5, max_attempts=3)
def healthy(ctx: jobrelay.SyncJobContext[Item], params: Item) -> jobrelay.Result:
    return jobrelay.Result(meta={"n": params.n, "attempt": ctx.attempt})


@app.job("limits.blocking", params=Item, timeout=0.5, max_attempts=2, retry_delays=(1,))
async def blocking(ctx: jobrelay.JobContext[Item], params: Item) -> jobrelay.Result:
    time.sleep(1.5)  # noqa: ASYNC251 -- on purpose: blocks the loop, the limit's timer with it
    return jobrelay.Result(meta={"slept": True})


@app.job("limits.blocker", params=Item, max_attempts=1)
async def blocker(ctx: jobrelay.JobContext[Item], params: Item) -> None:
    time.sleep(1.5)  # noqa: ASYNC251 -- on purpose: no job or timer runs meanwhile


@app.job("limits.ping", params=Item)
async def ping(ctx: jobrelay.JobContext[Item], params: Item) -> jobrelay.Result:
    return jobrelay.Result(meta={"n": params.n})


@pytest.fixture
async def rt(database_url: str, tmp_path: Path) -> AsyncIterator[Runtime]:
    runtime = build_runtime(database_url, tmp_path)
    # One thread in the pool: the abandoned body's slot is the only one.
    settings = runtime.settings.model_copy(update={"sync_threads": 1})
    runtime = dataclasses.replace(runtime, settings=settings, app=app)
    for event in (stuck_started, stuck_release, quick_started, hold_started):
        event.clear()
    returned.clear()
    yield runtime
    stuck_release.set()
    await runtime.engine.dispose()


async def enqueue(rt: Runtime, job: jobrelay.JobDefinition[Any], n: int = 0) -> str:
    async with rt.engine.begin() as conn:
        return await job.enqueue(conn, Item(n=n))


async def run_job(
    rt: Runtime, job_id: str, job_type: str, worker: Worker | None = None
) -> Delivery:
    delivery = Delivery(json.dumps({"jobId": job_id, "type": job_type, "version": 1}).encode())
    await (worker or Worker(rt)).handle(delivery)
    return delivery


def sample(rt: Runtime, name: str) -> float | None:
    return rt.metrics.registry.get_sample_value(name)


def logged(caplog: pytest.LogCaptureFixture, event: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if getattr(r, "event", None) == event]


async def test_an_async_job_past_its_limit_is_retried_then_quarantined(rt: Runtime) -> None:
    job_id = await enqueue(rt, slow)

    assert (await run_job(rt, job_id, slow.type)).outcomes == ["ack"]

    job = await rt.store.get_job(job_id)
    assert job is not None and job.state is S.RETRY_WAIT and job.attempt == 1
    assert job.last_error == REASON
    assert job.public_error is not None and REASON in job.public_error
    assert not await rt.results.exists(slow.type + f"/{job_id}/out.csv")  # discarded
    [retry] = [e.detail for e in await rt.store.events(job_id) if e.kind == "retry_scheduled"]
    assert retry["error"] == REASON and retry["delaySeconds"] == 1

    rt.clock.advance(2)  # type: ignore[attr-defined]
    assert (await run_job(rt, job_id, slow.type)).outcomes == ["reject"]

    job = await rt.store.get_job(job_id)
    assert job is not None and job.state is S.QUARANTINED and job.attempt == 2
    assert job.quarantine_reason == f"attempts exhausted (2/2): {REASON}"
    assert job.result_key is None


async def test_the_default_time_limit_applies_to_a_type_without_its_own(rt: Runtime) -> None:
    settings = rt.settings.model_copy(update={"job_timeout": 0.5})
    limited = dataclasses.replace(rt, settings=settings)
    job_id = await enqueue(limited, unlimited)

    assert (await run_job(limited, job_id, unlimited.type)).outcomes == ["ack"]

    job = await rt.store.get_job(job_id)
    assert job is not None and job.state is S.RETRY_WAIT and job.last_error == REASON


async def test_an_async_job_that_blocks_the_loop_past_its_limit_is_timed_out(
    rt: Runtime,
) -> None:
    job_id = await enqueue(rt, blocking)

    # The timer could not fire while the loop was blocked; the body returned past the limit.
    assert (await run_job(rt, job_id, blocking.type)).outcomes == ["ack"]

    job = await rt.store.get_job(job_id)
    assert job is not None and job.state is S.RETRY_WAIT and job.attempt == 1, job
    assert job.last_error == REASON and job.result_meta is None
    assert "result_saved" not in [e.kind for e in await rt.store.events(job_id)]


async def test_a_def_job_waits_for_a_thread_unclaimed_and_its_limit_starts_with_its_body(
    rt: Runtime,
) -> None:
    worker = Worker(rt)
    hold_id = await enqueue(rt, hold)
    brief_id = await enqueue(rt, brief, n=7)
    first = asyncio.create_task(run_job(rt, hold_id, hold.type, worker))
    assert await asyncio.to_thread(hold_started.wait, 30)  # the pool's one thread is busy

    second = asyncio.create_task(run_job(rt, brief_id, brief.type, worker))
    # Time must pass here, twice brief's limit: a limit that ran while brief waited for the
    # thread would have failed its attempt by now.
    await asyncio.sleep(2.0)
    job = await rt.store.get_job(brief_id)
    assert job is not None and job.state is S.QUEUED and job.attempt == 0, job  # no claim
    assert not quick_started.is_set()

    stuck_release.set()
    assert (await asyncio.wait_for(first, 30)).outcomes == ["ack"]
    assert (await asyncio.wait_for(second, 30)).outcomes == ["ack"]
    done = await rt.store.get_job(brief_id)
    assert done is not None and done.state is S.SUCCEEDED and done.attempt == 1, done
    assert done.result_meta is not None and done.result_meta["n"] == 7


async def test_an_abandoned_thread_is_counted_warned_and_replaced(
    rt: Runtime, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="jobrelay.worker")
    worker = Worker(rt)
    stuck_id = await enqueue(rt, stuck)
    quick_id = await enqueue(rt, quick, n=5)

    # The attempt fails at the limit while its body still runs in the pool's one thread.
    assert (await run_job(rt, stuck_id, stuck.type, worker)).outcomes == ["ack"]
    job = await rt.store.get_job(stuck_id)
    assert job is not None and job.state is S.RETRY_WAIT and job.last_error == REASON
    assert stuck_started.is_set() and returned == []
    [warning] = logged(caplog, "thread_abandoned")
    assert warning.levelno == logging.WARNING and getattr(warning, "jobId", None) == stuck_id
    assert sample(rt, "jobrelay_sync_threads_abandoned_total") == 1
    assert sample(rt, "jobrelay_sync_threads_abandoned_running") == 1

    # Its thread is replaced: the next def job runs while the abandoned body still blocks.
    assert (await asyncio.wait_for(run_job(rt, quick_id, quick.type, worker), 30)).outcomes == [
        "ack"
    ]
    done = await rt.store.get_job(quick_id)
    assert done is not None and done.state is S.SUCCEEDED and done.attempt == 1, done
    assert done.result_meta is not None and done.result_meta["n"] == 5
    assert returned == []

    stuck_release.set()  # the abandoned body returns: what it returned is discarded

    async def gone() -> bool:
        return sample(rt, "jobrelay_sync_threads_abandoned_running") == 0

    await eventually(gone, what="the abandoned thread to end")
    assert returned == [True]  # it saw ctx.cancelled
    job = await rt.store.get_job(stuck_id)
    assert job is not None and job.state is S.RETRY_WAIT and job.result_key is None
    assert "result_saved" not in [e.kind for e in await rt.store.events(stuck_id)]


async def test_past_the_abandoned_cap_def_jobs_wait_unclaimed_for_a_thread(
    rt: Runtime, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="jobrelay.worker")
    settings = rt.settings.model_copy(update={"sync_abandoned_max": 0})
    capped = dataclasses.replace(rt, settings=settings)
    worker = Worker(capped)
    stuck_id = await enqueue(rt, stuck)
    quick_id = await enqueue(rt, quick, n=5)
    assert (await run_job(capped, stuck_id, stuck.type, worker)).outcomes == ["ack"]

    # No thread left: the next def job is not claimed (no lease, no attempt), and it is said.
    second = asyncio.create_task(run_job(capped, quick_id, quick.type, worker))

    async def said() -> bool:
        return bool(logged(caplog, "sync_threads_exhausted"))

    await eventually(said, what="the worker to say it has no thread for def jobs")
    [error] = logged(caplog, "sync_threads_exhausted")
    assert error.levelno == logging.ERROR
    job = await rt.store.get_job(quick_id)
    assert job is not None and job.state is S.QUEUED and job.attempt == 0, job
    assert not quick_started.is_set()

    stuck_release.set()  # the abandoned body returns; its thread takes the waiting job
    assert (await asyncio.wait_for(second, 30)).outcomes == ["ack"]
    done = await rt.store.get_job(quick_id)
    assert done is not None and done.state is S.SUCCEEDED and done.attempt == 1, done
    assert returned == [True]


@pytest.mark.parametrize("bad", [0, -1, True])
def test_a_time_limit_must_be_positive_seconds(bad: Any) -> None:
    with pytest.raises(ConfigError, match="timeout must be positive seconds"):
        jobrelay.App().job("x.y", params=Item, timeout=bad)


async def test_a_timed_out_job_retries_through_the_broker(make_pipeline: Any) -> None:
    async with make_pipeline(app=APP) as p:
        p.start_relay()
        await p.start_worker()
        job_id = await enqueue(p.rt, slow)

        job = await p.wait_for(job_id, lambda j: j.state is S.QUARANTINED, timeout=60)

        assert job.attempt == 2 and job.quarantine_reason == f"attempts exhausted (2/2): {REASON}"
        timeline = await p.kinds(job_id)
        assert timeline.count("claimed") == 2 and "retry_scheduled" in timeline
        assert "result_saved" not in timeline


async def test_a_blocked_event_loop_is_reported_naming_the_job(
    make_pipeline: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="jobrelay.worker")
    async with make_pipeline(app=APP, loop_lag_warn_seconds="0.2") as p:
        p.start_relay()
        await p.start_worker()
        job_id = await enqueue(p.rt, blocker)

        await p.wait_for(job_id, lambda j: j.state is S.SUCCEEDED, timeout=60)

        blocked = logged(caplog, "loop_blocked")
        assert blocked and all(r.levelno == logging.WARNING for r in blocked)
        # Named while it blocks (a lag of the loaded machine may be logged too, naming none).
        named = [r for r in blocked if getattr(r, "jobId", None) == job_id]
        assert named and job_id in getattr(named[0], "jobIds", []), blocked[0].__dict__
        assert (sample(p.rt, "jobrelay_event_loop_blocked_total") or 0) >= 1
        assert (sample(p.rt, "jobrelay_event_loop_lag_seconds_count") or 0) >= 1


async def test_past_the_abandoned_cap_async_jobs_still_run_beside_waiting_def_jobs(
    make_pipeline: Any,
) -> None:
    stuck_release.clear()
    hung_started.clear()
    settings = {"sync_threads": "1", "sync_abandoned_max": "0", "concurrency": "2"}
    async with make_pipeline(app=APP, prefetch="10", **settings) as p:
        try:
            p.start_relay()
            await p.start_worker()
            hung_id = await enqueue(p.rt, hung)
            await p.wait_for(hung_id, lambda j: j.state is S.QUARANTINED, timeout=60)
            assert hung_started == [0]  # abandoned past the cap: it keeps the only thread

            # More def jobs than slots arrive first, and wait for a thread; behind them on
            # the same queue an async def job must still get a slot and run.
            waiting = [await enqueue(p.rt, quick, n=n) for n in range(3)]
            ping_id = await enqueue(p.rt, ping, n=9)
            # Within 30 s: the hung body gives its thread back by itself after 60 s.
            done = await p.wait_for(ping_id, lambda j: j.state.is_terminal, timeout=30)
            assert done.state is S.SUCCEEDED and done.attempt == 1, done
            for job_id in waiting:  # still unclaimed: no lease, no attempt spent
                job = await p.rt.store.get_job(job_id)
                assert job is not None and job.state is S.QUEUED and job.attempt == 0, job

            stuck_release.set()  # the abandoned body returns: the def jobs take its thread
            for job_id in waiting:
                job = await p.wait_for(job_id, lambda j: j.state.is_terminal, timeout=60)
                assert job.state is S.SUCCEEDED and job.attempt == 1, job
        finally:
            stuck_release.set()


async def test_healthy_def_jobs_behind_hung_ones_run_on_their_first_attempt(
    make_pipeline: Any,
) -> None:
    stuck_release.clear()
    hung_started.clear()
    async with make_pipeline(app=APP, sync_threads="2", concurrency="8") as p:
        try:
            p.start_relay()
            await p.start_worker()
            for n in range(2):
                await enqueue(p.rt, hung, n=n)

            async def both_hung() -> bool:
                return len(hung_started) == 2

            await eventually(both_hung, timeout=60, what="both hung def jobs to take a thread")
            ids = [await enqueue(p.rt, healthy, n=n) for n in range(6)]

            # Both threads hang past their limits: the healthy jobs neither time out waiting
            # for a thread nor wait for the hung bodies (their threads are replaced).
            for job_id in ids:
                job = await p.wait_for(job_id, lambda j: j.state.is_terminal, timeout=60)
                assert job.state is S.SUCCEEDED and job.attempt == 1, job

            # Each hung body is abandoned once its own limit has passed: under load the six
            # may all have run on the first replacement thread before the second's limit.
            async def both_abandoned() -> bool:
                return sample(p.rt, "jobrelay_sync_threads_abandoned_total") == 2

            await eventually(both_abandoned, timeout=60, what="both hung threads abandoned")
        finally:
            stuck_release.set()


def _watchdogs() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name == "jobrelay-loop-watch" and t.is_alive()}


async def test_a_worker_whose_startup_fails_leaves_no_watchdog_running(rt: Runtime) -> None:
    before = _watchdogs()  # another test's, ending by itself: not this worker's
    worker = Worker(rt)

    async def refused() -> None:
        raise RuntimeError("startup refused")

    worker.gate.refresh = refused  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="startup refused"):
        await worker.run(asyncio.Event())

    async def stopped() -> bool:
        return not (_watchdogs() - before)

    await eventually(stopped, timeout=30, what="the worker's loop watchdog thread to stop")
