"""The loop watchdog names the job that blocks the loop (issue 34). A lag from machine load
just before a job blocks the loop is warned about first, naming no job; the block that
follows, still in the same stall, must be warned about again, naming the job."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from jobrelay.observe.metrics import Metrics
from jobrelay.worker.loop_watch import LoopWatch


async def test_a_job_that_blocks_after_a_lag_is_named(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="jobrelay.worker")
    watchdog = LoopWatch(Metrics(), 0.2, "w-1")
    watchdog.start()
    try:
        await asyncio.sleep(0.3)  # the watchdog has checked in once

        async def blocking_job() -> None:
            time.sleep(2.0)  # noqa: ASYNC251 -- on purpose: the job blocks the loop

        loop = asyncio.get_running_loop()
        # First the loop lags with no job running (a callback, not a job's task), then,
        # before the watchdog's check-in is answered, the job's first step blocks it.
        loop.call_soon(time.sleep, 1.0)
        job = asyncio.create_task(blocking_job(), name="jobrelay-job:J1:report.export")
        await job
    finally:
        watchdog.stop()
    blocked = [r for r in caplog.records if getattr(r, "event", None) == "loop_blocked"]
    assert [getattr(r, "jobId", None) for r in blocked if getattr(r, "jobId", None)] == ["J1"]
