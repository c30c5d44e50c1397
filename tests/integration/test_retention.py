"""Retention: exactly the old finished jobs (with their events, effects rows, outbox rows and
result objects), superseded published outbox rows and dead-lettered local-queue rows go;
everything else stays. SQLite and PostgreSQL, on a test clock moved 31 days instead of waited.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import delete, func, insert, select, text, update

from jobrelay.domain.states import JobState
from jobrelay.errors import TransientError
from jobrelay.maintenance.prune import Pruner
from jobrelay.maintenance.reconcile import Reconciler
from jobrelay.runtime.wiring import Runtime
from jobrelay.storage.records import NewJob, PendingEvent
from jobrelay.storage.retention import PruneCounts, Retention
from jobrelay.storage.tables import (
    effects_ledger,
    job_dependencies,
    job_events,
    jobs,
    local_messages,
    outbox,
    pruned_jobs,
)
from jobrelay.transport.base import OutgoingMessage
from jobrelay.transport.local import LocalTransport
from tests.integration.api_fixtures import T0, Clock, build_runtime
from tests.integration.transport_fixtures import Pump

from .ops_fixtures import eventually, job_in_state

pytestmark = pytest.mark.timeout(90)
S = JobState
DAYS = 30


@pytest.fixture
async def runtime(database_url: str, tmp_path: Path) -> AsyncIterator[Runtime]:
    rt = build_runtime(database_url, tmp_path, clock=Clock())
    yield rt
    await rt.engine.dispose()


def clock(rt: Runtime) -> Clock:
    assert isinstance(rt.clock, Clock)
    return rt.clock


async def count(rt: Runtime, table: Any, *where: Any) -> int:
    async with rt.engine.connect() as conn:
        n = await conn.scalar(select(func.count()).select_from(table).where(*where))
    return int(n or 0)


async def with_result(rt: Runtime, job_id: str) -> str:
    """Write the result object a succeeded job of job_in_state names."""
    key = f"exports/acme/{job_id}.csv"
    async with rt.results.writer(key) as out:
        await out.write(b"a,b\n1,2\n")
    return key


async def with_ledger_row(rt: Runtime, job_id: str, now: datetime) -> None:
    async with rt.engine.begin() as conn:
        await conn.execute(
            insert(effects_ledger).values(
                job_id=job_id,
                kind="email",
                state="sent",
                message_id=f"<{job_id}@test>",
                created_at=now,
                updated_at=now,
            )
        )


async def publish_all(rt: Runtime, at: datetime) -> None:
    async with rt.engine.begin() as conn:
        await conn.execute(
            update(outbox).where(outbox.c.published_at.is_(None)).values(published_at=at)
        )


async def add_local_message(rt: Runtime, queue: str, created: datetime) -> None:
    async with rt.engine.begin() as conn:
        await conn.execute(
            insert(local_messages).values(
                queue=queue, body="{}", headers={}, available_at=created, created_at=created
            )
        )


async def prune(rt: Runtime, **kwargs: Any) -> PruneCounts:
    retention = Retention(rt.store, rt.results, **kwargs)
    return await retention.prune(await retention.cutoff(DAYS))


async def old_world(rt: Runtime) -> dict[str, str]:
    """One job of each state at T0; then 31 days later a succeeded and a cancelled one."""
    ids = {}
    for i, state in enumerate(
        (S.SUCCEEDED, S.CANCELLED, S.QUARANTINED, S.QUEUED, S.RUNNING, S.RETRY_WAIT)
    ):
        ids[f"old_{state.value}"] = await job_in_state(rt.store, state, T0, f"2020-0{i + 1}")
    await with_ledger_row(rt, ids["old_succeeded"], T0)
    await with_ledger_row(rt, ids["old_quarantined"], T0)
    await publish_all(rt, T0)
    await add_local_message(rt, "quarantine", T0)
    await add_local_message(rt, "work", T0)  # waiting (or in flight) for 31 days: kept
    now = clock(rt).advance(timedelta(days=DAYS + 1).total_seconds())
    ids["new_succeeded"] = await job_in_state(rt.store, S.SUCCEEDED, now, "2021-01")
    ids["new_cancelled"] = await job_in_state(rt.store, S.CANCELLED, now, "2021-02")
    await add_local_message(rt, "quarantine", now)
    return ids


async def test_prune_deletes_exactly_the_old_finished_jobs_and_their_rows(
    runtime: Runtime,
) -> None:
    ids = await old_world(runtime)
    old_key = await with_result(runtime, ids["old_succeeded"])
    new_key = await with_result(runtime, ids["new_succeeded"])
    gone = [ids["old_succeeded"], ids["old_cancelled"]]
    events_before = await count(runtime, job_events, job_events.c.job_id.in_(gone))
    outbox_before = await count(runtime, outbox, outbox.c.job_id.in_(gone))
    assert events_before >= 4 and outbox_before == 2

    counts = await prune(runtime)

    assert (counts.jobs, counts.job_events, counts.effects_ledger) == (2, events_before, 1)
    # + 1: the retry_wait job's first message, superseded by its (published) retry message.
    assert (counts.outbox, counts.local_messages, counts.results) == (outbox_before + 1, 1, 1)
    assert await count(runtime, outbox, outbox.c.job_id == ids["old_retry_wait"]) == 1
    assert not counts.capped
    for name, job_id in ids.items():
        job = await runtime.store.get_job(job_id)
        assert (job is None) == (job_id in gone), name
    for table in (job_events, effects_ledger, outbox):
        assert await count(runtime, table, table.c.job_id.in_(gone)) == 0
    # The kept jobs keep everything, including the quarantined job's ledger row.
    assert await count(runtime, effects_ledger) == 1
    assert (await runtime.store.get_job(ids["old_quarantined"])).published  # type: ignore[union-attr]
    assert await count(runtime, local_messages, local_messages.c.queue == "work") == 1
    assert await count(runtime, local_messages, local_messages.c.queue == "quarantine") == 1
    assert not await runtime.results.exists(old_key) and await runtime.results.exists(new_key)
    stones = {
        r.job_id
        for r in [await Retention(runtime.store, runtime.results).pruned(i) for i in gone]
        if r
    }
    assert stones == set(gone)

    again = await prune(runtime)
    assert again.total == 0  # idempotent: nothing else is old enough


async def test_superseded_published_outbox_rows_of_kept_jobs_go_but_the_newest_stays(
    runtime: Runtime,
) -> None:
    job_id = await job_in_state(runtime.store, S.QUARANTINED, T0)
    await publish_all(runtime, T0)
    # An operator replayed it long ago; its message was published, and it was quarantined again.
    later = T0 + timedelta(hours=1)
    from jobrelay.storage.admin import AdminQueries

    replay = await AdminQueries(runtime.store).replay(
        job_id, actor="t", reason="t", budget=1, now=later
    )
    assert replay.done
    await publish_all(runtime, later)
    assert await count(runtime, outbox, outbox.c.job_id == job_id) == 2
    now = clock(runtime).advance(timedelta(days=DAYS + 1).total_seconds())
    young = await job_in_state(runtime.store, S.QUEUED, now, "2021-01")  # bounds the scan
    await publish_all(runtime, now)

    counts = await prune(runtime)

    assert (counts.jobs, counts.outbox) == (0, 1)
    assert await count(runtime, outbox, outbox.c.job_id == young) == 1
    async with runtime.engine.connect() as conn:
        [kept] = (
            await conn.execute(select(outbox.c.created_at).where(outbox.c.job_id == job_id))
        ).all()
    assert kept.created_at == later  # the newest row: the job still reads as published
    job = await runtime.store.get_job(job_id)
    assert job is not None and job.published and job.state is S.QUEUED


async def test_small_batches_still_delete_every_victim_in_several_transactions(
    runtime: Runtime, monkeypatch: pytest.MonkeyPatch
) -> None:
    victims = [
        await job_in_state(runtime.store, S.SUCCEEDED, T0, f"2020-0{i + 1}") for i in range(5)
    ]
    clock(runtime).advance(timedelta(days=DAYS + 1).total_seconds())
    writes = 0
    original = runtime.store.writing

    def counting() -> Any:
        nonlocal writes
        writes += 1
        return original()

    monkeypatch.setattr(runtime.store, "writing", counting)

    counts = await prune(runtime, batch=2)

    assert counts.jobs == 5 and not counts.capped
    assert writes >= 3 + 3  # 2 + 2 + 1 jobs, then one (empty) batch per other table
    assert all([await runtime.store.get_job(j) is None for j in victims])


async def test_the_cap_bounds_one_call_and_the_next_call_goes_on(runtime: Runtime) -> None:
    for i in range(5):
        await job_in_state(runtime.store, S.CANCELLED, T0, f"2020-0{i + 1}")
    clock(runtime).advance(timedelta(days=DAYS + 1).total_seconds())

    first = await prune(runtime, batch=2, max_rows=3)
    assert first.jobs == 3 and first.capped
    second = await prune(runtime, batch=2, max_rows=3)
    assert second.jobs == 2 and not second.capped
    assert await count(runtime, jobs) == 0


async def test_dry_run_counts_the_same_and_changes_nothing(runtime: Runtime) -> None:
    ids = await old_world(runtime)
    await with_result(runtime, ids["old_succeeded"])
    retention = Retention(runtime.store, runtime.results)
    cutoff = await retention.cutoff(DAYS)
    before = {t.name: await count(runtime, t) for t in (jobs, job_events, outbox, local_messages)}

    dry = await retention.prune(cutoff, dry_run=True)

    after = {t.name: await count(runtime, t) for t in (jobs, job_events, outbox, local_messages)}
    assert after == before and await count(runtime, pruned_jobs) == 0
    real = await retention.prune(cutoff)
    assert dry.tables() == real.tables() and real.jobs == 2


async def test_results_are_kept_when_asked(runtime: Runtime) -> None:
    job_id = await job_in_state(runtime.store, S.SUCCEEDED, T0)
    key = await with_result(runtime, job_id)
    clock(runtime).advance(timedelta(days=DAYS + 1).total_seconds())

    counts = await prune(runtime, keep_results=True)

    assert (counts.jobs, counts.results) == (1, 0)
    assert await runtime.store.get_job(job_id) is None and await runtime.results.exists(key)


class FailingDeletes:
    """The file store, but every delete fails as an unreachable S3 would."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def delete(self, key: str) -> None:
        raise TransientError("S3 DeleteObject failed: unreachable")


