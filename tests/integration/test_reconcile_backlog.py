"""A queued job is re-sent when its message is gone, never for waiting its turn.

No constant grace fits every backlog: a job behind a backlog longer than the grace used to
get a second message (1,324 of 2,000 at a 5 s grace). The reconciler now re-sends only when
its queue has moved past the job (more later jobs claimed than the workers' windows hold) or
its workers sat idle; with no worker consuming the queue it says so and re-sends nothing.
Both databases (and, with the pipeline, both transports).
"""

from __future__ import annotations

import asyncio
import time
from datetime import timedelta
from typing import Any

import pytest

from jobrelay.domain.states import JobState
from jobrelay.maintenance.reconcile import QUEUED_UNCLAIMED, Finding, Reconciler
from jobrelay.runtime.wiring import Runtime
from jobrelay.storage.store import Claim

from .ops_fixtures import backend, job_in_state, kinds, make_pipeline
from .test_reconcile import (
    GRACE,
    clock,
    idle_worker,
    mark_all_published,
    outbox_count,
    runtime,
)

pytestmark = pytest.mark.timeout(120)
__all__ = ["backend", "make_pipeline", "runtime"]  # fixtures, shared
S = JobState
NOT_CONSUMING = "not_consuming"  # reconcile.NOT_CONSUMING, spelled out as operators read it


async def test_with_no_worker_consuming_the_queue_nothing_is_resent_and_the_pass_says_so(
    runtime: Runtime, caplog: pytest.LogCaptureFixture
) -> None:
    jobs = [
        await job_in_state(runtime.store, S.QUEUED, runtime.clock(), f"2020-0{m}")
        for m in (1, 2, 3)
    ]
    await mark_all_published(runtime)
    clock(runtime).advance(10 * GRACE)
    report = await Reconciler(runtime).run_once(scan_quarantine=False)

    [finding] = report.findings
    assert (finding.kind, finding.job_id, finding.repaired) == (NOT_CONSUMING, None, False)
    assert "queue default: 3 job(s) queued" in finding.detail
    assert "workers are not consuming" in finding.detail
    assert [await outbox_count(runtime, j) for j in jobs] == [1, 1, 1]
    gauge = runtime.metrics.reconcile_findings.labels(finding=NOT_CONSUMING)
    assert gauge._value.get() == 1  # what /metrics shows operators
    [line] = [r for r in caplog.records if getattr(r, "event", "") == "reconcile_not_consuming"]
    assert line.levelname == "WARNING" and "workers are not consuming" in line.getMessage()

    # A worker of another queue changes nothing; one of this queue, idle: the messages are gone.
    await idle_worker(runtime, ("images",), "host:8:images")
    report = await Reconciler(runtime).run_once(scan_quarantine=False)
    assert [f.kind for f in report.findings] == [NOT_CONSUMING]
    await idle_worker(runtime)
    report = await Reconciler(runtime).run_once(scan_quarantine=False)
    assert sorted((f.kind, f.job_id, f.repaired) for f in report.findings) == sorted(
        (QUEUED_UNCLAIMED, j, True) for j in jobs
    )


async def test_a_job_behind_a_moving_backlog_waits_until_the_queue_moved_past_it(
    runtime: Runtime,
) -> None:
    """Later jobs claimed, but no more than the worker's window (prefetch) could hold before
    the waiting one: it is waiting its turn. One more claimed: the queue passed it."""
    window = runtime.settings.prefetch
    waiting = await job_in_state(runtime.store, S.QUEUED, runtime.clock(), "1999-01")
    await mark_all_published(runtime)
    later: list[str] = []
    for n in range(window + 1):
        clock(runtime).advance(0.01)
        period = f"{2000 + n // 12}-{n % 12 + 1:02d}"
        job_id = await job_in_state(runtime.store, S.QUEUED, runtime.clock(), period)
        await _publish(runtime, job_id)
        later.append(job_id)
    clock(runtime).advance(GRACE + 1)
    for job_id in later[:window]:  # claimed (and finished) after the waiting job's message
        await _run(runtime, job_id)
    await idle_worker(runtime)
    report = await Reconciler(runtime).run_once(scan_quarantine=False)
    assert _about(report.findings, waiting) == []
    assert await outbox_count(runtime, waiting) == 1

    await _run(runtime, later[window])
    report = await Reconciler(runtime).run_once(scan_quarantine=False)
    [finding] = _about(report.findings, waiting)
    assert (finding.kind, finding.repaired) == (QUEUED_UNCLAIMED, True)
    assert "moved past it" in finding.detail
    assert await outbox_count(runtime, waiting) == 2


async def test_slow_workers_behind_a_backlog_longer_than_the_grace_get_no_second_message(
    make_pipeline: Any,
) -> None:
    """One slow worker, one slot, a backlog of ten jobs of 0.5 s each, a grace of 1 s: every
    job but the first waits longer than the grace, and none is re-sent."""
    async with make_pipeline(
        reconcile_grace_seconds="1",
        reconcile_seconds="0",  # the test runs the passes, and reads each one
        heartbeat_seconds="0.2",
        concurrency="1",
        faults="export.run:stall:0.5",
    ) as p:
        jobs = [await p.submit(period=f"2020-{m:02d}") for m in range(1, 11)]
        p.start_relay()
        for job_id in jobs:
            await p.wait_for(job_id, lambda j: j.published)
        await p.start_worker()
        reconciler = Reconciler(p.rt)
        findings: list[Finding] = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            findings += (await reconciler.run_once(scan_quarantine=False)).findings
            states = [(await p.store.get_job(j)).state for j in jobs]
            if all(s is S.SUCCEEDED for s in states):
                break
            await asyncio.sleep(0.1)  # the reconciler's cadence, shortened
        assert all(s is S.SUCCEEDED for s in states), states
        waited = await p.store.get_job(jobs[-1])
        assert waited.updated_at - waited.created_at > timedelta(seconds=2)  # the backlog
        assert [f for f in findings if f.kind in (QUEUED_UNCLAIMED, NOT_CONSUMING)] == []
        for job_id in jobs:
            assert "reconciled_queued_unclaimed" not in await kinds(p.rt, job_id)
            assert await outbox_count(p.rt, job_id) == 1


def _about(findings: list[Finding], job_id: str) -> list[Finding]:
    return [f for f in findings if f.job_id == job_id]


async def _publish(rt: Runtime, job_id: str) -> None:
    from sqlalchemy import update

    from jobrelay.storage.tables import outbox

    async with rt.engine.begin() as conn:
        await conn.execute(
            update(outbox).where(outbox.c.job_id == job_id).values(published_at=rt.clock())
        )


async def _run(rt: Runtime, job_id: str) -> None:
    """Claimed and finished by a worker, now by the test clock."""
    claim = await rt.store.claim_job(job_id, "host:9:worker", rt.clock(), timedelta(seconds=30))
    assert isinstance(claim, Claim)
    assert (await rt.store.complete(claim, f"k-{job_id}", {}, rt.clock())).won
