"""The reconciler: what it finds, what it repairs, and what it must never touch.

Store-level tests move a test clock instead of waiting (SQLite and PostgreSQL); the clock
drives the store too, which is the clock the reconciler judges by. The one-clock tests run on
PostgreSQL with the store on the database's own clock and this process's clock skewed, to
show that the reconciler judges by the database and never by its host. The pipeline tests
run the shipped relay and worker after a repair, on SQLite + local transport and on
PostgreSQL + RabbitMQ, to show that a repaired job really finishes.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import uuid
from collections.abc import AsyncIterator
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, select, text

from jobrelay.domain.messages import JobMessage
from jobrelay.domain.states import JobState
from jobrelay.maintenance.reconcile import (
    LEASE_EXPIRED,
    OUTBOX_STALE,
    QUARANTINE_MISMATCH,
    QUEUED_UNCLAIMED,
    RETRY_OVERDUE,
    Leadership,
    Reconciler,
)
from jobrelay.runtime.wiring import Runtime, utc_now
from jobrelay.storage.admin import AdminQueries
from jobrelay.storage.heartbeats import ProcessBeat, beat
from jobrelay.storage.queue_pauses import set_paused
from jobrelay.storage.repairs import RepairQueries
from jobrelay.storage.store import Claim, Store
from jobrelay.storage.tables import jobs, outbox
from jobrelay.transport.base import OutgoingMessage
from tests.integration.api_fixtures import T0, Clock, build_runtime

from .ops_fixtures import (
    LEASE,
    WORKER,
    eventually,
    job_in_state,
    kinds,
)

pytestmark = pytest.mark.timeout(90)
S = JobState
GRACE = 60  # Settings default for reconcile_grace_seconds


@pytest.fixture
async def runtime(database_url: str, tmp_path: Path) -> AsyncIterator[Runtime]:
    rt = build_runtime(database_url, tmp_path, clock=Clock())
    yield rt
    await rt.engine.dispose()


async def mark_all_published(rt: Runtime) -> None:
    """As if the relay sent every message, and the broker then lost it."""
    async with rt.engine.begin() as conn:
        await conn.execute(outbox.update().values(published_at=T0, claimed_until=None))


async def confirm_waiting(rt: Runtime) -> None:
    """As if a relay published every waiting row now (by the test clock)."""
    async with rt.engine.begin() as conn:
        await conn.execute(
            outbox.update()
            .where(outbox.c.published_at.is_(None))
            .values(published_at=rt.clock(), claimed_until=None)
        )


async def outbox_count(rt: Runtime, job_id: str) -> int:
    async with rt.engine.connect() as conn:
        n = await conn.scalar(select(func.count()).where(outbox.c.job_id == job_id))
    return int(n or 0)


async def idle_worker(rt: Runtime, queues: tuple[str, ...] = ("default",), name: str = "") -> None:
    """A live worker consuming ``queues`` (its heartbeat, now by the test clock). A queued
    job is re-sent only while a worker consumes its queue; idle, it would have claimed it."""
    now = rt.clock()
    worker = name or "host:9:idle"
    await beat(rt.store, ProcessBeat(worker, "worker", "host", 9, queues, now, now), now)


def clock(rt: Runtime) -> Clock:
    assert isinstance(rt.clock, Clock)
    return rt.clock


# --- expired leases ---------------------------------------------------------------------------


async def test_expired_lease_is_requeued_with_an_event_and_a_message(runtime: Runtime) -> None:
    job_id = await job_in_state(runtime.store, S.RUNNING, T0)  # lease until T0 + 30 s
    await mark_all_published(runtime)
    clock(runtime).advance(30 + GRACE - 1)
    assert (await Reconciler(runtime).run_once(scan_quarantine=False)).findings == []

    clock(runtime).advance(2)
    report = await Reconciler(runtime, actor="reconciler:test").run_once(scan_quarantine=False)

    [finding] = report.findings
    assert (finding.kind, finding.job_id, finding.repaired) == (LEASE_EXPIRED, job_id, True)
    assert WORKER in finding.detail and "re-queued" in finding.detail
    job = await runtime.store.get_job(job_id)
    assert job.state is S.RETRY_WAIT and job.lease_owner is None
    assert job.next_attempt_at == runtime.clock() and job.attempt == 1
    assert not job.published and await outbox_count(runtime, job_id) == 2
    event = (await runtime.store.events(job_id))[-1]
    assert event.kind == "reconciled_lease_expired"
    assert event.detail["actor"] == "reconciler:test" and event.detail["worker"] == WORKER
    assert runtime.metrics.reconcile_repairs.labels(finding=LEASE_EXPIRED)._value.get() == 1


async def test_dry_run_finds_the_same_and_changes_nothing(runtime: Runtime) -> None:
    job_id = await job_in_state(runtime.store, S.RUNNING, T0)
    await mark_all_published(runtime)
    clock(runtime).advance(3600)
    before = await kinds(runtime, job_id)

    report = await Reconciler(runtime).run_once(dry_run=True, scan_quarantine=False)

    [finding] = report.findings
    assert finding.kind == LEASE_EXPIRED and not finding.repaired
    assert "would re-queue" in finding.detail
    assert (await runtime.store.get_job(job_id)).state is S.RUNNING
    assert await kinds(runtime, job_id) == before and await outbox_count(runtime, job_id) == 1


# --- overdue retries --------------------------------------------------------------------------


async def test_overdue_retry_is_resent_once_then_only_reported(runtime: Runtime) -> None:
    job_id = await job_in_state(runtime.store, S.RETRY_WAIT, T0)  # due at T0 + 5 s
    await mark_all_published(runtime)
    clock(runtime).advance(5 + GRACE + 1)

    first = await Reconciler(runtime).run_once(scan_quarantine=False)

    [finding] = first.findings
    assert (finding.kind, finding.repaired) == (RETRY_OVERDUE, True)
    assert await outbox_count(runtime, job_id) == 3  # first message, its retry, the re-send
    job = await runtime.store.get_job(job_id)
    assert job.state is S.RETRY_WAIT and job.next_attempt_at == T0 + timedelta(seconds=5)
    assert (await kinds(runtime, job_id))[-1] == "reconciled_retry_overdue"

    await mark_all_published(runtime)
    clock(runtime).advance(600)
    again = await Reconciler(runtime).run_once(scan_quarantine=False)

    [still] = again.findings
    assert (still.kind, still.repaired) == (RETRY_OVERDUE, False)
    assert "are workers consuming?" in still.detail
    assert await outbox_count(runtime, job_id) == 3


# --- queued, published, never claimed ---------------------------------------------------------


async def test_queued_job_whose_message_is_gone_is_resent_again_with_back_off(
    runtime: Runtime,
) -> None:
    job_id = await job_in_state(runtime.store, S.QUEUED, T0)
    await mark_all_published(runtime)  # the broker confirmed it, then dead-lettered it
    clock(runtime).advance(GRACE - 1)
    await idle_worker(runtime)  # a live worker of the queue, idle
    assert (await Reconciler(runtime).run_once(scan_quarantine=False)).findings == []

    clock(runtime).advance(2)
    await idle_worker(runtime)  # a live worker of the queue, idle
    first = await Reconciler(runtime, actor="reconciler:test").run_once(scan_quarantine=False)

    [finding] = first.findings
    assert (finding.kind, finding.job_id, finding.repaired) == (QUEUED_UNCLAIMED, job_id, True)
    assert "re-sent" in finding.detail
    assert await outbox_count(runtime, job_id) == 2
    job = await runtime.store.get_job(job_id)
    assert job.state is S.QUEUED and job.attempt == 0 and not job.published
    event = (await runtime.store.events(job_id))[-1]
    assert event.kind == "reconciled_queued_unclaimed"
    assert event.detail["actor"] == "reconciler:test"

    # Lost again (issue 21, item 4: it used to stay queued for good). The next re-send waits
    # twice the grace after the copy's confirm; until then the pass reports it.
    await confirm_waiting(runtime)
    clock(runtime).advance(GRACE + 1)
    await idle_worker(runtime)  # a live worker of the queue, idle
    [still] = (await Reconciler(runtime).run_once(scan_quarantine=False)).findings
    assert (still.kind, still.repaired) == (QUEUED_UNCLAIMED, False)
    assert "re-sent 1 time(s) already: next re-send in 59 s" in still.detail, still.detail
    assert await outbox_count(runtime, job_id) == 2

    clock(runtime).advance(GRACE)
    await idle_worker(runtime)  # a live worker of the queue, idle
    [again] = (await Reconciler(runtime).run_once(scan_quarantine=False)).findings
    assert (again.kind, again.repaired) == (QUEUED_UNCLAIMED, True), again.detail
    assert await outbox_count(runtime, job_id) == 3
    assert (await kinds(runtime, job_id)).count("reconciled_queued_unclaimed") == 2
    await confirm_waiting(runtime)
    clock(runtime).advance(3 * GRACE)  # the third waits four times the grace
    await idle_worker(runtime)  # a live worker of the queue, idle
    [later] = (await Reconciler(runtime).run_once(scan_quarantine=False)).findings
    assert not later.repaired and "re-sent 2 time(s)" in later.detail
    clock(runtime).advance(GRACE + 1)
    await idle_worker(runtime)  # a live worker of the queue, idle
    assert (await Reconciler(runtime).run_once(scan_quarantine=False)).repaired == 1
    assert await outbox_count(runtime, job_id) == 4


async def test_a_lost_message_is_resent_once_while_the_work_queue_is_busy(
    database_url: str, tmp_path: Path
) -> None:
    """Judged by the job's age and its message's confirm time, never by an empty work queue:
    on a busy system a job whose message the broker lost must not stay queued for ever."""
    rt = build_runtime(database_url, tmp_path, local_transport=True, clock=Clock())
    try:
        await rt.transport.connect()
        job_id = await job_in_state(rt.store, S.QUEUED, T0)
        await mark_all_published(rt)  # confirmed at T0, then lost by the broker
        for _ in range(3):  # other jobs' work, still waiting for a consumer all along
            other = str(uuid.uuid4())
            await rt.transport.publish(
                OutgoingMessage(
                    "work",
                    JobMessage(other, "report.export").encode(),
                    headers={"x-jobrelay-job-id": other},
                )
            )
        clock(rt).advance(GRACE - 1)
        await idle_worker(rt)  # a live worker of the queue, idle
        assert (await Reconciler(rt).run_once(scan_quarantine=False)).findings == []

        clock(rt).advance(2)
        assert await rt.transport.work_ready() == 3  # the work queue is not empty
        await idle_worker(rt)  # a live worker of the queue, idle
        first = await Reconciler(rt).run_once(scan_quarantine=False)

        [finding] = first.findings
        assert (finding.kind, finding.job_id, finding.repaired) == (QUEUED_UNCLAIMED, job_id, True)
        assert "confirmed 61 s ago" in finding.detail and "re-sent" in finding.detail
        assert await outbox_count(rt, job_id) == 2
        assert (await kinds(rt, job_id))[-1] == "reconciled_queued_unclaimed"

        # Backed off: the queue stays busy, the job stays queued, no second copy yet.
        await confirm_waiting(rt)
        clock(rt).advance(GRACE + 1)
        await idle_worker(rt)  # a live worker of the queue, idle
        [still] = (await Reconciler(rt).run_once(scan_quarantine=False)).findings
        assert (still.kind, still.repaired) == (QUEUED_UNCLAIMED, False)
        assert "are workers consuming?" in still.detail
        assert await outbox_count(rt, job_id) == 2
        assert await rt.transport.work_ready() == 3  # the reconciler never touches the queue
    finally:
        await rt.transport.close()
        await rt.engine.dispose()


async def test_jobs_of_a_paused_queue_are_left_to_wait_however_long_the_pause(
    runtime: Runtime,
) -> None:
    # Issue 21, item 4: a pause longer than the grace used the one re-send, so a message lost
    # later stayed lost. Paused, or resumed less than the grace ago: not a finding at all.
    queued = await job_in_state(runtime.store, S.QUEUED, T0)
    waiting = await job_in_state(runtime.store, S.RETRY_WAIT, T0, period="2020-06")
    await mark_all_published(runtime)
    assert await set_paused(runtime.store, "default", True, actor="t", reason="r", now=T0)
    clock(runtime).advance(10 * GRACE)
    await idle_worker(runtime)  # a live worker of the queue, idle
    report = await Reconciler(runtime).run_once(scan_quarantine=False)
    assert report.findings == [] and await outbox_count(runtime, queued) == 1
    resumed = clock(runtime).advance(0)
    assert await set_paused(runtime.store, "default", False, actor="t", reason="r", now=resumed)
    clock(runtime).advance(GRACE - 1)
    await idle_worker(runtime)  # a live worker of the queue, idle
    assert (await Reconciler(runtime).run_once(scan_quarantine=False)).findings == []
    clock(runtime).advance(2)  # still queued a grace after the resume: lost, re-sent
    await idle_worker(runtime)  # a live worker of the queue, idle
    report = await Reconciler(runtime).run_once(scan_quarantine=False)
    assert {(f.job_id, f.repaired) for f in report.findings} == {(queued, True), (waiting, True)}
    assert "reconciled_queued_unclaimed" in await kinds(runtime, queued)


async def test_a_queued_job_whose_message_was_confirmed_lately_is_left_to_wait(
    runtime: Runtime,
) -> None:
    """However old the job, the grace period runs from its message's confirm (here a relay
    was down for a day), and a dry run finds the job once that has passed."""
    job_id = await job_in_state(runtime.store, S.QUEUED, T0)
    clock(runtime).advance(86400)
    await confirm_waiting(runtime)
    clock(runtime).advance(GRACE - 1)
    await idle_worker(runtime)  # a live worker of the queue, idle
    assert (await Reconciler(runtime).run_once(scan_quarantine=False)).findings == []

    clock(runtime).advance(2)
    await idle_worker(runtime)  # a live worker of the queue, idle
    [finding] = (await Reconciler(runtime).run_once(dry_run=True, scan_quarantine=False)).findings
    assert (finding.kind, finding.job_id) == (QUEUED_UNCLAIMED, job_id)
    assert "queued 1441 min" in finding.detail and "confirmed 61 s ago" in finding.detail
    assert "would re-send" in finding.detail
    assert await outbox_count(runtime, job_id) == 1


async def test_overdue_retry_with_its_message_still_in_the_outbox_is_an_outbox_finding(
    runtime: Runtime,
) -> None:
    job_id = await job_in_state(runtime.store, S.RETRY_WAIT, T0)
    async with runtime.engine.begin() as conn:
        await conn.execute(
            outbox.update()
            .where(outbox.c.destination == "work")
            .values(published_at=T0, claimed_until=None)
        )
        await conn.execute(
            outbox.update()
            .where(outbox.c.destination != "work")
            .values(publish_attempts=4, last_error="unroutable: no queue for 'retry.5s'")
        )
    clock(runtime).advance(5 + GRACE + 1)

    report = await Reconciler(runtime).run_once(scan_quarantine=False)

    [finding] = report.findings
    assert (finding.kind, finding.job_id, finding.repaired) == (OUTBOX_STALE, job_id, False)
    assert "retry.5s" in finding.detail and "4 publish attempt(s)" in finding.detail
    assert "unroutable" in finding.detail and "is a relay running?" in finding.detail
    assert await outbox_count(runtime, job_id) == 2


# --- guards -----------------------------------------------------------------------------------


async def test_a_repair_that_loses_its_race_never_overwrites_the_job(runtime: Runtime) -> None:
    queries = RepairQueries(runtime.store)
    running = await job_in_state(runtime.store, S.RUNNING, T0, "2020-01")
    waiting = await job_in_state(runtime.store, S.RETRY_WAIT, T0, "2020-02")
    await mark_all_published(runtime)
    now = clock(runtime).advance(3600)
    before = now - timedelta(seconds=GRACE)
    assert [j.id for j in await queries.expired_leases(before, 10)] == [running]
    assert [o.job.id for o in await queries.overdue_retries(before, 10)] == [waiting]

    # Between the find and the repair, the slow worker finishes and an operator cancels.
    claim = Claim(running, 1, WORKER)
    assert (await runtime.store.complete(claim, "exports/x.csv", {"rows": 1}, now)).won
    cancel = AdminQueries(runtime.store).cancel(waiting, actor="op", reason="r", now=now)
    assert (await cancel).done
    history = {j: await kinds(runtime, j) for j in (running, waiting)}

    assert not await queries.requeue_expired_lease(running, WORKER, before, now, "rec")
    assert not await queries.requeue_overdue_retry(waiting, before, now, "rec")

    assert (await runtime.store.get_job(running)).state is S.SUCCEEDED
    assert (await runtime.store.get_job(waiting)).state is S.CANCELLED
    assert {j: await kinds(runtime, j) for j in (running, waiting)} == history
    assert await outbox_count(runtime, running) == 1


async def test_finished_jobs_are_never_findings(runtime: Runtime) -> None:
    for n, state in enumerate((S.SUCCEEDED, S.QUARANTINED, S.CANCELLED)):
        await job_in_state(runtime.store, state, T0, f"2020-0{n + 1}")
    await mark_all_published(runtime)
    clock(runtime).advance(86400)

    report = await Reconciler(runtime).run_once(scan_quarantine=False)

    assert report.findings == []


async def test_a_renewed_lease_is_not_taken(runtime: Runtime) -> None:
    job_id = await job_in_state(runtime.store, S.RUNNING, T0)
    await mark_all_published(runtime)
    queries = RepairQueries(runtime.store)
    now = clock(runtime).advance(3600)
    before = now - timedelta(seconds=GRACE)
    [job] = await queries.expired_leases(before, 10)
    # The worker was only slow: its heartbeat renews the lease before the repair lands.
    assert await runtime.store.renew_lease(Claim(job_id, 1, WORKER), LEASE, now)

    assert not await queries.requeue_expired_lease(job_id, job.lease_owner, before, now, "rec")
    assert (await runtime.store.get_job(job_id)).state is S.RUNNING


# --- one clock: the database's -------------------------------------------------------------


def on_the_database_clock(pg_url: str, tmp_path: Path, skew: float, **settings: Any) -> Runtime:
    """A runtime whose store judges by PostgreSQL's ``now()`` while this host's clock is
    ``skew`` seconds off it (the same machine, so the two agree but for the skew)."""
    rt = build_runtime(pg_url, tmp_path)
    return dataclasses.replace(
        rt,
        store=Store(rt.engine),
        clock=lambda: utc_now() + timedelta(seconds=skew),
        settings=rt.settings.model_copy(update=settings),
    )


async def running_with_lease(rt: Runtime, lease_from_db_now: float) -> str:
    """A running job whose lease ends ``lease_from_db_now`` seconds from the database's now."""
    job_id = await job_in_state(rt.store, S.RUNNING, await rt.store.db_now())
    async with rt.engine.begin() as conn:
        await conn.execute(
            text(
                "UPDATE jobs SET lease_expires_at = now() + make_interval(secs => :s) "
                "WHERE id = :id"
            ),
            {"s": lease_from_db_now, "id": job_id},
        )
        await conn.execute(text("UPDATE outbox SET published_at = now(), claimed_until = NULL"))
    return job_id


