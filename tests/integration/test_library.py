"""The library API: ``App``, ``@app.job``, enqueue inside the application's own transaction.

An application with its own business table (``images``) enqueues on its own engine, in its
own transaction, on SQLite and PostgreSQL; the real worker then runs the job. Subprocess and
HTTP end-to-end versions with ``--app`` are in tests/acceptance.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import BaseModel, Field
from sqlalchemy import (
    Column,
    Integer,
    MetaData,
    String,
    Table,
    create_engine,
    func,
    insert,
    make_url,
    select,
    text,
)
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

import jobrelay
from jobrelay.admin.explain import show_job
from jobrelay.api import create_app
from jobrelay.domain.states import JobState
from jobrelay.errors import ConfigError
from jobrelay.library.loader import load_app
from jobrelay.runtime.wiring import Runtime
from jobrelay.storage.engine import async_url, read_only
from jobrelay.storage.tables import job_events, jobs, outbox
from jobrelay.worker.consumer import Worker

from .api_fixtures import bearer, build_runtime, make_token

business = MetaData()
images = Table(
    "app_images",
    business,
    Column("id", Integer, primary_key=True),
    Column("name", String(64), nullable=False),
)


class Resize(BaseModel):
    image_id: int
    width: int = Field(gt=0)


class Note(BaseModel):
    text: str


app = jobrelay.App()
ran: list[tuple[str, int, Resize]] = []


@app.job("images.resize", params=Resize, max_attempts=2, retry_delays=(7,), http=True)
async def resize(ctx: jobrelay.JobContext[Resize], params: Resize) -> jobrelay.Result | None:
    ran.append((ctx.job_id, ctx.attempt, params))
    if params.width == 13:
        raise jobrelay.Retry("width 13 is unlucky today")
    if params.width == 666:
        raise jobrelay.Permanent("width 666 is refused for good")
    key = ctx.result_key("thumb.txt")
    async with ctx.writer(key) as out:
        await out.write(f"{params.image_id}@{params.width}".encode())
    await ctx.progress(1, 1)
    if params.width == 200:
        ctx.follow_up(note, Note(text=f"resized {params.image_id}"))
    return jobrelay.Result(key=key, meta={"width": params.width})


@app.job("images.note", params=Note)
async def note(ctx: jobrelay.JobContext[Note], params: Note) -> None:
    return None


class Delivery:
    def __init__(self, body: bytes) -> None:
        self.body = body
        self.headers: dict[str, object] = {}
        self.redelivered = False
        self.delivery_count = 0
        self.outcomes: list[str] = []

    async def ack(self) -> bool:
        self.outcomes.append("ack")
        return True

    async def reject(self) -> bool:
        self.outcomes.append("reject")
        return True

    def outcome_committed(self) -> None:
        return None  # no prefetch window of its own to free

    async def release(self) -> None:
        self.outcomes.append("release")


@pytest.fixture
async def rt(database_url: str, tmp_path: Path) -> AsyncIterator[Runtime]:
    runtime = dataclasses.replace(build_runtime(database_url, tmp_path), app=app)
    async with runtime.engine.begin() as conn:
        await conn.run_sync(business.create_all)
    ran.clear()
    yield runtime
    await runtime.engine.dispose()


@pytest.fixture
async def own_engine(database_url: str) -> AsyncIterator[AsyncEngine]:
    """The application's own engine and pool, on the same database as jobrelay."""
    engine = create_async_engine(async_url(database_url))
    yield engine
    await engine.dispose()


async def count(rt: Runtime, table: Table, **where: Any) -> int:
    query = select(func.count()).select_from(table)
    for column, value in where.items():
        query = query.where(table.c[column] == value)
    async with read_only(rt.engine) as conn:  # on SQLite: never waits for a writer
        return int(await conn.scalar(query) or 0)


async def run_job(rt: Runtime, job_id: str, job_type: str = "images.resize") -> Delivery:
    body = json.dumps({"jobId": job_id, "type": job_type, "version": 1}).encode()
    delivery = Delivery(body)
    await Worker(rt).handle(delivery)
    return delivery


