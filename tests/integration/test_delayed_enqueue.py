"""Enqueueing a delayed job: the library (``enqueue``, ``enqueue_sync``, ``App.enqueue``) and
``POST /v1/jobs`` (``runAt``, ``delaySeconds``) write the run time on the job and its outbox
row, refuse a bad one with a typed error or a 422 and write nothing, and treat the run time
as part of the request for idempotency. On SQLite and PostgreSQL."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine, func, make_url, select

import jobrelay
from jobrelay.runtime.wiring import Runtime
from jobrelay.storage.engine import read_only
from jobrelay.storage.tables import jobs, outbox

from .api_fixtures import Ping, api_client, bearer, make_token, ping_app, runtime_with_app
from .test_cli_job_ids import (
    cli,
    restore_logging,  # noqa: F401 (its autouse fixture)
)
from .test_cli_jobs_list import submit

app, ping = ping_app("later.ping")


@pytest.fixture
async def rt(database_url: str, tmp_path: Path) -> AsyncIterator[Runtime]:
    async with runtime_with_app(app, database_url, tmp_path) as runtime:
        yield runtime


async def held(rt: Runtime, job_id: str) -> tuple[datetime | None, datetime | None]:
    """The job's ``run_at`` and its outbox row's ``available_at``."""
    async with read_only(rt.engine) as conn:
        run_at = await conn.scalar(select(jobs.c.run_at).where(jobs.c.id == job_id))
        available = await conn.scalar(
            select(outbox.c.available_at).where(outbox.c.job_id == job_id)
        )
    return run_at, available


async def count(rt: Runtime, table: Any) -> int:
    async with read_only(rt.engine) as conn:
        return int(await conn.scalar(select(func.count()).select_from(table)) or 0)


async def test_enqueue_with_a_delay_or_a_run_time_holds_the_outbox_row(rt: Runtime) -> None:
    before = datetime.now(UTC)
    async with rt.engine.begin() as conn:
        by_delay = await ping.enqueue(conn, Ping(n=1), delay=30)
        by_timedelta = await ping.enqueue(conn, Ping(n=2), delay=timedelta(minutes=5))
        at = datetime(2030, 1, 1, 12, tzinfo=UTC)
        by_run_at = await ping.enqueue(conn, Ping(n=3), run_at=at - timedelta(days=2000))
        soon = datetime.now(UTC) + timedelta(hours=2)
        by_aware = await ping.enqueue(conn, Ping(n=4), run_at=soon)
        now = await ping.enqueue(conn, Ping(n=5))
    run_at, available = await held(rt, by_delay)
    assert run_at is not None and run_at == available
    assert before + timedelta(seconds=30) <= run_at <= datetime.now(UTC) + timedelta(seconds=30)
    run_at, _ = await held(rt, by_timedelta)
    assert run_at is not None and run_at >= before + timedelta(minutes=5)
    assert await held(rt, by_run_at) == (None, None)  # in the past: now
    assert await held(rt, by_aware) == (soon, soon)
    assert await held(rt, now) == (None, None)
    job = await rt.store.get_job(by_aware)
    assert job is not None and job.run_at == soon and job.waiting_for_run_at(datetime.now(UTC))
    assert not job.published  # its row waits, on purpose


async def test_app_enqueue_takes_a_delay_too(rt: Runtime, database_url: str) -> None:
    own = jobrelay.App(settings=rt.settings)
    own.job("later.ping", params=Ping)(ping.fn)
    try:
        job_id = await own.enqueue("later.ping", {"n": 6}, delay=60)
    finally:
        await own.aclose()
    run_at, available = await held(rt, job_id)
    assert run_at is not None and run_at == available


def test_enqueue_sync_takes_a_delay_too(rt: Runtime, database_url: str) -> None:
    url = make_url(database_url)
    if url.drivername.startswith("postgresql"):
        url = url.set(drivername="postgresql+psycopg")
    engine = create_engine(url)
    try:
        with engine.begin() as conn:
            job_id = ping.enqueue_sync(conn, {"n": 7}, run_at=datetime.now(UTC) + timedelta(1))
        with engine.connect() as conn:
            row = conn.execute(select(jobs.c.run_at).where(jobs.c.id == job_id)).one()
    finally:
        engine.dispose()
    assert row.run_at is not None


@pytest.mark.parametrize(
    ("when", "field"),
    [
        ({"delay": -1}, "delay"),
        ({"delay": timedelta(days=366)}, "delay"),
        ({"run_at": datetime(2030, 1, 1, 12)}, "run_at"),  # naive
        ({"run_at": datetime.now(UTC) + timedelta(days=400)}, "run_at"),
        ({"run_at": datetime.now(UTC), "delay": 5}, "run_at"),
    ],
)
async def test_a_bad_run_time_is_a_typed_error_and_writes_nothing(
    rt: Runtime, when: dict[str, Any], field: str
) -> None:
    async with rt.engine.begin() as conn:
        with pytest.raises(jobrelay.InvalidRunTime) as raised:
            await ping.enqueue(conn, Ping(n=1), **when)
    assert raised.value.field == field
    assert isinstance(raised.value, jobrelay.JobrelayError)
    assert await count(rt, jobs) == 0 and await count(rt, outbox) == 0


async def test_the_run_time_is_part_of_the_request_for_a_key(rt: Runtime) -> None:
    at = datetime.now(UTC) + timedelta(hours=1)
    async with rt.engine.begin() as conn:
        first = await ping.enqueue(conn, Ping(n=1), key="k-1", run_at=at)
    async with rt.engine.begin() as conn:
        again = await ping.enqueue(conn, Ping(n=1), key="k-1", run_at=at)
    assert again == first
    with pytest.raises(jobrelay.IdempotencyConflict):
        async with rt.engine.begin() as conn:
            await ping.enqueue(conn, Ping(n=1), key="k-1", run_at=at + timedelta(seconds=1))
    with pytest.raises(jobrelay.IdempotencyConflict):
        async with rt.engine.begin() as conn:
            await ping.enqueue(conn, Ping(n=1), key="k-1")
    # A relative delay is the request as asked: the same delay again is the same request.
    async with rt.engine.begin() as conn:
        delayed = await ping.enqueue(conn, Ping(n=2), key="k-2", delay=30)
    async with rt.engine.begin() as conn:
        assert await ping.enqueue(conn, Ping(n=2), key="k-2", delay=30) == delayed
    assert await count(rt, jobs) == 2


async def test_post_v1_jobs_takes_run_at_or_delay_seconds(rt: Runtime) -> None:
    acme = bearer(await make_token(rt, "acme"))
    at = (datetime.now(UTC) + timedelta(hours=1)).replace(microsecond=0)
    async with api_client(rt) as client:
        body = {"type": "later.ping", "params": {"n": 1}, "runAt": at.isoformat()}
        accepted = await client.post("/v1/jobs", json=body, headers=acme)
        assert accepted.status_code == 202, accepted.text
        job_id = accepted.json()["jobId"]
        shown = (await client.get(f"/v1/jobs/{job_id}", headers=acme)).json()
        assert datetime.fromisoformat(shown["runAt"]) == at and shown["state"] == "queued"
        assert shown["published"] is False
        explained = (await client.get(f"/v1/jobs/{job_id}/explain", headers=acme)).json()
        assert datetime.fromisoformat(explained["runAt"]) == at
        assert explained["nextStep"].startswith("scheduled: runs at")

        zulu = at.isoformat().replace("+00:00", "Z")
        body = {"type": "later.ping", "params": {"n": 2}, "runAt": zulu}
        assert (await client.post("/v1/jobs", json=body, headers=acme)).status_code == 202
        body = {"type": "later.ping", "params": {"n": 3}, "delaySeconds": 2.5}
        delayed = await client.post("/v1/jobs", json=body, headers=acme)
        assert delayed.status_code == 202
        run_at, _ = await held(rt, delayed.json()["jobId"])
        assert run_at is not None
        plain = {"type": "later.ping", "params": {"n": 4}}
        immediate = await client.post("/v1/jobs", json=plain, headers=acme)
        got = await client.get(f"/v1/jobs/{immediate.json()['jobId']}", headers=acme)
        assert got.json()["runAt"] is None
    assert await count(rt, jobs) == 4


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"runAt": "2030-01-01T12:00:00"}, "runAt"),  # no offset
        ({"runAt": "next tuesday"}, "runAt"),
        ({"runAt": "2099-01-01T12:00:00Z"}, "runAt"),  # beyond 365 days
        ({"delaySeconds": -1}, "delaySeconds"),
        ({"delaySeconds": 365 * 86400 + 1}, "delaySeconds"),
        ({"delaySeconds": 5, "runAt": "2030-01-01T12:00:00Z"}, "runAt"),
    ],
)
async def test_post_v1_jobs_refuses_a_bad_run_time_with_a_422(
    rt: Runtime, extra: dict[str, Any], field: str
) -> None:
    acme = bearer(await make_token(rt, "acme"))
    async with api_client(rt) as client:
        body = {"type": "later.ping", "params": {"n": 1}, **extra}
        refused = await client.post("/v1/jobs", json=body, headers=acme)
    assert refused.status_code == 422, refused.text
    assert refused.headers["content-type"].startswith("application/problem+json")
    problem = refused.json()
    assert problem["title"] == "Invalid run time"
    assert [e["field"] for e in problem["errors"]] == [field]
    assert await count(rt, jobs) == 0


async def test_post_v1_jobs_with_a_key_and_another_run_at_is_a_conflict(rt: Runtime) -> None:
    acme = bearer(await make_token(rt, "acme"))
    at = datetime.now(UTC) + timedelta(hours=1)
    async with api_client(rt) as client:
        body = {"type": "later.ping", "params": {"n": 1}, "key": "k-9", "runAt": at.isoformat()}
        first = await client.post("/v1/jobs", json=body, headers=acme)
        again = await client.post("/v1/jobs", json=body, headers=acme)
        assert first.status_code == again.status_code == 202
        assert first.json()["jobId"] == again.json()["jobId"]
        other = {**body, "runAt": (at + timedelta(minutes=1)).isoformat()}
        conflict = await client.post("/v1/jobs", json=other, headers=acme)
    assert conflict.status_code == 422
    assert [e["field"] for e in conflict.json()["errors"]] == ["key"]
    assert await count(rt, jobs) == 1


def test_job_show_and_jobs_list_say_when_it_runs(database_url: str, tmp_path: Path) -> None:
    run_at = datetime.now(UTC) + timedelta(hours=1)
    job_id = submit(database_url, "acme", "2020-05", run_at=run_at)
    code, out, _ = cli(database_url, tmp_path, "job", "show", job_id)
    assert code == 0, out
    assert f"runs at {run_at.isoformat()} (in " in out
    assert "delayed, not stuck" in out and "is a relay running?" not in out
    code, out, _ = cli(database_url, tmp_path, "jobs", "list")
    assert code == 0 and "runs at" in out and "1 job(s)" in out


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        # UTC of these is past year 9999 / before year 1: no datetime holds it (issue 34, 14).
        ({"runAt": "9999-12-31T23:59:59-23:59"}, "runAt"),
        ({"runAt": "0001-01-01T00:00:00+23:59"}, "runAt"),
        # JSON's true and "1" are not numbers of seconds.
        ({"delaySeconds": True}, "delaySeconds"),
        ({"delaySeconds": "1"}, "delaySeconds"),
    ],
)
async def test_post_v1_jobs_refuses_an_unrepresentable_run_time_or_a_non_number_delay(
    rt: Runtime, extra: dict[str, Any], field: str
) -> None:
    acme = bearer(await make_token(rt, "acme"))
    async with api_client(rt) as client:
        body = {"type": "later.ping", "params": {"n": 1}, **extra}
        refused = await client.post("/v1/jobs", json=body, headers=acme)
    assert refused.status_code == 422, refused.text
    assert refused.headers["content-type"].startswith("application/problem+json")
    assert [e["field"] for e in refused.json()["errors"]] == [field]
    assert await count(rt, jobs) == 0


async def test_post_v1_jobs_takes_the_idempotency_key_header_as_the_key(rt: Runtime) -> None:
    acme = bearer(await make_token(rt, "acme"))
    async with api_client(rt) as client:
        body = {"type": "later.ping", "params": {"n": 1}}
        keyed = {**acme, "Idempotency-Key": "retry-1"}
        first = await client.post("/v1/jobs", json=body, headers=keyed)
        retried = await client.post("/v1/jobs", json=body, headers=keyed)
        assert first.status_code == retried.status_code == 202, retried.text
        assert retried.json()["jobId"] == first.json()["jobId"]
        # The same key in the body and the header is one key; two different ones are a 422.
        same = await client.post("/v1/jobs", json={**body, "key": "retry-1"}, headers=keyed)
        assert same.json()["jobId"] == first.json()["jobId"]
        other = await client.post("/v1/jobs", json={**body, "key": "retry-2"}, headers=keyed)
        assert other.status_code == 422, other.text
        assert [e["field"] for e in other.json()["errors"]] == ["Idempotency-Key"]
        bad = await client.post("/v1/jobs", json=body, headers={**acme, "Idempotency-Key": ""})
        assert bad.status_code == 422, bad.text
    assert await count(rt, jobs) == 1