def near(a: datetime | None, b: datetime, seconds: float = 5) -> bool:
    return a is not None and abs((a - b).total_seconds()) < seconds


async def test_a_host_clock_ahead_of_the_database_takes_no_live_lease(
    pg_url: str, tmp_path: Path
) -> None:
    # No grace at all: by this host's clock (30 s ahead) the lease ended 10 s ago.
    rt = on_the_database_clock(pg_url, tmp_path, +30, reconcile_grace_seconds=0)
    try:
        job_id = await running_with_lease(rt, +20)
        job = await rt.store.get_job(job_id)
        assert job.lease_expires_at is not None and job.lease_expires_at < rt.clock()

        report = await Reconciler(rt).run_once(scan_quarantine=False)

        assert report.findings == []
        job = await rt.store.get_job(job_id)
        assert job.state is S.RUNNING and job.lease_owner == WORKER
        assert (await kinds(rt, job_id))[-1] == "claimed"
    finally:
        await rt.engine.dispose()


async def test_a_host_clock_behind_the_database_still_repairs_an_expired_lease(
    pg_url: str, tmp_path: Path
) -> None:
    # By the database the lease ended 65 s ago, past the 60 s grace; by this host's clock
    # (30 s behind) only 35 s ago.
    rt = on_the_database_clock(pg_url, tmp_path, -30)
    assert rt.settings.reconcile_grace_seconds == GRACE
    try:
        job_id = await running_with_lease(rt, -65)
        job = await rt.store.get_job(job_id)
        assert job.lease_expires_at is not None
        assert job.lease_expires_at > rt.clock() - timedelta(seconds=GRACE)

        report = await Reconciler(rt).run_once(scan_quarantine=False)

        [finding] = report.findings
        assert (finding.kind, finding.job_id, finding.repaired) == (LEASE_EXPIRED, job_id, True)
        assert "lease expired 6" in finding.detail and "re-queued" in finding.detail
        # Everything the pass wrote is on the database's clock too, not this host's.
        db_now = await rt.store.db_now()
        job = await rt.store.get_job(job_id)
        assert job.state is S.RETRY_WAIT and near(job.next_attempt_at, db_now)
        assert near(job.updated_at, db_now)
        event = (await rt.store.events(job_id))[-1]
        assert event.kind == "reconciled_lease_expired" and near(event.at, db_now)
    finally:
        await rt.engine.dispose()