async def test_a_committed_enqueue_runs_with_typed_params(
    rt: Runtime, own_engine: AsyncEngine
) -> None:
    async with own_engine.begin() as conn:
        await conn.execute(insert(images).values(id=1, name="cat.png"))
        job_id = await resize.enqueue(conn, Resize(image_id=1, width=100), account="acme")
        # Written on the caller's connection only: nothing visible outside it yet.
        assert await count(rt, jobs, id=job_id) == 0
    assert await count(rt, jobs, id=job_id) == 1
    assert await count(rt, outbox, job_id=job_id) == 1
    assert await count(rt, job_events, job_id=job_id, kind="accepted") == 1

    delivery = await run_job(rt, job_id)
    job = await rt.store.get_job(job_id)
    assert job is not None and job.state is JobState.SUCCEEDED and job.account_id == "acme"
    assert delivery.outcomes == ["ack"]
    assert ran == [(job_id, 1, Resize(image_id=1, width=100))]
    assert job.result_key == f"images.resize/{job_id}/thumb.txt"
    assert job.result_meta is not None and job.result_meta["width"] == 100
    root = Path(rt.settings.results_url.removeprefix("file://"))
    assert (root / job.result_key).read_bytes() == b"1@100"


async def test_a_rolled_back_enqueue_leaves_nothing(rt: Runtime, own_engine: AsyncEngine) -> None:
    with pytest.raises(RuntimeError, match="the application changed its mind"):
        async with own_engine.begin() as conn:
            await conn.execute(insert(images).values(id=2, name="dog.png"))
            await resize.enqueue(conn, {"image_id": 2, "width": 50}, key="img-2")
            raise RuntimeError("the application changed its mind")
    assert await count(rt, jobs) == 0
    assert await count(rt, outbox) == 0
    assert await count(rt, job_events) == 0
    assert await count(rt, images) == 0


async def test_invalid_params_name_each_field_and_write_nothing(
    rt: Runtime, own_engine: AsyncEngine
) -> None:
    async with own_engine.begin() as conn:
        with pytest.raises(jobrelay.InvalidParams) as raised:
            await resize.enqueue(conn, {"image_id": "x", "width": -1})
    fields = {e["field"] for e in raised.value.errors}
    assert fields == {"image_id", "width"}
    assert "image_id" in str(raised.value) and "width" in str(raised.value)
    assert isinstance(raised.value, jobrelay.JobrelayError)
    assert await count(rt, jobs) == 0


async def test_keys_make_one_job_and_refuse_other_params(
    rt: Runtime, own_engine: AsyncEngine
) -> None:
    async with own_engine.begin() as conn:
        first = await resize.enqueue(conn, {"image_id": 3, "width": 10}, key="img-3")
    async with own_engine.begin() as conn:
        again = await resize.enqueue(conn, Resize(image_id=3, width=10), key="img-3")
    assert again == first
    assert await count(rt, jobs) == 1 and await count(rt, outbox) == 1
    async with own_engine.begin() as conn:
        with pytest.raises(jobrelay.IdempotencyConflict):
            await resize.enqueue(conn, {"image_id": 3, "width": 11}, key="img-3")
    # Without a key every enqueue is a new job, with a time-ordered id (UUIDv7).
    async with own_engine.begin() as conn:
        a = await resize.enqueue(conn, {"image_id": 4, "width": 10})
        b = await resize.enqueue(conn, {"image_id": 4, "width": 10})
    assert a != b and {a[14], b[14]} == {"7"}
    assert await count(rt, jobs) == 3


async def test_sync_enqueue_on_a_synchronous_connection(rt: Runtime) -> None:
    """sqlite3 on SQLite, psycopg 3 on PostgreSQL: what Django or Flask would hold."""
    url = make_url(rt.settings.database_url)
    if rt.store.engine.dialect.name == "postgresql":
        url = url.set(drivername="postgresql+psycopg")
    sync_engine = create_engine(url)
    try:
        with sync_engine.begin() as conn:
            conn.execute(insert(images).values(id=5, name="sync.png"))
            job_id = resize.enqueue_sync(conn, {"image_id": 5, "width": 20}, key="img-5")
    finally:
        sync_engine.dispose()
    assert await count(rt, jobs, id=job_id) == 1
    assert await count(rt, outbox, job_id=job_id) == 1  # psycopg's rowcount is -1 here
    assert await count(rt, job_events, job_id=job_id, kind="accepted") == 1
    assert await count(rt, images, id=5) == 1
    assert (await run_job(rt, job_id)).outcomes == ["ack"]