async def test_a_result_that_cannot_be_deleted_keeps_its_job_for_the_next_round(
    runtime: Runtime,
) -> None:
    job_ids = [await job_in_state(runtime.store, S.SUCCEEDED, T0, f"2020-0{i}") for i in (1, 2)]
    keys = [await with_result(runtime, job_id) for job_id in job_ids]
    clock(runtime).advance(timedelta(days=DAYS + 1).total_seconds())
    retention = Retention(runtime.store, FailingDeletes(runtime.results))

    counts = await retention.prune(await retention.cutoff(DAYS))

    # The first failure stops the batch: a store that is down is not asked 500 times.
    assert (counts.jobs, counts.results, counts.results_failed) == (0, 0, 1)
    for job_id, key in zip(job_ids, keys, strict=True):
        assert await runtime.store.get_job(job_id) is not None
        assert await runtime.results.exists(key)
    assert (await prune(runtime)).jobs == 2  # the store is back: the next round prunes them


async def test_a_locked_job_is_skipped_not_waited_for_and_goes_next_time(
    pg_url: str, tmp_path: Path
) -> None:
    rt = build_runtime(pg_url, tmp_path, clock=Clock())
    try:
        job_ids = [
            await job_in_state(rt.store, S.SUCCEEDED, T0, f"2020-0{i + 1}") for i in range(3)
        ]
        clock(rt).advance(timedelta(days=DAYS + 1).total_seconds())
        async with rt.engine.connect() as holder, holder.begin():
            # As many locked as one batch holds: picked again and again, were they not skipped.
            locked = select(jobs.c.id).where(jobs.c.id.in_(job_ids[:2])).with_for_update()
            await holder.execute(locked)
            counts = await asyncio.wait_for(prune(rt, batch=2), 10)  # never waits on the lock
            assert counts.jobs <= 1
            assert all([await rt.store.get_job(j) is not None for j in job_ids[:2]])
        left = 3 - counts.jobs
        for _ in range(2):
            left -= (await prune(rt, batch=2)).jobs
        assert left == 0 and await count(rt, jobs) == 0
    finally:
        await rt.engine.dispose()