# --- through the pipeline ---------------------------------------------------------------------


async def claim_in_the_past(p: Any, job_id: str, minutes: int = 10) -> None:
    """A worker claimed the job long ago and died; its message is gone with it."""
    past = utc_now() - timedelta(minutes=minutes)
    assert await p.store.claim_job(job_id, "dead-host:1:000000", past, LEASE)
    async with p.rt.engine.begin() as conn:
        # The store took the lease from its own clock: move it back to when the claim was.
        await conn.execute(
            jobs.update()
            .where(jobs.c.id == job_id)
            .values(lease_expires_at=past + LEASE, updated_at=past)
        )
        await conn.execute(outbox.update().values(published_at=past))


async def test_a_job_whose_worker_died_finishes_after_the_repair(make_pipeline: Any) -> None:
    async with make_pipeline() as p:
        job_id = await p.submit()
        await claim_in_the_past(p, job_id)

        report = await Reconciler(p.rt).run_once()
        assert [(f.kind, f.repaired) for f in report.findings] == [(LEASE_EXPIRED, True)]

        p.start_relay()
        await p.start_worker()
        job = await p.wait_for(job_id, lambda j: j.state is S.SUCCEEDED)
        assert job.attempt == 2
        history = await kinds(p.rt, job_id)
        assert history.count("result_saved") == 1
        assert history.index("reconciled_lease_expired") < history.index("result_saved")