async def test_app_enqueue_and_get_job_use_a_transaction_of_their_own(rt: Runtime) -> None:
    own = jobrelay.App(settings=rt.settings)
    own._jobs = app._jobs  # the same job types, this test's settings
    try:
        job_id = await own.enqueue("images.resize", {"image_id": 6, "width": 30})
        job = await own.get_job(job_id)
        assert job is not None and job.state is JobState.QUEUED and job.account_id is None
        with pytest.raises(ConfigError):
            await own.enqueue("images.nope", {})
    finally:
        await own.aclose()


async def test_retry_permanent_and_a_payload_that_no_longer_validates(
    rt: Runtime, own_engine: AsyncEngine
) -> None:
    async with own_engine.begin() as conn:
        unlucky = await resize.enqueue(conn, {"image_id": 7, "width": 13})
        refused = await resize.enqueue(conn, {"image_id": 8, "width": 666})
        stale = await resize.enqueue(conn, {"image_id": 9, "width": 10})
        await conn.execute(jobs.update().where(jobs.c.id == stale).values(params={"w": 1}))

    await run_job(rt, unlucky)
    job = await rt.store.get_job(unlucky)
    assert job is not None and job.state is JobState.RETRY_WAIT
    assert job.last_error == "width 13 is unlucky today"
    retry = [e.detail for e in await rt.store.events(unlucky) if e.kind == "retry_scheduled"]
    assert retry[0]["delaySeconds"] == 7  # the job type's own delays

    assert (await run_job(rt, refused)).outcomes == ["reject"]
    job = await rt.store.get_job(refused)
    assert job is not None and job.state is JobState.QUARANTINED
    assert job.quarantine_reason == "width 666 is refused for good"

    assert (await run_job(rt, stale)).outcomes == ["reject"]
    job = await rt.store.get_job(stale)
    assert job is not None and job.state is JobState.QUARANTINED
    assert job.quarantine_reason is not None and "image_id" in job.quarantine_reason


async def test_a_follow_up_commits_with_the_success(rt: Runtime, own_engine: AsyncEngine) -> None:
    async with own_engine.begin() as conn:
        job_id = await resize.enqueue(conn, {"image_id": 10, "width": 200}, account="acme")
    await run_job(rt, job_id)
    notes = [e.detail for e in await rt.store.events(job_id) if e.kind == "follow_up_accepted"]
    assert len(notes) == 1 and notes[0]["type"] == "images.note"
    follow = await rt.store.get_job(notes[0]["jobId"])
    assert follow is not None and follow.params == {"text": "resized 10"}
    assert follow.account_id == "acme" and follow.state is JobState.QUEUED


async def test_post_v1_jobs_for_exposed_types_only(rt: Runtime) -> None:
    api = create_app(rt.settings, runtime=rt)
    acme = bearer(await make_token(rt, "acme"))
    transport = httpx.ASGITransport(app=api)
    async with httpx.AsyncClient(transport=transport, base_url="http://api.test") as client:
        body = {"type": "images.resize", "params": {"image_id": 11, "width": 40}, "key": "k-11"}
        accepted = await client.post("/v1/jobs", json=body, headers=acme)
        assert accepted.status_code == 202, accepted.text
        job_id = accepted.json()["jobId"]
        again = await client.post("/v1/jobs", json=body, headers=acme)
        assert again.status_code == 202 and again.json()["jobId"] == job_id
        state = await client.get(f"/v1/jobs/{job_id}", headers=acme)
        assert state.status_code == 200 and state.json()["accountId"] == "acme"

        hidden = await client.post(
            "/v1/jobs", json={"type": "images.note", "params": {"text": "x"}}, headers=acme
        )
        assert hidden.status_code == 404
        unknown = await client.post("/v1/jobs", json={"type": "nope", "params": {}}, headers=acme)
        assert unknown.status_code == 404 and unknown.json() == {
            **hidden.json(),
            "detail": "no such job type is exposed over HTTP",
        }
        bad = await client.post(
            "/v1/jobs",
            json={"type": "images.resize", "params": {"image_id": 1, "width": 0}},
            headers=acme,
        )
        assert bad.status_code == 422
        assert [e["field"] for e in bad.json()["errors"]] == ["params.width"]
        anonymous = await client.post("/v1/jobs", json=body)
        assert anonymous.status_code == 401
    assert await count(rt, jobs) == 1


