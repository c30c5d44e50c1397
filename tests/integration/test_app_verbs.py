"""The operator's verbs in Python (issue 40, item 2), on both backends: ``App.cancel``,
``replay``, ``resend``, ``list_jobs``, ``pause_queue``/``resume_queue`` write what the CLI's
verbs write (the same event, actor, metric and log line), and their sync twins work from code
with no event loop and refuse to run inside one."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest
from sqlalchemy import func, select

import jobrelay
from jobrelay.domain.states import JobState
from jobrelay.errors import ConfigError
from jobrelay.library.operator import Operator, UnknownQueue
from jobrelay.storage.queue_pauses import paused_queues
from jobrelay.storage.tables import outbox

pytestmark = pytest.mark.timeout(120)


def _app(p: Any) -> jobrelay.App:
    return jobrelay.App(p.rt.settings)


async def _detail(p: Any, job_id: str, kind: str) -> dict[str, Any]:
    [event] = [e for e in await p.store.events(job_id) if e.kind == kind]
    return dict(event.detail)


async def test_cancel_writes_what_the_clis_cancel_writes(
    make_pipeline: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="jobrelay.operator")
    async with make_pipeline() as p:
        by_app, by_cli = await p.submit(period="2020-01"), await p.submit(period="2020-02")
        app = _app(p)
        try:
            outcome = await app.cancel(by_app, reason="customer asked", actor="shop:alice")
            again = await app.cancel(by_app, reason="twice")
            missing = await app.cancel("00000000-0000-0000-0000-000000000000", reason="x")
        finally:
            await app.aclose()
        await Operator(p.rt).cancel(by_cli, actor="cli:bob@host", reason="customer asked")
        ours, theirs = await _detail(p, by_app, "cancelled"), await _detail(p, by_cli, "cancelled")
        job = await p.store.get_job(by_app)
    assert outcome.done and outcome.state is JobState.CANCELLED
    assert outcome.previous_state is JobState.QUEUED
    assert not again.done and again.state is JobState.CANCELLED
    assert not missing.done and missing.state is None
    assert job is not None and job.state is JobState.CANCELLED
    assert ours["actor"] == "shop:alice"
    assert {**ours, "actor": "-"} == {**theirs, "actor": "-"}
    lines = [r for r in caplog.records if getattr(r, "event", None) == "cancelled"]
    assert {getattr(r, "actor", None) for r in lines} == {"shop:alice", "cli:bob@host"}


async def test_replay_and_resend_and_the_default_actor(make_pipeline: Any) -> None:
    async with make_pipeline(faults="export.run:invalid@period=2020-04") as p:
        bad = await p.submit(period="2020-04")
        p.start_relay()
        await p.start_worker()
        await p.wait_for(bad, lambda j: j.state is JobState.QUARANTINED)
        await p.stop_all()
        queued = await p.submit(period="2020-05")
        app = _app(p)
        try:
            replayed = await app.replay(bad)
            resent = await app.resend(queued, reason="message lost")
            refused = await app.resend(bad)  # queued now, but by a replay: resend it too
        finally:
            await app.aclose()
        detail = await _detail(p, bad, "replayed")
        async with p.rt.engine.connect() as conn:
            messages = await conn.scalar(
                select(func.count()).select_from(outbox).where(outbox.c.job_id == queued)
            )
    assert replayed.done and replayed.state is JobState.QUEUED
    assert detail["actor"].startswith("app:")
    assert resent.done and messages == 2
    assert refused.done  # a replayed job is queued: resend is allowed from there


async def test_list_jobs_filters_and_pages_newest_first(make_pipeline: Any) -> None:
    async with make_pipeline() as p:
        ids = [await p.submit(period=f"2020-0{n}") for n in range(1, 6)]
        app = _app(p)
        try:
            await app.cancel(ids[0], reason="not needed")
            queued = [j.id async for j in app.list_jobs(state="queued")]
            two = [j.id async for j in app.list_jobs(type="report.export", limit=2)]
            cancelled = [j.id async for j in app.list_jobs(state=JobState.CANCELLED)]
            with pytest.raises(ConfigError, match="no state 'stuck'"):
                [j async for j in app.list_jobs(state="stuck")]
        finally:
            await app.aclose()
    assert set(queued) == set(ids[1:]) and cancelled == [ids[0]]
    assert len(two) == 2 and set(two) <= set(ids)


async def test_pause_and_resume_a_queue(make_pipeline: Any) -> None:
    async with make_pipeline() as p:
        app = _app(p)
        try:
            assert await app.pause_queue("default", reason="ledger migration")
            assert not await app.pause_queue("default", reason="again")
            paused = await paused_queues(p.store)
            with pytest.raises(UnknownQueue, match="no queue 'nope'"):
                await app.pause_queue("nope", reason="x")
            with pytest.raises(ConfigError, match="reason is empty"):
                await app.resume_queue("default", reason=" ")
            assert await app.resume_queue("default", reason="done")
            after = await paused_queues(p.store)
        finally:
            await app.aclose()
    assert paused == {"default"} and after == set()


async def test_the_sync_twins_work_without_a_loop_and_refuse_inside_one(
    make_pipeline: Any,
) -> None:
    async with make_pipeline() as p:
        job_id = await p.submit(period="2020-06")
        other = await p.submit(period="2020-07")
        app = _app(p)

        def from_a_view() -> tuple[Any, ...]:  # a thread with no event loop, as Django's
            seen = app.get_job_sync(job_id)
            listed = app.list_jobs_sync(state="queued")
            cancelled = app.cancel_sync(other, reason="by a view")
            paused = app.pause_queue_sync("default", reason="view")
            resumed = app.resume_queue_sync("default", reason="view")
            return seen, listed, cancelled, paused, resumed

        seen, listed, cancelled, paused, resumed = await asyncio.to_thread(from_a_view)
        with pytest.raises(ConfigError, match="await the async twin"):
            app.get_job_sync(job_id)
        job = await p.store.get_job(other)
    assert seen is not None and seen.id == job_id
    assert {j.id for j in listed} == {job_id, other}
    assert cancelled.done and job is not None and job.state is JobState.CANCELLED
    assert paused and resumed
