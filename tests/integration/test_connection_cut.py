"""A completion whose answer a cut connection lost (issue 38), on a throwaway server.

``worker.after_complete:cut:1``: the batch's completion committed, then the server ends every
session of the database (``pg_terminate_backend``, as a failover does) before the worker reads
the answer. The worker cannot know whether it committed: it must find out by reading (its own
``result_saved``), and ack, never run the job again; its connections, all gone, are replaced,
and the next jobs run as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest
from pydantic import BaseModel

import jobrelay
from jobrelay.domain.states import JobState
from jobrelay.errors import StoreError

from ..conftest import OwnDatabase
from .pipeline import pipeline, settings_for

pytestmark = [pytest.mark.postgres, pytest.mark.timeout(120)]

T = TypeVar("T")

app = jobrelay.App()
runs: Counter[str] = Counter()


class Once(BaseModel):
    n: int


@app.job("cut.once", params=Once)
async def once(ctx: jobrelay.JobContext[Once], p: Once) -> Any:
    runs[ctx.job_id] += 1
    return {"n": p.n}


async def ended(p: Any, job_id: str) -> Any:
    """The job once it has ended; the test's own pooled connections were cut too (the same
    engine), so a read may fail once while the pool replaces them."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        with contextlib.suppress(StoreError):
            job = await p.store.get_job(job_id)
            if job is not None and job.state.is_terminal:
                return job
        await asyncio.sleep(0.05)  # polling the job's row, with a deadline
    raise AssertionError(f"job {job_id} did not end in 60 s")


async def read_again(read: Callable[[], Awaitable[T]]) -> T:
    """``read`` on the test's own engine, whose pooled connections the cut ended too: one
    pooled connection after another may fail once (CI: the timeline read right after
    ``ended`` met another of them) while the pool replaces them."""
    deadline = time.monotonic() + 60
    while True:
        try:
            return await read()
        except StoreError:
            if time.monotonic() > deadline:
                raise
        await asyncio.sleep(0.05)  # a pooled connection the cut ended: the next one


async def test_a_completion_whose_answer_was_cut_off_is_read_back_not_run_again(
    own_pg: OwnDatabase, tmp_path: Path
) -> None:
    runs.clear()
    settings = settings_for(
        own_pg.url, "local", tmp_path / "exports", faults="worker.after_complete:cut:1"
    )
    async with pipeline(settings) as p:
        p.rt = dataclasses.replace(p.rt, app=app)
        first = (await p.store.submit(once.new_job(Once(n=1)), p.rt.clock()))[0]
        p.start_relay()
        await p.start_worker()
        done = await ended(p, first)
        assert done.state is JobState.SUCCEEDED and done.attempt == 1
        assert runs[first] == 1  # read back as its own, not run again
        kinds = await read_again(lambda: p.kinds(first))
        assert kinds.count("result_saved") == 1 and "claimed" in kinds
        # Every session was cut: the worker and the relay go on, on new connections.
        later = (await p.store.submit(once.new_job(Once(n=2)), p.rt.clock()))[0]
        again = await ended(p, later)
        assert again.state is JobState.SUCCEEDED and runs[later] == 1
