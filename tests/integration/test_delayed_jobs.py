"""Delayed jobs through the real relay and worker, on SQLite + the local transport and on
PostgreSQL + RabbitMQ: a job enqueued with ``delay=`` is not published, so not claimed,
before its run time; it runs after it; cancelled before it, nothing is ever published for
it; and it survives a restart of the processes in between (real processes at the end).

Delays are one or two real seconds, waited on by polling; the only assertions on time are
"not before its run time".
"""

from __future__ import annotations

import json
import sys
import textwrap
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine, func, select, text

from jobrelay.domain.states import JobState
from jobrelay.exports.shipped import report_export
from jobrelay.runtime.wiring import Runtime
from jobrelay.storage.admin import AdminQueries
from jobrelay.storage.tables import outbox
from tests.acceptance.procs import (
    FAST_ENV,
    clean_env,
    free_port,
    poll,
    processes,
    run_cli,
    wait_http,
)

from .ops_fixtures import eventually

PARAMS = {"accountId": "acme", "period": "2020-05"}


async def enqueue(rt: Runtime, **when: Any) -> str:
    """``report.export`` through the library's ``enqueue``, in a transaction of the test's."""
    async with rt.engine.begin() as conn:
        job_id = await report_export.enqueue(conn, PARAMS, account="acme", **when)
    rt.store.wake_relays()
    return job_id


def first(events: list[Any], kind: str) -> datetime | None:
    return next((e.at for e in events if e.kind == kind), None)


async def held_rows(rt: Runtime, job_id: str) -> int:
    async with rt.store.reading() as conn:
        n = await conn.scalar(
            select(func.count()).select_from(outbox).where(outbox.c.job_id == job_id)
        )
    return int(n or 0)


async def test_a_delayed_job_is_not_published_or_claimed_before_its_time_and_runs_after(
    make_pipeline: Callable[..., Any],
) -> None:
    async with make_pipeline() as p:
        p.start_relay()
        await p.start_worker()
        job_id = await enqueue(p.rt, delay=1.5)
        job = await p.store.get_job(job_id)
        assert job is not None and job.run_at is not None
        run_at = job.run_at
        # While it waits: queued, unpublished, its outbox row still there, nothing claimed.
        assert job.state is JobState.QUEUED and not job.published
        assert job.waiting_for_run_at(await p.store.db_now())
        assert await p.kinds(job_id) == ["accepted"]

        done = await p.wait_for(job_id, lambda j: j.state is JobState.SUCCEEDED, timeout=30)
        events = await p.store.events(job_id)
    published, claimed = first(events, "published"), first(events, "claimed")
    assert published is not None and claimed is not None
    assert published >= run_at and claimed >= run_at  # never before its time
    assert done.run_at == run_at  # kept as history
    accepted = next(e for e in events if e.kind == "accepted")
    assert accepted.detail["runAt"] == run_at.isoformat()


async def test_the_relay_wakes_for_a_due_row_without_waiting_for_its_poll(
    make_pipeline: Callable[..., Any],
) -> None:
    """A relay polling every 60 s still publishes a job due in 1 s well before its next poll:
    it sleeps until the next held row is due when that comes first."""
    async with make_pipeline(relay_poll_seconds="60") as p:
        await p.start_worker()
        job_id = await enqueue(p.rt, delay=1)
        p.start_relay()  # its first round finds nothing due, so it would sleep 60 s
        job = await p.wait_for(job_id, lambda j: j.state is JobState.SUCCEEDED, timeout=20)
    assert job.run_at is not None


async def test_a_delayed_job_cancelled_before_its_time_is_never_published(
    make_pipeline: Callable[..., Any],
) -> None:
    async with make_pipeline() as p:
        p.start_relay()
        await p.start_worker()
        cancelled = await enqueue(p.rt, delay=1)
        later = await enqueue(p.rt, delay=2)  # due after it: its run shows the relay got past
        outcome = await AdminQueries(p.store).cancel(
            cancelled, actor="test", reason="not needed", now=p.rt.clock()
        )
        assert outcome.done
        await p.wait_for(later, lambda j: j.state is JobState.SUCCEEDED, timeout=30)

        async def acked() -> bool:
            return "ack_sent" in await p.kinds(later)

        await eventually(acked, what="the later job's ack")
        job = await p.store.get_job(cancelled)
        kinds = await p.kinds(cancelled)
        rows = await held_rows(p.rt, cancelled)
        events = await p.store.events(cancelled)
    assert job is not None and job.state is JobState.CANCELLED
    assert "published" not in kinds and "claimed" not in kinds
    assert rows == 0  # the held message was deleted with the cancel
    assert next(e for e in events if e.kind == "cancelled").detail["heldMessagesDropped"] == 1


async def test_reconcile_and_gauges_do_not_count_a_held_row_as_stuck(
    make_pipeline: Callable[..., Any],
) -> None:
    async with make_pipeline() as p:
        job_id = await enqueue(p.rt, delay=timedelta(hours=1))
        admin = AdminQueries(p.store)
        assert await admin.outbox_stats() == (0, None)
        assert await p.store.outbox_backlog() == 0
        from jobrelay.storage.repairs import RepairQueries

        later = datetime.now(UTC) + timedelta(minutes=30)
        assert await RepairQueries(p.store).stale_outbox(later, 10) == []
        # Once it is due (an hour later) and still unpublished, it is stuck, counted from then.
        job = await p.store.get_job(job_id)
        assert job is not None and job.run_at is not None
        stale = await RepairQueries(p.store).stale_outbox(job.run_at + timedelta(minutes=5), 10)
        assert [r.job_id for r in stale] == [job_id] and stale[0].created_at == job.run_at


