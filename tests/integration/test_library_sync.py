"""Plain ``def`` jobs and ``Retry(delay=...)`` (issue 24, items 1 and 3).

A ``def`` job runs in the app's bounded thread pool with the guarantees of an ``async def``:
one claim, one fenced outcome, its ``Retry``/``Permanent`` kept, its progress recorded, and a
late return after its claim was superseded discarded. ``Retry(delay=...)`` sets that
attempt's next delay: exact (to the second, rounded up) on the local transport, the smallest
declared tier at or above it on RabbitMQ. Each test runs on SQLite and on PostgreSQL.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import threading
import time
from collections.abc import AsyncIterator, Iterator
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel
from sqlalchemy import update

import jobrelay
from jobrelay.domain.states import JobState
from jobrelay.errors import AttemptSuperseded, ConfigError
from jobrelay.runtime.wiring import Runtime
from jobrelay.storage.tables import jobs, outbox
from jobrelay.transport.topology import Topology
from jobrelay.worker.consumer import Worker

from .api_fixtures import build_runtime
from .test_library import Delivery  # a delivery that records its ack or reject

LEASE = timedelta(seconds=30)


class Step(BaseModel):
    n: int
    delay: float | None = None


app = jobrelay.App()
effects: list[tuple[int, int, str]] = []  # (n, attempt, thread name)
started = threading.Event()
release = threading.Event()
returned = threading.Event()  # the superseded body is done
superseded: list[bool] = []  # what the superseded thread saw


@app.job("sync.step", params=Step, max_attempts=3, retry_delays=(7,))
def step(ctx: jobrelay.SyncJobContext[Step], params: Step) -> jobrelay.Result | None:
    effects.append((params.n, ctx.attempt, threading.current_thread().name))
    if params.n == 13:
        ctx.progress(3, 10)  # kept on the job in retry_wait
        raise jobrelay.Retry("thirteen is unlucky")
    if params.n == 666:
        raise jobrelay.Permanent("666 is refused for good")
    if params.n == 99:  # the lease test: wait until the test has superseded this claim
        started.set()
        release.wait(10)
        # Fenced: another claim holds the job by now. The write is the progress writer's,
        # a moment later (``worker.progress``): the body learns at a report after it.
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                ctx.progress(1, 1)
            except AttemptSuperseded:
                superseded.append(ctx.lease_lost.is_set() and ctx.cancelled.is_set())
                break
            time.sleep(0.02)
        returned.set()
        return jobrelay.Result(key="late", meta={"late": True})
    ctx.progress(params.n, 10)
    ctx.log.info("stepped")
    return jobrelay.Result(meta={"n": params.n, "lost": ctx.lease_lost.is_set()})


@app.job("async.limited", params=Step, retry_delays=(7,))
async def limited(ctx: jobrelay.JobContext[Step], params: Step) -> None:
    delay = params.delay if params.delay is None or params.delay >= 0 else timedelta(seconds=90)
    raise jobrelay.Retry("rate limited", delay=delay)


@app.job("sync.limited", params=Step, retry_delays=(7,))
def sync_limited(ctx: jobrelay.SyncJobContext[Step], params: Step) -> None:
    raise jobrelay.Retry("rate limited (sync)", delay=params.delay)


@pytest.fixture
async def rt(database_url: str, tmp_path: Path) -> AsyncIterator[Runtime]:
    runtime = dataclasses.replace(build_runtime(database_url, tmp_path), app=app)
    effects.clear()
    started.clear()
    release.clear()
    returned.clear()
    superseded.clear()
    yield runtime
    release.set()
    await runtime.engine.dispose()


async def enqueue(rt: Runtime, job: jobrelay.JobDefinition[Any], **params: Any) -> str:
    async with rt.engine.begin() as conn:
        return await job.enqueue(conn, params)


async def run_job(rt: Runtime, job_id: str, job_type: str = "sync.step") -> Delivery:
    body = json.dumps({"jobId": job_id, "type": job_type, "version": 1}).encode()
    delivery = Delivery(body)
    await Worker(rt).handle(delivery)
    return delivery


async def events(rt: Runtime, job_id: str, kind: str) -> list[dict[str, Any]]:
    return [e.detail | {"at": e.at} for e in await rt.store.events(job_id) if e.kind == kind]


# --- 1. plain def jobs ----------------------------------------------------------------------


async def test_a_def_job_succeeds_once_in_a_thread_with_its_progress(rt: Runtime) -> None:
    job_id = await enqueue(rt, step, n=4)
    assert (await run_job(rt, job_id)).outcomes == ["ack"]
    job = await rt.store.get_job(job_id)
    assert job is not None and job.state is JobState.SUCCEEDED, job
    assert [e[:2] for e in effects] == [(4, 1)]  # the side effect happened once
    assert effects[0][2].startswith("jobrelay-sync")  # in the pool, not on the loop
    assert job.result_meta is not None and job.result_meta["n"] == 4
    assert job.result_meta["lost"] is False
    # Its progress was recorded (fenced on its claim): see the retry test, since a success
    # still clears progress that is not the export's rows (issue 24, item 6).
    assert len(await events(rt, job_id, "result_saved")) == 1
    # A second delivery of the finished job does not run it again.
    await run_job(rt, job_id)
    assert len(effects) == 1


async def test_a_def_job_raising_retry_retries_and_permanent_quarantines(rt: Runtime) -> None:
    unlucky = await enqueue(rt, step, n=13)
    refused = await enqueue(rt, step, n=666)
    await run_job(rt, unlucky)
    job = await rt.store.get_job(unlucky)
    assert job is not None and job.state is JobState.RETRY_WAIT
    assert job.last_error == "thirteen is unlucky"
    assert (job.progress_done, job.progress_total) == (3, 10)  # progress from the thread
    assert [e["delaySeconds"] for e in await events(rt, unlucky, "retry_scheduled")] == [7]
    assert (await run_job(rt, refused)).outcomes == ["reject"]
    job = await rt.store.get_job(refused)
    assert job is not None and job.state is JobState.QUARANTINED
    assert job.quarantine_reason == "666 is refused for good"
    assert [e[:2] for e in effects] == [(13, 1), (666, 1)]  # each ran once
    assert all(e[2].startswith("jobrelay-sync") for e in effects)  # in the pool


async def test_a_superseded_def_jobs_late_return_is_discarded(rt: Runtime) -> None:
    job_id = await enqueue(rt, step, n=99)
    first = asyncio.create_task(run_job(rt, job_id))
    assert await asyncio.to_thread(started.wait, 10)
    # The first claim's lease lapses (a stalled worker) and another worker takes the job over
    # and finishes it, while the first thread is still running.
    async with rt.engine.begin() as conn:
        await conn.execute(
            update(jobs)
            .where(jobs.c.id == job_id)
            .values(lease_expires_at=rt.clock() - timedelta(seconds=60))
        )
    claim = await rt.store.claim_job(job_id, "worker-other", rt.clock(), LEASE)
    assert claim is not None and claim.attempt == 2
    assert (await rt.store.complete(claim, "theirs", {"by": "other"}, rt.clock())).won
    release.set()
    await asyncio.wait_for(first, 20)
    job = await rt.store.get_job(job_id)
    assert job is not None and job.state is JobState.SUCCEEDED
    assert job.result_key == "theirs" and job.result_meta == {"by": "other"}
    assert len(await events(rt, job_id, "result_saved")) == 1  # no second result
    assert len(await events(rt, job_id, "lease_lost")) == 1
    # The thread outlives the attempt's task (a thread cannot be cancelled): wait for it.
    await asyncio.to_thread(returned.wait, 20)
    assert superseded == [True]  # its progress was refused and its events set
    job = await rt.store.get_job(job_id)
    assert job is not None and job.progress_done is None  # the late progress was not written


class NotAJob:
    pass


def numbers(ctx: Any, params: Step) -> Iterator[int]:
    yield 1


async def agen(ctx: Any, params: Step) -> AsyncIterator[int]:
    yield 1


@pytest.mark.parametrize("thing", [NotAJob, numbers, agen, 42, "sync.step"])
def test_defining_a_job_with_a_non_function_is_refused(thing: Any) -> None:
    other = jobrelay.App()
    with pytest.raises(ConfigError) as refused:
        other.job("x.y", params=Step)(thing)
    message = str(refused.value)
    assert message.startswith("@app.job: x.y: ") and message.count(". ") == 0, message
    assert "not a job function" in message
    assert "x.y" not in other.jobs


def params_only(params: Step) -> None:
    pass


async def params_only_async(params: Step) -> None:
    pass


async def one_too_many(ctx: Any, params: Step, extra: int) -> None:
    pass


@pytest.mark.parametrize(
    "fn",
    [params_only, params_only_async, one_too_many, lambda params: None],
    # Ids the same in every xdist process (str() of a function carries its address).
    ids=["params_only", "params_only_async", "one_too_many", "lambda_params"],
)
def test_a_job_function_without_ctx_and_params_is_refused_at_definition(fn: Any) -> None:
    # Coming from Celery, `def f(params)` looks right: it used to be accepted here and fail
    # on every attempt at run time (TypeError), until the job was quarantined.
    other = jobrelay.App()
    with pytest.raises(ConfigError) as refused:
        other.job("x.y", params=Step)(fn)
    message = str(refused.value)
    assert message.startswith("@app.job: x.y: ") and message.count(". ") == 0, message
    assert "(ctx, params)" in message and "SyncJobContext[Step]" in message, message
    assert "x.y" not in other.jobs


class Plain(dict[str, Any]):
    pass


@pytest.mark.parametrize("model", [dict, Plain, Step(n=1), int, "Step", None], ids=repr)
def test_params_that_are_not_a_pydantic_model_class_are_refused_at_definition(
    model: Any,
) -> None:
    other = jobrelay.App()
    with pytest.raises(ConfigError) as refused:
        other.job("x.y", params=model)
    message = str(refused.value)
    assert message.startswith("@app.job: x.y: ") and message.count(". ") == 0, message
    assert "class Params(BaseModel)" in message and "extra='allow'" in message, message
    assert "x.y" not in other.jobs


class Bound:
    def __call__(self, ctx: Any, params: Step) -> None:
        pass


def with_options(ctx: Any, params: Step, *, flag: bool = False, limit: int = 1) -> None:
    pass


def prefixed(tag: str, ctx: Any, params: Step) -> None:
    pass


@pytest.mark.parametrize(
    "fn",
    [Bound(), with_options, functools.partial(prefixed, "t"), lambda *args: None],
    ids=["callable_object", "with_options", "partial", "lambda_args"],
)
def test_what_takes_ctx_and_params_is_accepted(fn: Any) -> None:
    other = jobrelay.App()
    assert other.job("x.y", params=Step)(fn).type == "x.y"


async def test_a_lambda_returning_a_coroutine_is_a_job(rt: Runtime) -> None:
    async def body(ctx: jobrelay.JobContext[Step], params: Step) -> jobrelay.Result:
        return jobrelay.Result(meta={"lambda": params.n})

    lam = app.job("lambda.job", params=Step)(lambda ctx, params: body(ctx, params))
    try:
        job_id = await enqueue(rt, lam, n=5)
        await run_job(rt, job_id, "lambda.job")
        job = await rt.store.get_job(job_id)
        assert job is not None and job.state is JobState.SUCCEEDED
        assert job.result_meta is not None and job.result_meta["lambda"] == 5
    finally:
        app._jobs.pop("lambda.job")


# --- 3. Retry(delay=...) --------------------------------------------------------------------


async def retried(rt: Runtime, job_id: str, job_type: str) -> tuple[dict[str, Any], datetime]:
    await run_job(rt, job_id, job_type)
    job = await rt.store.get_job(job_id)
    assert job is not None and job.state is JobState.RETRY_WAIT
    assert job.next_attempt_at is not None
    (scheduled,) = await events(rt, job_id, "retry_scheduled")
    return scheduled, job.next_attempt_at


def due_after(scheduled: dict[str, Any], due: datetime) -> float:
    return (due - scheduled["at"]).total_seconds()


async def test_retry_delay_is_exact_on_the_local_transport(rt: Runtime) -> None:
    asked = await enqueue(rt, limited, n=1, delay=42)
    scheduled, due = await retried(rt, asked, "async.limited")
    assert scheduled["delaySeconds"] == 42 and scheduled["askedDelaySeconds"] == 42
    assert scheduled["error"] == "rate limited"  # the reason is kept
    assert 41 <= due_after(scheduled, due) <= 43
    async with rt.engine.connect() as conn:
        rows = (await conn.execute(outbox.select().where(outbox.c.job_id == asked))).all()
    assert rows[-1].destination == "retry.42s"
    # A copy delivered now is not claimed: the attempt waits for its asked delay.
    await run_job(rt, asked, "async.limited")
    assert len(await events(rt, asked, "claimed")) == 1
    (early,) = await events(rt, asked, "duplicate_acked")
    assert early["at"] < due and early["reason"].startswith("retry due")

    timed = await enqueue(rt, limited, n=1, delay=-1)  # a timedelta of 90 s
    scheduled, due = await retried(rt, timed, "async.limited")
    assert scheduled["delaySeconds"] == 90 and 89 <= due_after(scheduled, due) <= 91

    fraction = await enqueue(rt, sync_limited, n=1, delay=2.5)  # a def job, rounded up
    scheduled, due = await retried(rt, fraction, "sync.limited")
    assert scheduled["delaySeconds"] == 3 and scheduled["askedDelaySeconds"] == 2.5
    assert scheduled["error"] == "rate limited (sync)"

    plain = await enqueue(rt, limited, n=1)  # no delay: the type's retry_delays
    scheduled, _ = await retried(rt, plain, "async.limited")
    assert scheduled["delaySeconds"] == 7 and "askedDelaySeconds" not in scheduled


async def test_retry_delay_on_rabbitmq_rounds_up_to_a_declared_tier(rt: Runtime) -> None:
    rabbit = dataclasses.replace(
        rt, topology=Topology(retry_delays=(5, 7, 30), delivery_limit=5, dynamic_delays=False)
    )
    between = await enqueue(rt, limited, n=1, delay=12)
    scheduled, due = await retried(rabbit, between, "async.limited")
    assert scheduled["delaySeconds"] == 30 and scheduled["askedDelaySeconds"] == 12
    assert scheduled["error"] == "rate limited"
    assert 29 <= due_after(scheduled, due) <= 31  # retry_wait's next attempt is the tier's
    async with rt.engine.connect() as conn:
        rows = (await conn.execute(outbox.select().where(outbox.c.job_id == between))).all()
    assert rows[-1].destination == "retry.30s" and rabbit.topology.routes("retry.30s")

    beyond = await enqueue(rt, limited, n=1, delay=-1)  # 90 s: past the longest tier
    scheduled, due = await retried(rabbit, beyond, "async.limited")
    assert scheduled["delaySeconds"] == 30 and scheduled["askedDelaySeconds"] == 90
    assert 29 <= due_after(scheduled, due) <= 31


def test_retry_delay_must_be_positive() -> None:
    with pytest.raises(ValueError, match="delay"):
        jobrelay.Retry("x", delay=0)
    assert jobrelay.Retry("x", delay=timedelta(seconds=3)).delay == 3.0
    assert jobrelay.Retry("x").delay is None and str(jobrelay.Retry("x", delay=1)) == "x"


async def test_the_pool_has_the_workers_sync_threads(rt: Runtime) -> None:
    settings = rt.settings.model_copy(update={"sync_threads": 3, "sync_abandoned_max": 2})
    threads = Worker(dataclasses.replace(rt, settings=settings)).deliveries.threads
    assert (threads.size, threads.abandoned_max) == (3, 2)  # the worker's own pool