async def _a_backend_waits_on_a_lock(rt: Runtime) -> bool:
    async with rt.engine.connect() as conn:
        waiting = await conn.scalar(
            text(
                "SELECT count(*) FROM pg_stat_activity"
                " WHERE wait_event_type = 'Lock' AND datname = current_database()"
            )
        )
    return bool(waiting)


async def test_a_mark_that_holds_the_outbox_row_of_a_job_being_pruned_leaves_no_event(
    pg_url: str, tmp_path: Path
) -> None:
    """``job_events`` has no foreign key: a relay's ``published`` event, written in the commit
    of the mark that holds the job's outbox row, must not outlive the job. Retention deletes
    the outbox rows first (waiting for the mark), then the events (seeing its event)."""
    rt = build_runtime(pg_url, tmp_path, clock=Clock())
    try:
        job_id = await job_in_state(rt.store, S.SUCCEEDED, T0)
        clock(rt).advance(timedelta(days=DAYS + 1).total_seconds())
        async with rt.engine.connect() as relay, relay.begin():
            # MARK_PUBLISHED's two writes, held open where its one statement commits at once.
            await relay.execute(
                update(outbox).where(outbox.c.job_id == job_id).values(published_at=T0)
            )
            await relay.execute(
                insert(job_events).values(job_id=job_id, at=T0, kind="published", detail={})
            )
            pruning = asyncio.create_task(prune(rt))
            await eventually(
                lambda: _a_backend_waits_on_a_lock(rt), what="the prune waiting for the mark"
            )
        counts = await asyncio.wait_for(pruning, 10)
        assert counts.jobs == 1
        assert await count(rt, job_events, job_events.c.job_id == job_id) == 0
    finally:
        await rt.engine.dispose()


