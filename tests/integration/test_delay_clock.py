"""A delay is added to the database's clock, not the enqueuing host's (issue 34, item 9).

The relay judges a held row by the database's clock; the due time was the enqueuing host's
clock plus the delay, so 120 s of skew made ``delay=5`` wait 125 s (host ahead) or
``delay=60`` run at once (host behind). Here the host's notion of now, as the enqueue paths
read it, is moved 120 s ahead or behind, and the stored due time must still be the
database's own now plus the delay: bounded by the database's clock read just before and just
after the enqueue, in the same test (no timing assumption). Every path that stores a delay:
the library's ``enqueue``, ``enqueue_sync`` on a SQLAlchemy connection and on a DB-API one,
and ``POST /v1/jobs`` with ``delaySeconds``; on SQLite and PostgreSQL. An absolute time
(``run_at`` / ``runAt``) stays as given. And an operator's resend of a delayed job asks the
database, not the host, whether the job is due yet.
"""

from __future__ import annotations

import dataclasses
import sqlite3
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest
from sqlalchemy import create_engine, make_url, select, text
from sqlalchemy.ext.asyncio import AsyncEngine

import jobrelay
import jobrelay.api.jobs
import jobrelay.library.job_definition
from jobrelay.library.operator import Operator
from jobrelay.runtime.wiring import Runtime
from jobrelay.storage.engine import read_only
from jobrelay.storage.store import Store
from jobrelay.storage.tables import job_events, jobs, outbox

from .api_fixtures import (
    Clock,
    Ping,
    api_client,
    bearer,
    build_runtime,
    make_token,
    ping_app,
    runtime_with_app,
)

app, ping = ping_app("skew.ping")

# 1 ms: SQLite's clock has millisecond resolution; PostgreSQL's is exact.
RESOLUTION = timedelta(milliseconds=1)


@pytest.fixture
async def rt(database_url: str, tmp_path: Path) -> AsyncIterator[Runtime]:
    async with runtime_with_app(app, database_url, tmp_path) as runtime:
        yield runtime