async def test_a_repaired_job_with_no_attempt_left_is_quarantined(make_pipeline: Any) -> None:
    async with make_pipeline(max_attempts="1") as p:
        job_id = await p.submit()
        await claim_in_the_past(p, job_id)
        await Reconciler(p.rt).run_once(scan_quarantine=False)

        p.start_relay()
        await p.start_worker()
        job = await p.wait_for(job_id, lambda j: j.state is S.QUARANTINED)
        assert "attempts exhausted" in (job.quarantine_reason or "")

        async def in_quarantine_queue() -> bool:
            return await p.rt.transport.quarantine_depth() == 1

        await eventually(in_quarantine_queue, what="the message in the quarantine queue")


async def test_a_job_whose_message_was_dead_lettered_finishes_after_the_repair(
    make_pipeline: Any,
) -> None:
    async with make_pipeline(reconcile_grace_seconds="0.5") as p:
        job_id = await p.submit()
        p.start_relay()
        await p.wait_for(job_id, lambda j: j.published)
        await p.stop_all()
        await reject_one(p.rt.transport)  # as the delivery limit would: gone to quarantine
        # A worker consumes the queue and sits idle: the message is gone, not waiting.
        await p.start_worker()

        async def repaired() -> bool:
            report = await Reconciler(p.rt).run_once(scan_quarantine=False)
            return any(f.kind == QUEUED_UNCLAIMED and f.repaired for f in report.findings)

        await eventually(repaired, what="the reconciler to re-send the lost message")
        p.start_relay()
        job = await p.wait_for(job_id, lambda j: j.state is S.SUCCEEDED)
        assert job.attempt == 1
        history = await kinds(p.rt, job_id)
        assert history.count("result_saved") == 1
        assert history.index("reconciled_queued_unclaimed") < history.index("claimed")