async def test_a_state_less_event_of_a_job_being_pruned_waits_and_is_dropped(
    pg_url: str, tmp_path: Path
) -> None:
    """A worker's ``ack_sent`` for a job that retention has locked to delete: the event's
    write key-share locks its job as it finds it, so it waits for the prune and then finds
    no job. It neither fails nor leaves a row behind (``job_events`` has no foreign key)."""
    rt = build_runtime(pg_url, tmp_path, clock=Clock())
    try:
        job_id = await job_in_state(rt.store, S.SUCCEEDED, T0)
        async with rt.engine.connect() as retention, retention.begin():
            # What ``Retention._delete_jobs`` does, in one transaction held open.
            await retention.execute(select(jobs.c.id).where(jobs.c.id == job_id).with_for_update())
            acked = asyncio.create_task(
                rt.store.record_events([PendingEvent(job_id, "ack_sent", T0, {})])
            )
            await eventually(
                lambda: _a_backend_waits_on_a_lock(rt), what="the event waiting for the prune"
            )
            for table in (outbox, job_events):
                await retention.execute(delete(table).where(table.c.job_id == job_id))
            await retention.execute(delete(jobs).where(jobs.c.id == job_id))
        await asyncio.wait_for(acked, 10)
        assert await count(rt, job_events, job_events.c.job_id == job_id) == 0
    finally:
        await rt.engine.dispose()


async def test_expired_tombstones_go_after_another_retention_period(runtime: Runtime) -> None:
    job_id = await job_in_state(runtime.store, S.CANCELLED, T0)
    clock(runtime).advance(timedelta(days=DAYS + 1).total_seconds())
    assert (await prune(runtime)).jobs == 1
    retention = Retention(runtime.store, runtime.results)
    assert await retention.pruned(job_id) is not None

    clock(runtime).advance(timedelta(days=DAYS + 1).total_seconds())
    assert (await prune(runtime)).pruned_jobs == 1
    assert await retention.pruned(job_id) is None


async def test_the_reconciler_leader_prunes_and_counts_it(runtime: Runtime) -> None:
    old = await job_in_state(runtime.store, S.SUCCEEDED, T0)
    clock(runtime).advance(timedelta(days=DAYS + 1).total_seconds())
    kept = await job_in_state(runtime.store, S.SUCCEEDED, runtime.clock(), "2021-01")
    stop = asyncio.Event()
    task = asyncio.create_task(Reconciler(runtime).run(stop))
    try:

        async def pruned() -> bool:
            return await runtime.store.get_job(old) is None

        await eventually(pruned, what="the leader to prune the old job")
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
    assert await runtime.store.get_job(kept) is not None
    assert runtime.metrics.pruned.labels(table="jobs")._value.get() == 1


async def test_a_prune_is_due_once_a_minute_or_at_once_after_a_capped_one(
    runtime: Runtime,
) -> None:
    for i in range(3):
        await job_in_state(runtime.store, S.CANCELLED, T0, f"2020-0{i + 1}")
    clock(runtime).advance(timedelta(days=DAYS + 1).total_seconds())
    pruner = Pruner(runtime, batch=1, max_rows=2)

    first = await pruner.run_if_due()
    assert first is not None and first.jobs == 2 and first.capped
    second = await pruner.run_if_due()  # capped: due again at once
    assert second is not None and second.jobs == 1 and not second.capped
    assert await pruner.run_if_due() is None  # done: not due for a minute


async def _last_vacuum(rt: Runtime, table: str) -> datetime | None:
    from sqlalchemy import text

    async with rt.engine.connect() as conn:
        await conn.execute(text("SELECT pg_stat_clear_snapshot()"))
        row = await conn.execute(
            text("SELECT last_vacuum FROM pg_stat_user_tables WHERE relname = :t"), {"t": table}
        )
        value = row.scalar_one_or_none()
    return value if isinstance(value, datetime) else None


