"""Progress is advisory (issue 34, item 6): a progress write the database does not take (a
blip) is logged and written later, never the job's failure; only a lost claim stops the run.

The blip is a store whose progress writes fail twice (the second and the last of three, as a
dropped connection would: ``StoreError``); the job must succeed on its first attempt with its
last progress written. For an ``async def`` and a plain ``def`` job, on SQLite and
PostgreSQL (``database_url``).
"""

from __future__ import annotations

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
from jobrelay.worker.consumer import Worker

from .api_fixtures import build_runtime
from .test_library import Delivery  # a delivery that records its ack or reject

pytestmark = pytest.mark.timeout(120)

app = jobrelay.App()
attempts: list[int] = []
STEPS = 3


class Steps(BaseModel):
    n: int = 0


@app.job("progress.steps", params=Steps, max_attempts=3)
async def steps(ctx: jobrelay.JobContext[Steps], params: Steps) -> jobrelay.Result:
    attempts.append(ctx.attempt)
    for done in range(1, STEPS + 1):
        await ctx.progress(done, STEPS)
    return jobrelay.Result(meta={"steps": STEPS})


@app.job("progress.sync_steps", params=Steps, max_attempts=3)
def sync_steps(ctx: jobrelay.SyncJobContext[Steps], params: Steps) -> jobrelay.Result:
    attempts.append(ctx.attempt)
    for done in range(1, STEPS + 1):
        ctx.progress(done, STEPS)
    return jobrelay.Result(meta={"steps": STEPS, "thread": threading.current_thread().name})


def blip(rt: Runtime, failing: set[int]) -> list[int]:
    """Make the n-th progress writes (1-based, in ``failing``) fail as a dropped connection
    would; returns the list of the writes' numbers that reached the database."""
    real: Callable[[Claim, int, int, datetime], Awaitable[bool]] = rt.store.report_progress
    calls = 0
    written: list[int] = []

    async def report_progress(claim: Claim, done: int, total: int, now: datetime) -> bool:
        nonlocal calls
        calls += 1
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
) -> None:
    caplog.set_level(logging.INFO, logger="jobrelay.worker")
    attempts.clear()
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
        assert (found.progress_done, found.progress_total) == (STEPS, STEPS)  # written later
        assert written[0] == 1 and written[-1] == STEPS
        held = [r for r in caplog.records if getattr(r, "event", None) == "progress_held"]
        assert held and all(r.levelno == logging.WARNING for r in held)
        assert all(getattr(r, "jobId", None) == job_id for r in held)
    finally:
        await rt.engine.dispose()