async def test_a_resend_before_its_time_is_held_until_then_too(
    make_pipeline: Callable[..., Any],
) -> None:
    from jobrelay.storage.repairs import RepairQueries

    async with make_pipeline() as p:
        job_id = await enqueue(p.rt, delay=timedelta(hours=1))
        outcome = await RepairQueries(p.store).resend_queued(
            job_id, actor="test", reason="lost?", now=datetime.now(UTC)
        )
        assert outcome.done
        job = await p.store.get_job(job_id)
        async with p.store.reading() as conn:
            held = (await conn.execute(select(outbox.c.available_at))).scalars().all()
        assert job is not None and held == [job.run_at, job.run_at]
        # And the cancel drops both.
        assert (
            await AdminQueries(p.store).cancel(job_id, actor="t", reason="t", now=p.rt.clock())
        ).done
        assert await held_rows(p.rt, job_id) == 0


# --- a restart in between: real processes -----------------------------------------------

APP = """
import jobrelay
from pydantic import BaseModel

app = jobrelay.App()


class Ping(BaseModel):
    n: int


@app.job("later.ping", params=Ping)
async def ping(ctx: jobrelay.JobContext[Ping], params: Ping) -> None:
    ctx.log.info("ping %s", params.n)
"""


def write_app(root: Path) -> Path:
    pkg = root / "laterapp"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "jobs.py").write_text(textwrap.dedent(APP))
    return root


def sync_url(url: str) -> str:
    return url.replace("postgresql://", "postgresql+psycopg://")


def job_row(url: str, job_id: str) -> tuple[str, datetime, list[tuple[str, datetime]]]:
    engine = create_engine(sync_url(url))
    try:
        with engine.connect() as conn:
            state, run_at = conn.execute(
                text("SELECT state, run_at FROM jobs WHERE id = :i"), {"i": job_id}
            ).one()
            events = conn.execute(
                text("SELECT kind, at FROM job_events WHERE job_id = :i ORDER BY id"),
                {"i": job_id},
            ).all()
    finally:
        engine.dispose()
    return state, _aware(run_at), [(k, _aware(a)) for k, a in events]


def _aware(value: Any) -> datetime:
    when = datetime.fromisoformat(value) if isinstance(value, str) else value
    assert isinstance(when, datetime)
    return when if when.tzinfo else when.replace(tzinfo=UTC)


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    "database", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]
)
def test_a_delayed_job_survives_a_restart_and_runs_after_its_time(
    tmp_path: Path,
    request: pytest.FixtureRequest,
    monkeypatch: pytest.MonkeyPatch,
    database: str,
) -> None:
    root = write_app(tmp_path / "outside")
    settings = {
        "JOBRELAY_RESULTS_URL": f"file://{tmp_path / 'results'}",
        "JOBRELAY_APP": "laterapp.jobs:app",
        **FAST_ENV,
    }
    if database == "sqlite":
        url = f"sqlite:///{tmp_path / 'jobrelay.db'}"
        env = clean_env(JOBRELAY_DATABASE_URL=url, **settings)
    else:
        url = str(request.getfixturevalue("pg_url"))
        broker = str(request.getfixturevalue("amqp_url"))
        env = clean_env(JOBRELAY_DATABASE_URL=url, JOBRELAY_BROKER_URL=broker, **settings)
    assert run_cli("db", "upgrade", env=env, cwd=root).returncode == 0
    if database == "postgres":
        declared = run_cli("broker", "declare", env=env, cwd=root)
        assert declared.returncode == 0, declared.stderr
    monkeypatch.syspath_prepend(str(root))
    from laterapp.jobs import ping  # type: ignore[import-not-found]

    with processes(tmp_path) as start:
        if database == "sqlite":
            port = free_port()
            args: tuple[str, ...] = ("up", "--port", str(port))
            first_run = start("up", *args, env=env, cwd=root)
            wait_http(f"http://127.0.0.1:{port}", first_run)
        else:
            args = ("relay",)
            start("worker", "worker", env=env, cwd=root)
            first_run = start("relay", *args, env=env, cwd=root)
        engine = create_engine(sync_url(url))
        try:
            with engine.begin() as conn:
                job_id = ping.enqueue_sync(conn, {"n": 1}, delay=3)
        finally:
            engine.dispose()
        first_run.kill9()  # before its time: the message is only in the outbox
        state, run_at, events = job_row(url, job_id)
        assert datetime.now(UTC) < run_at, "the machine was too slow to kill before the run time"
        assert state == "queued" and [k for k, _ in events] == ["accepted"]

        second_run = start("again", *args, env=env, cwd=root)
        poll(lambda: job_row(url, job_id)[0] == "succeeded", 60, "the job to run after a restart")
        assert second_run.popen.poll() is None, second_run.log()[-2000:]
    state, run_at, events = job_row(url, job_id)
    at = dict(events)
    assert at["published"] >= run_at and at["claimed"] >= run_at
    assert json.dumps([k for k, _ in events]).count("published") == 1
    sys.modules.pop("laterapp.jobs", None)
    sys.modules.pop("laterapp", None)