# Host ahead: delay=5 used to wait 125 s. Host behind: delay=60 used to run at once.
@pytest.fixture(params=[(120.0, 5.0), (-120.0, 60.0)], ids=["host-ahead", "host-behind"])
def skewed(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> float:
    """The enqueuing host's clock ``skew`` seconds off; returns the delay to ask for."""
    skew, delay = request.param

    class HostClock(datetime):
        @classmethod
        def now(cls, tz: Any = None) -> Any:
            return datetime.now(tz) + timedelta(seconds=skew)

    for module in (jobrelay.library.job_definition, jobrelay.api.jobs):
        monkeypatch.setattr(module, "datetime", HostClock)
    return float(delay)


async def database_now(engine: AsyncEngine) -> datetime:
    """The database's own clock: PostgreSQL's ``now()``, SQLite's ``'now'``."""
    async with engine.connect() as conn:
        if engine.dialect.name == "postgresql":
            value = await conn.scalar(text("SELECT now()"))
            assert isinstance(value, datetime)
            return value
        raw = await conn.scalar(text("SELECT strftime('%Y-%m-%d %H:%M:%f', 'now')"))
    return datetime.fromisoformat(str(raw)).replace(tzinfo=UTC)


async def stored(engine: AsyncEngine, job_id: str) -> tuple[Any, Any, Any]:
    """The job's ``run_at``, its outbox row's ``available_at``, its ``accepted`` runAt."""
    async with read_only(engine) as conn:
        run_at = await conn.scalar(select(jobs.c.run_at).where(jobs.c.id == job_id))
        available = await conn.scalar(
            select(outbox.c.available_at).where(outbox.c.job_id == job_id)
        )
        detail = await conn.scalar(
            select(job_events.c.detail).where(
                job_events.c.job_id == job_id, job_events.c.kind == "accepted"
            )
        )
    return run_at, available, detail.get("runAt")


async def assert_due_by_the_database(
    rt: Runtime, delay: float, enqueue: Callable[[], Awaitable[str]]
) -> None:
    before = await database_now(rt.engine)
    job_id = await enqueue()
    after = await database_now(rt.engine)
    run_at, available, said = await stored(rt.engine, job_id)
    wait = timedelta(seconds=delay)
    assert run_at is not None, "stored as due now: the host's clock judged the delay"
    assert before + wait - RESOLUTION <= run_at <= after + wait + RESOLUTION, (
        f"due {run_at}, the database's now was {before}..{after} (+{delay} s)"
    )
    assert available == run_at
    assert said is not None and datetime.fromisoformat(said) == run_at


async def test_library_enqueue(rt: Runtime, skewed: float) -> None:
    async def enqueue() -> str:
        async with rt.engine.begin() as conn:
            return await ping.enqueue(conn, Ping(n=1), delay=skewed)

    await assert_due_by_the_database(rt, skewed, enqueue)


async def test_app_enqueue_with_a_timedelta(rt: Runtime, skewed: float) -> None:
    own = jobrelay.App(settings=rt.settings)
    own.job("skew.ping", params=Ping)(ping.fn)

    async def enqueue() -> str:
        return await own.enqueue("skew.ping", {"n": 2}, delay=timedelta(seconds=skewed))

    try:
        await assert_due_by_the_database(rt, skewed, enqueue)
    finally:
        await own.aclose()


def _sync_url(database_url: str) -> Any:
    url = make_url(database_url)
    if url.get_backend_name() == "postgresql":
        return url.set(drivername="postgresql+psycopg")
    return url.set(drivername="sqlite")


async def test_enqueue_sync_on_a_sqlalchemy_connection(
    rt: Runtime, skewed: float, database_url: str
) -> None:
    async def enqueue() -> str:
        engine = create_engine(_sync_url(database_url))
        try:
            with engine.begin() as conn:
                return ping.enqueue_sync(conn, {"n": 3}, delay=skewed)
        finally:
            engine.dispose()

    await assert_due_by_the_database(rt, skewed, enqueue)


async def test_enqueue_sync_on_a_dbapi_connection(
    rt: Runtime, skewed: float, database_url: str
) -> None:
    async def enqueue() -> str:
        url = make_url(database_url)
        raw: Any
        if url.get_backend_name() == "sqlite":
            raw = sqlite3.connect(url.database or "")
        else:
            raw = psycopg.connect(url.set(drivername="postgresql").render_as_string(False))
        try:
            job_id = ping.enqueue_sync(raw, {"n": 4}, delay=skewed)
            raw.commit()
            return job_id
        finally:
            raw.close()

    await assert_due_by_the_database(rt, skewed, enqueue)


async def test_post_v1_jobs_delay_seconds(rt: Runtime, skewed: float) -> None:
    acme = bearer(await make_token(rt, "acme"))
    async with api_client(rt) as client:

        async def enqueue() -> str:
            body = {"type": "skew.ping", "params": {"n": 5}, "delaySeconds": skewed}
            accepted = await client.post("/v1/jobs", json=body, headers=acme)
            assert accepted.status_code == 202, accepted.text
            return str(accepted.json()["jobId"])

        await assert_due_by_the_database(rt, skewed, enqueue)


async def test_an_absolute_run_time_stays_as_given(rt: Runtime, skewed: float) -> None:
    at = datetime.now(UTC).replace(microsecond=0) + timedelta(hours=1)
    async with rt.engine.begin() as conn:
        by_library = await ping.enqueue(conn, Ping(n=6), run_at=at)
    acme = bearer(await make_token(rt, "acme"))
    async with api_client(rt) as client:
        body = {"type": "skew.ping", "params": {"n": 7}, "runAt": at.isoformat()}
        accepted = await client.post("/v1/jobs", json=body, headers=acme)
        assert accepted.status_code == 202, accepted.text
    for job_id in (by_library, accepted.json()["jobId"]):
        assert await stored(rt.engine, job_id) == (at, at, at.isoformat())


@pytest.mark.postgres
async def test_a_resend_holds_a_job_the_database_says_is_not_due_yet(
    pg_url: str, tmp_path: Path
) -> None:
    """An operator's resend of a delayed job judged "due" by a host whose clock runs 120 s
    ahead: its new message must still be held until the run time, by the database's clock
    (PostgreSQL: on SQLite the store's clock is the host's by design)."""
    host = Clock(datetime.now(UTC) + timedelta(seconds=120))
    base = build_runtime(pg_url, tmp_path, clock=host)
    rt = dataclasses.replace(base, app=app, store=Store(base.engine))  # the database's clock
    try:
        async with rt.engine.begin() as conn:
            job_id = await ping.enqueue(conn, Ping(n=8), delay=60)
        outcome = await Operator(rt).resend(job_id, actor="test", reason="lost message")
        assert outcome.done
        async with read_only(rt.engine) as conn:
            run_at = await conn.scalar(select(jobs.c.run_at).where(jobs.c.id == job_id))
            held = (
                await conn.scalars(
                    select(outbox.c.available_at)
                    .where(outbox.c.job_id == job_id)
                    .order_by(outbox.c.id)
                )
            ).all()
    finally:
        await rt.engine.dispose()
    assert run_at is not None
    assert held == [run_at, run_at], "the re-sent message was not held: it runs early"