async def reject_one(transport: Any) -> None:
    """Consume one delivery and reject it: the broker dead-letters it to quarantine."""
    deliveries = transport.consume(1)
    try:
        delivery = await asyncio.wait_for(anext(deliveries), 20)
        await delivery.reject()
    finally:
        with contextlib.suppress(Exception):
            await deliveries.aclose()


async def test_quarantine_messages_of_unquarantined_jobs_are_reported(make_pipeline: Any) -> None:
    async with make_pipeline(faults="export.run:invalid@period=2020-01") as p:
        quarantined = await p.submit(period="2020-01")
        p.start_relay()
        await p.start_worker()
        await p.wait_for(quarantined, lambda j: j.state is S.QUARANTINED)
        await p.stop_all()
        # A copy of a queued job's message dead-lettered behind the database's back.
        stuck = await p.submit(period="2020-02")
        await p.rt.transport.publish(
            OutgoingMessage(
                "work",
                JobMessage(stuck, "report.export").encode(),
                headers={"x-jobrelay-job-id": stuck},
            )
        )
        await reject_one(p.rt.transport)

        async def both_there() -> bool:
            return await p.rt.transport.quarantine_depth() == 2

        await eventually(both_there, what="two messages in the quarantine queue")

        report = await Reconciler(p.rt).run_once()

        assert report.quarantine_scanned == 2
        mismatches = [f for f in report.findings if f.kind == QUARANTINE_MISMATCH]
        assert [(f.job_id, f.repaired) for f in mismatches] == [(stuck, False)]
        assert "job is queued" in mismatches[0].detail and "rejected" in mismatches[0].detail
        assert (await p.store.get_job(stuck)).state is S.QUEUED  # reported, not changed
        await eventually(both_there, what="the scan to give both messages back")


