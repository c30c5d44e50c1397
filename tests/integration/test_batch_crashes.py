"""Batches of every size, crashed between their statements and their acks (issue 23).

A worker runs N jobs with C slots (so its claims and completions go in batches of up to C,
and its acks as ``multiple`` frames), and dies at a named point: right after a completion
statement committed and before any of its acks (``worker.after_complete``), or at the n-th
ack, when earlier batches were acked and the next statement was sent (``worker.before_ack``).
A fresh worker then takes what came back. Fixed cases run every time; hypothesis adds random
sizes, slots and crash points. On SQLite + the local transport and on PostgreSQL
+ RabbitMQ (``backend``). What must hold, read from the database and the broker:

- nothing is lost: every job ends ``succeeded``, and the work queue drains to empty;
- nothing is done twice: one ``result_saved`` per job; a job whose completion committed
  before the crash never runs again (its redelivery is a duplicate, acked without work) and
  was claimed once; a job the crash caught mid-run runs again, on its second attempt;
- nothing is quarantined.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jobrelay.domain.states import JobState
from jobrelay.library.operations import OperationContext, OperationResult

from .test_claims import eventually
from .test_outcomes import Scripted, start_worker

pytestmark = pytest.mark.timeout(180)

# (jobs, slots, fault): a batch of one; batches of 4, 16, 100 crashed after their n-th
# completion statement; batches of 16 and 32 crashed at an ack past the first batch's.
CASES = [
    (1, 1, "worker.after_complete:crash:1"),
    (12, 4, "worker.after_complete:crash:2"),
    (50, 16, "worker.after_complete:crash:3"),
    (100, 100, "worker.after_complete:crash:1"),
    (30, 16, "worker.before_ack:crash:20"),
    (64, 32, "worker.before_ack:crash:33"),
]


def _period(i: int) -> str:
    return f"{2000 + i // 12}-{i % 12 + 1:02d}"


async def _done(ctx: OperationContext) -> OperationResult:
    return OperationResult(f"exports/{ctx.job.params['period']}.csv", {"rows": 1})


@pytest.mark.parametrize(("jobs", "slots", "fault"), CASES)
async def test_a_crashed_batch_loses_nothing_and_does_nothing_twice(
    make_pipeline: Any, jobs: int, slots: int, fault: str
) -> None:
    await crash_and_recover(make_pipeline, "acme", jobs, slots, fault)


_examples = itertools.count()


@settings(
    max_examples=3,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],  # a factory: fresh each time
)
@given(
    jobs=st.integers(min_value=1, max_value=100),
    slots=st.integers(min_value=1, max_value=100),
    point=st.sampled_from(["worker.after_complete", "worker.before_ack"]),
    nth=st.integers(min_value=1, max_value=40),
)
async def test_random_batches_crashed_anywhere_lose_nothing(
    make_pipeline: Any, jobs: int, slots: int, point: str, nth: int
) -> None:
    # The n-th hit must come: one ack per job; a completion statement holds at most
    # ``slots`` jobs, so there are at least ceil(jobs / slots) of them.
    most = jobs if point == "worker.before_ack" else -(-jobs // slots)
    fault = f"{point}:crash:{min(nth, most)}"
    await crash_and_recover(make_pipeline, f"h{next(_examples)}", jobs, slots, fault)


async def crash_and_recover(
    make_pipeline: Any, account: str, jobs: int, slots: int, fault: str
) -> None:
    """Run ``jobs`` jobs of ``account`` on a worker with ``slots`` slots that dies at
    ``fault``, then on a fresh one; check the promises."""
    async with make_pipeline(
        faults=fault, prefetch=str(max(slots, 8)), concurrency=str(slots), lease_seconds="5"
    ) as p:
        periods = [_period(i) for i in range(jobs)]
        job_ids = [await p.submit(account=account, period=period) for period in periods]
        operation = Scripted(dict.fromkeys(periods, _done))
        p.start_relay()
        await start_worker(p, operation)
        await p.kill_crashed_worker(timeout=60)
        committed = {
            job_id
            for job_id in job_ids
            if (job := await p.rt.store.get_job(job_id)) and job.state is JobState.SUCCEEDED
        }
        if fault.startswith("worker.after_complete"):
            assert committed  # the crash came after a completion committed
        await start_worker(p, operation)  # the fault fired once: the fresh worker runs clean
        for job_id in job_ids:
            await p.wait_for(job_id, lambda j: j.state is JobState.SUCCEEDED, timeout=60)

        async def drained() -> bool:
            return await p.rt.transport.work_ready() == 0

        await eventually(drained, "the work queue drained (every redelivery settled)")
        assert await p.rt.transport.quarantine_depth() == 0
        for job_id, period in zip(job_ids, periods, strict=True):
            job = await p.rt.store.get_job(job_id)
            kinds = await p.kinds(job_id)
            assert job is not None and kinds.count("result_saved") == 1, kinds
            if job_id in committed:
                assert operation.runs[period] == 1 and kinds.count("claimed") == 1, kinds
                assert job.attempt == 1, job
            else:
                assert operation.runs[period] <= 2 and job.attempt <= 2, (job, kinds)
