"""Progress is advisory (issue 34, item 6): a progress write the database does not take (a
blip) is logged and written later, never the job's failure; only a lost claim stops the run.

The blip is a store whose progress writes fail twice (the second and the last of three, as a
dropped connection would: ``StoreError``); the job must succeed on its first attempt with its
last progress written (by its success's own statement: issue 41, item 4). Each write is made
as soon as it is reported here (the writer's pauses set to 0), and the job waits for each
try before its next report. For an ``async def`` and a plain ``def`` job, on SQLite and
PostgreSQL (``database_url``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import threading
from collections.abc import Awaitable, Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

import jobrelay
from jobrelay.domain.states import JobState
from jobrelay.errors import StoreError
from jobrelay.runtime.wiring import Runtime
from jobrelay.storage.store import Claim
from jobrelay.worker import progress
from jobrelay.worker.consumer import Worker

from .api_fixtures import build_runtime
from .test_library import Delivery  # a delivery that records its ack or reject

pytestmark = pytest.mark.timeout(120)

app = jobrelay.App()
attempts: list[int] = []
tries: list[int] = []  # every progress write tried, by its number (``blip``)
STEPS = 3
WAIT_SECONDS = 30


_tried = threading.Condition()


def wait_tried(n: int) -> None:
    """Until the n-th progress write was tried (landed or failed)."""
    with _tried:
        _tried.wait_for(lambda: len(tries) >= n, WAIT_SECONDS)


class Steps(BaseModel):
    n: int = 0


@app.job("progress.steps", params=Steps, max_attempts=3)
async def steps(ctx: jobrelay.JobContext[Steps], params: Steps) -> jobrelay.Result:
    attempts.append(ctx.attempt)
    for done in range(1, STEPS + 1):
        await ctx.progress(done, STEPS)
        await asyncio.to_thread(wait_tried, done)
    return jobrelay.Result(meta={"steps": STEPS})


@app.job("progress.sync_steps", params=Steps, max_attempts=3)
def sync_steps(ctx: jobrelay.SyncJobContext[Steps], params: Steps) -> jobrelay.Result:
    attempts.append(ctx.attempt)
    for done in range(1, STEPS + 1):
        ctx.progress(done, STEPS)
        wait_tried(done)
    return jobrelay.Result(meta={"steps": STEPS, "thread": threading.current_thread().name})


@app.job("progress.quick", params=Steps, max_attempts=3)
async def quick(ctx: jobrelay.JobContext[Steps], params: Steps) -> jobrelay.Result:
    for done in range(STEPS + 1):
        await ctx.progress(done, STEPS)
    return jobrelay.Result(meta={"steps": STEPS})


def blip(rt: Runtime, failing: set[int]) -> list[int]:
    """Make the n-th progress writes (1-based, in ``failing``) fail as a dropped connection
    would; returns the list of the writes' numbers that reached the database."""
    real: Callable[[Claim, int, int, datetime], Awaitable[bool]] = rt.store.report_progress
    calls = 0
    written: list[int] = []

    async def report_progress(claim: Claim, done: int, total: int, now: datetime) -> bool:
        nonlocal calls
        calls += 1
        with _tried:
            tries.append(calls)
            _tried.notify_all()
        if calls in failing:
            raise StoreError("database write failed: connection dropped (a blip)")
        written.append(done)
        return await real(claim, done, total, now)

    rt.store.report_progress = report_progress  # type: ignore[method-assign]
    return written


@pytest.mark.parametrize("job", [steps, sync_steps], ids=["async", "def"])
async def test_a_failed_progress_write_is_retried_not_the_jobs_failure(
    database_url: str,
    tmp_path: Path,
    job: jobrelay.JobDefinition[Any],
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(progress, "_FIRST_WRITE_SECONDS", 0.0)
    monkeypatch.setattr(progress, "_WRITE_EVERY_SECONDS", 0.0)
    caplog.set_level(logging.INFO, logger="jobrelay.worker")
    attempts.clear()
    tries.clear()
    rt = dataclasses.replace(build_runtime(database_url, tmp_path), app=app)
    try:
        async with rt.engine.begin() as conn:
            job_id = await job.enqueue(conn, Steps())
        written = blip(rt, {2, 3})  # the second and the last write fail
        delivery = Delivery(json.dumps({"jobId": job_id, "type": job.type, "version": 1}).encode())

        await Worker(rt).handle(delivery)

        assert delivery.outcomes == ["ack"]
        found = await rt.store.get_job(job_id)
        assert found is not None and found.state is JobState.SUCCEEDED, found.last_error
        assert found.attempt == 1 and attempts == [1]  # ran once, charged nothing
        assert tries == [1, 2, 3]  # the second failed, and its retry (the last figures)
        assert written == [1]
        # The figures the database did not take were written by the success.
        assert (found.progress_done, found.progress_total) == (STEPS, STEPS)
        held = [r for r in caplog.records if getattr(r, "event", None) == "progress_held"]
        assert held and all(r.levelno == logging.WARNING for r in held)
        assert all(getattr(r, "jobId", None) == job_id for r in held)
    finally:
        await rt.engine.dispose()


async def test_a_short_jobs_progress_is_written_by_its_success(
    database_url: str, tmp_path: Path
) -> None:
    """Issue 41, item 4: a job done within its first progress pause writes its progress in
    its success's statement, not in commits of its own (old code: one per report)."""
    tries.clear()
    rt = dataclasses.replace(build_runtime(database_url, tmp_path), app=app)
    try:
        async with rt.engine.begin() as conn:
            job_id = await quick.enqueue(conn, Steps())
        written = blip(rt, set())
        delivery = Delivery(
            json.dumps({"jobId": job_id, "type": quick.type, "version": 1}).encode()
        )

        await Worker(rt).handle(delivery)

        assert delivery.outcomes == ["ack"]
        found = await rt.store.get_job(job_id)
        assert found is not None and found.state is JobState.SUCCEEDED, found.last_error
        assert (found.progress_done, found.progress_total) == (STEPS, STEPS)
        assert tries == [] and written == []
    finally:
        await rt.engine.dispose()