async def test_the_relay_process_reconciles_periodically(
    backend: tuple[str, str], tmp_path: Path
) -> None:
    from .pipeline import pipeline, settings_for

    database_url, broker_url = backend
    settings = settings_for(
        database_url,
        broker_url,
        tmp_path / "exports",
        reconcile_seconds="0.1",
        reconcile_grace_seconds="0",
    )
    async with pipeline(settings) as p:
        job_id = await p.submit()
        await claim_in_the_past(p, job_id)
        stop = asyncio.Event()
        task = asyncio.create_task(Reconciler(p.rt).run(stop))
        try:
            await p.wait_for(job_id, lambda j: j.state is S.RETRY_WAIT, timeout=20)
        finally:
            stop.set()
            await asyncio.wait_for(task, 10)
        assert "reconciled_lease_expired" in await kinds(p.rt, job_id)
        assert p.rt.metrics.reconcile_runs._value.get() >= 1


# --- leadership -------------------------------------------------------------------------------


async def test_one_leader_at_a_time_on_postgres(pg_url: str, tmp_path: Path) -> None:
    first, second = build_runtime(pg_url, tmp_path), build_runtime(pg_url, tmp_path)
    try:
        async with Leadership(first) as a, Leadership(second) as b:
            assert await a.check() is True
            assert await b.check() is False
            assert await a.check() is True  # still leading, the lock is held
            await a.release()
            assert await eventually(b.check, what="the second reconciler to take over")
            assert await a.check() is False
            assert first.metrics.reconcile_leader._value.get() == 0
            assert second.metrics.reconcile_leader._value.get() == 1
    finally:
        await first.engine.dispose()
        await second.engine.dispose()