async def test_without_autovacuum_the_leader_vacuums_jobrelays_tables(
    runtime: Runtime, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server's autovacuum off (as on this project's machine): after its prune, the
    pruner vacuums the hot tables itself; with autovacuum on, or JOBRELAY_SELF_VACUUM off,
    it leaves them to the server."""
    if runtime.store.engine.dialect.name != "postgresql":
        pytest.skip("VACUUM is PostgreSQL's; SQLite has nothing to reclaim this way")
    import jobrelay.maintenance.prune as prune_role

    monkeypatch.setattr(prune_role, "autovacuum_on", _constant(True))
    assert await Pruner(runtime).vacuum_if_needed() is False
    monkeypatch.setattr(prune_role, "autovacuum_on", _constant(False))
    off = build_runtime_like(runtime, self_vacuum=False)
    assert await Pruner(off).vacuum_if_needed() is False
    assert await _last_vacuum(runtime, "outbox") is None

    assert await Pruner(runtime).run_if_due() is not None
    for table in ("outbox", "jobs", "job_events", "local_messages", "effects_ledger"):
        await eventually(lambda t=table: _last_vacuum(runtime, t), what=f"{table} vacuumed")


def _constant(value: bool) -> Any:
    async def answer(engine: Any) -> bool:
        return value

    return answer


def build_runtime_like(rt: Runtime, **settings: Any) -> Runtime:
    """The same runtime with other settings (the pruner reads only settings and engine)."""
    import dataclasses

    return dataclasses.replace(rt, settings=rt.settings.model_copy(update=settings))


async def test_a_dead_letter_is_kept_for_the_retention_period_after_it_was_dead_lettered(
    runtime: Runtime,
) -> None:
    """Published a day ago, dead-lettered a minute ago: a prune with a retention of an hour
    keeps it, and an hour later it goes. Both ways a local message reaches the quarantine
    queue: a reject, and the delivery limit (issue 21, item 10)."""
    transport = LocalTransport(
        runtime.engine, runtime.topology, poll_seconds=0.01, clock=clock(runtime)
    )
    await transport.connect()
    retention = Retention(runtime.store, runtime.results)
    hour = 1 / 24
    try:
        await transport.publish(OutgoingMessage("work", b'{"n": 1}', {}))  # rejected, below
        await transport.publish(OutgoingMessage("work", b'{"n": 2}', {}))  # past the limit
        async with runtime.engine.begin() as conn:  # handed out to consumers that all died
            await conn.execute(
                update(local_messages)
                .where(local_messages.c.body == '{"n": 2}')
                .values(delivery_count=runtime.topology.delivery_limit + 1)
            )
        clock(runtime).advance(timedelta(days=1).total_seconds())
        pump = Pump(transport, prefetch=2)
        delivery = await pump.get()
        assert delivery.body == b'{"n": 1}'
        assert await delivery.reject()
        await pump.stop()
        quarantine = local_messages.c.queue == "quarantine"
        assert await count(runtime, local_messages, quarantine) == 2

        clock(runtime).advance(60)
        assert (await retention.prune(await retention.cutoff(hour))).local_messages == 0
        assert (await retention.count(await retention.cutoff(hour))).local_messages == 0
        assert await count(runtime, local_messages, quarantine) == 2

        clock(runtime).advance(3600)
        assert (await retention.count(await retention.cutoff(hour))).local_messages == 2
        assert (await retention.prune(await retention.cutoff(hour))).local_messages == 2
        assert await count(runtime, local_messages) == 0
    finally:
        await transport.close()


async def test_a_job_that_a_waiting_job_still_needs_is_kept(runtime: Runtime) -> None:
    """Issue 37: a dependency past retention stays while a job written ``after=`` it has not
    ended (it reads its dependencies when it runs); it goes once that job has ended."""
    done = await job_in_state(runtime.store, S.SUCCEEDED, T0, "2020-01")
    other = await job_in_state(runtime.store, S.RUNNING, T0, "2020-02")
    waiting = NewJob(
        job_id="fan-in",
        type="report.export",
        account_id=None,
        params={},
        request_hash="h",
        max_attempts=3,
        after=(done, other),
    )
    await runtime.store.submit(waiting, T0)
    clock(runtime).advance(timedelta(days=DAYS + 1).total_seconds())
    await prune(runtime)
    assert await runtime.store.get_job(done) is not None  # still needed
    async with runtime.store.writing() as conn:
        await conn.execute(
            update(jobs)
            .where(jobs.c.id == "fan-in")
            .values(state=S.CANCELLED.value, updated_at=T0, finished_at=T0)
        )
    await prune(runtime)
    assert await runtime.store.get_job(done) is None
    assert await runtime.store.get_job("fan-in") is None
    assert await count(runtime, job_dependencies) == 0