def test_a_bad_app_string_is_a_config_error_naming_the_variable() -> None:
    for spec in (
        "nodots",
        "no.such.module:app",
        "jobrelay.library.loader:nothing",
        "jobrelay.library.loader:DEFAULT_APP",
    ):
        with pytest.raises(ConfigError) as raised:
            load_app(spec)
        assert raised.value.variable == "JOBRELAY_APP"
    assert set(load_app(None).registry().types) == {"report.export", "notify.email"}
    assert load_app("tests.integration.test_library:app") is app


@app.job("images.count", params=Note)
async def count_halfway(ctx: jobrelay.JobContext[Note], params: Note) -> None:
    await ctx.progress(5, 10)


async def test_progress_is_the_jobs_and_survives_its_success(
    rt: Runtime, own_engine: AsyncEngine, capsys: pytest.CaptureFixture[str]
) -> None:
    # Given a job that reports 5 of 10 and succeeds with no result meta at all
    async with own_engine.begin() as conn:
        job_id = await count_halfway.enqueue(conn, {"text": "x"}, account="acme")
    # When the worker runs it (batched on PostgreSQL, alone on SQLite)
    assert (await run_job(rt, job_id, "images.count")).outcomes == ["ack"]
    # Then 5/10 stays: on the store, on App.get_job, on GET /v1/jobs/{id} and on job show
    own = jobrelay.App(settings=rt.settings)
    try:
        job = await own.get_job(job_id)
    finally:
        await own.aclose()
    assert job is not None and job.state is JobState.SUCCEEDED
    assert (job.progress_done, job.progress_total) == (5, 10)
    api = create_app(rt.settings, runtime=rt)
    transport = httpx.ASGITransport(app=api)
    async with httpx.AsyncClient(transport=transport, base_url="http://api.test") as client:
        got = await client.get(f"/v1/jobs/{job_id}", headers=bearer(await make_token(rt, "acme")))
    assert got.status_code == 200 and got.json()["progress"] == {"done": 5, "total": 10}
    capsys.readouterr()
    assert await show_job(rt.settings, job_id)
    shown = capsys.readouterr().out
    assert "5/10" in shown and "rows" not in shown  # "rows" is the export's word, not a job's


async def test_a_raw_sqlite3_connection_is_refused_by_the_async_enqueue(tmp_path: Path) -> None:
    """``enqueue_sync`` takes a raw sqlite3 connection (test_library_dbapi.py); the async
    ``enqueue`` does not, and says what to pass."""
    raw = sqlite3.connect(tmp_path / "raw.db")
    try:
        with pytest.raises(jobrelay.ConfigError, match="SQLAlchemy AsyncConnection") as aio:
            await resize.enqueue(raw, {"image_id": 1, "width": 1})  # type: ignore[arg-type]
    finally:
        raw.close()
    assert "sqlite3.Connection" in str(aio.value) and "\n" not in str(aio.value)


async def test_a_database_without_the_schema_says_run_db_upgrade(tmp_path: Path) -> None:
    empty = create_engine(f"sqlite:///{tmp_path / 'empty.db'}")
    try:
        with empty.begin() as conn, pytest.raises(jobrelay.ConfigError, match="db upgrade"):
            resize.enqueue_sync(conn, {"image_id": 1, "width": 1})
        with empty.begin() as conn, pytest.raises(jobrelay.ConfigError, match="db upgrade"):
            resize.enqueue_sync(conn, {"image_id": 1, "width": 1}, key="k")  # reads id keys first
    finally:
        empty.dispose()