async def test_sqlite_reconciler_always_leads(sqlite_url: str, tmp_path: Path) -> None:
    rt = build_runtime(sqlite_url, tmp_path)
    try:
        async with Leadership(rt) as leadership:
            assert await leadership.check() and await leadership.check()
    finally:
        await rt.engine.dispose()


async def test_a_pass_whose_leadership_was_lost_midway_acts_on_nothing_it_read(
    pg_url: str, tmp_path: Path
) -> None:
    """Issue 38 (the river#1302 class): a failover takes the leader's lock session with the
    old primary while a pass has read its clock; the leader takes the lock again on the new
    primary. The pass must not go on to repair on what it read before: it is abandoned, and
    the next pass, on a fresh read, does the repair."""
    from jobrelay.maintenance.reconcile import PassAbandoned
    from jobrelay.observe.faults import Faults

    rt = build_runtime(pg_url, tmp_path, clock=Clock(), faults=Faults("reconcile.pass:stall:1"))
    try:
        job_id = await job_in_state(rt.store, S.RUNNING, T0)
        await mark_all_published(rt)
        clock(rt).advance(30 + GRACE + 1)
        async with Leadership(rt) as leadership:
            assert await leadership.check()
            session = await leadership._conn.fetchval("SELECT pg_backend_pid()")
            pass_ = asyncio.create_task(
                Reconciler(rt).run_once(scan_quarantine=False, leadership=leadership)
            )
            # While the pass is held after its read: the lock's session dies (a failover).
            async with rt.engine.connect() as conn:
                await conn.execute(text(f"SELECT pg_terminate_backend({session})"))
            with pytest.raises(PassAbandoned):
                await asyncio.wait_for(pass_, 20)
            assert leadership.term == 2  # taken again, on what is the primary now
            job = await rt.store.get_job(job_id)
            assert job is not None and job.state is S.RUNNING  # nothing repaired
            report = await Reconciler(rt).run_once(scan_quarantine=False, leadership=leadership)
            assert [f.job_id for f in report.findings if f.repaired] == [job_id]
    finally:
        await rt.engine.dispose()