@pytest.mark.parametrize("var_exists", [False, True])
async def test_the_first_enqueue_before_db_upgrade_on_the_default_says_run_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, var_exists: bool
) -> None:
    # A newcomer's first App.enqueue, on the embedded default, before `jobrelay db upgrade`:
    # the documented hint, not SQLAlchemy's "unable to open database file", and no empty
    # database file left behind for the next command to call "at nothing".
    monkeypatch.chdir(tmp_path)
    if var_exists:
        (tmp_path / "var").mkdir()
    default = jobrelay.Settings.model_fields["database_url"].default
    own = jobrelay.App(settings=jobrelay.Settings(database_url=default))
    own._jobs = app._jobs
    try:
        with pytest.raises(jobrelay.ConfigError, match="run `jobrelay db upgrade`") as raised:
            await own.enqueue("images.resize", {"image_id": 1, "width": 1})
        assert "var/jobrelay.db" in str(raised.value), raised.value
        with pytest.raises(jobrelay.ConfigError, match="run `jobrelay db upgrade`"):
            await own.get_job("00000000-0000-7000-8000-000000000000")
    finally:
        await own.aclose()
    # The tutorial's way: the application's own engine, from jobrelay.create_engine, opened
    # for its own table before the enqueue. Without ./var, SQLite cannot open the file.
    engine = jobrelay.create_engine(default)
    try:
        if var_exists:
            async with engine.begin() as conn:
                with pytest.raises(jobrelay.ConfigError, match="run `jobrelay db upgrade`"):
                    await resize.enqueue(conn, {"image_id": 1, "width": 1})
        else:
            with pytest.raises(jobrelay.ConfigError, match="run `jobrelay db upgrade`") as first:
                async with engine.begin() as conn:
                    pass
            assert "var/jobrelay.db" in str(first.value), first.value
    finally:
        await engine.dispose()
    assert os.listdir(tmp_path) == (["var"] if var_exists else [])


async def test_a_job_name_typo_says_did_you_mean(rt: Runtime) -> None:
    own = jobrelay.App(settings=rt.settings)
    own._jobs = app._jobs
    try:
        with pytest.raises(jobrelay.ConfigError, match=r"did you mean 'images\.resize'"):
            await own.enqueue("images.resze", {})
    finally:
        await own.aclose()


async def test_a_key_conflict_speaks_of_keys(rt: Runtime, own_engine: AsyncEngine) -> None:
    async with own_engine.begin() as conn:
        await resize.enqueue(conn, {"image_id": 4, "width": 10}, key="img-4")
    async with own_engine.begin() as conn:
        with pytest.raises(jobrelay.IdempotencyConflict) as raised:
            await resize.enqueue(conn, {"image_id": 4, "width": 11}, key="img-4")
    message = str(raised.value)
    assert "key 'img-4'" in message and "images.resize" in message
    assert "Idempotency-Key" not in message and "body" not in message


def test_validate_raises_invalid_params() -> None:
    with pytest.raises(jobrelay.InvalidParams) as raised:
        resize.validate({"image_id": "x", "width": 1})
    assert raised.value.errors[0]["field"] == "image_id"


async def test_a_postgres_search_path_without_the_schema_says_run_db_upgrade(pg_url: str) -> None:
    engine = create_async_engine(async_url(pg_url))
    try:
        async with engine.connect() as conn:
            await conn.execute(text("CREATE SCHEMA no_jobrelay_here"))
            await conn.execute(text("SET LOCAL search_path TO no_jobrelay_here"))
            with pytest.raises(jobrelay.ConfigError, match="db upgrade") as raised:
                await resize.enqueue(conn, {"image_id": 1, "width": 1})
            assert "jobs" in str(raised.value) and "\n" not in str(raised.value)
            await conn.rollback()
    finally:
        await engine.dispose()
