"""A result's upload never happens under the job's lock (issue 34, item 2).

On S3 a result is uploaded whole under a key of its attempt's own BEFORE the fenced
completion, and the completion (the guarded UPDATE) records that key as the job's
``resultKey``: no network I/O while the job's row (PostgreSQL) or the write lock (SQLite) is
held, so a slow upload holds up no renewal of a neighbour. An attempt that loses its claim
deletes its upload; no job ever names it. Hand-driven on SQLite and PostgreSQL, against moto.
"""

from __future__ import annotations

import asyncio
import dataclasses
import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from sqlalchemy import text, update
from sqlalchemy.exc import DBAPIError

from jobrelay.domain.states import JobState
from jobrelay.library.operations import OperationContext, OperationResult, Registry
from jobrelay.results.s3 import S3Results, S3Session
from jobrelay.runtime.wiring import Runtime
from jobrelay.storage.tables import jobs
from jobrelay.worker.consumer import Worker

from .effects_fixtures import (  # noqa: F401 (fixtures, registered by name)
    S3Server,
    aws_env_fixture,
    bucket_fixture,
    create_bucket,
    object_bytes,
    object_keys,
    s3_server_fixture,
)
from .test_claims import (
    ROWS,
    HandDelivery,
    body_of,
    events_of,
    eventually,
    job_state,
    runtime_for,
    seed,
    submit,
)
from .test_outcomes import Scripted

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
async def s3_rt(
    database_url: str, tmp_path: Path, s3_server: S3Server, bucket: str
) -> AsyncIterator[Runtime]:
    await create_bucket(s3_server.endpoint, bucket)
    results = S3Results(f"s3://{bucket}/results", endpoint_url=s3_server.endpoint)
    rt = dataclasses.replace(runtime_for(database_url, tmp_path), results=results)
    await seed(rt.engine, ROWS)
    yield rt
    await results.aclose()
    await rt.engine.dispose()


async def _job_row_locked(rt: Runtime, job_id: str) -> bool:
    """Whether another transaction holds the job's row (PostgreSQL) or the write lock
    (SQLite) right now; asked a few times, so a passing writer is not taken for it."""
    for _ in range(20):
        if rt.store.engine.dialect.name == "postgresql":
            try:
                async with rt.engine.connect() as conn, conn.begin():
                    await conn.execute(
                        text("SELECT id FROM jobs WHERE id = :id FOR UPDATE NOWAIT"),
                        {"id": job_id},
                    )
                return False
            except DBAPIError:
                pass
        else:
            path = str(rt.engine.url.database)
            probe = sqlite3.connect(path, timeout=0, isolation_level=None)
            try:
                probe.execute("BEGIN IMMEDIATE")
                probe.execute("ROLLBACK")
                return False
            except sqlite3.OperationalError:
                pass
            finally:
                probe.close()
        await asyncio.sleep(0.01)
    return True


async def test_the_upload_comes_before_the_fenced_update_under_the_attempts_own_key(
    s3_rt: Runtime, s3_server: S3Server, bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    rt = s3_rt
    winner = await submit(rt, period="2020-01")
    loser = await submit(rt, period="2020-02")
    uploads: list[tuple[str, bool, JobState]] = []  # (object key, job locked, job state)
    commit = S3Session._commit

    async def watched(session: S3Session) -> None:
        job_id = winner if winner in session.object_key else loser
        state, _ = await job_state(rt, job_id)
        uploads.append((session.object_key, await _job_row_locked(rt, job_id), state))
        await commit(session)

    monkeypatch.setattr(S3Session, "_commit", watched)
    taken_over = asyncio.Event()
    uploaded = asyncio.Event()

    async def write(ctx: OperationContext) -> OperationResult:
        key = f"exports/acme/{ctx.job.id}.csv"
        async with ctx.results.writer(key) as out:
            await out.write(b"entry_id,amount\r\n1,2.00\r\n")
        if ctx.job.id == loser:
            uploaded.set()
            await taken_over.wait()  # another claim takes the job over meanwhile
        return OperationResult(key, {"rows": 1})

    operation = Scripted({"2020-01": write, "2020-02": write})
    worker = Worker(rt, registry=Registry([operation]), worker_id="w-1")
    await worker.handle(HandDelivery(body_of(winner)))

    # The winner: uploaded while its job was running and unlocked, under its attempt's own
    # key, which the fenced update then recorded as the job's resultKey.
    own_key = f"exports/acme/{winner}.attempt-1.csv"
    assert uploads == [(f"results/{own_key}", False, JobState.RUNNING)]
    job = await rt.store.get_job(winner)
    assert job is not None and job.state is JobState.SUCCEEDED and job.attempt == 1
    assert job.result_key == own_key
    assert await object_bytes(s3_server.endpoint, bucket, f"results/{own_key}") == (
        b"entry_id,amount\r\n1,2.00\r\n"
    )
    saved = await events_of(rt, winner, "result_saved")
    assert [e["resultKey"] for e in saved] == [own_key]
    assert b"".join([c async for c in rt.results.read(job.result_key)]).startswith(b"entry_id")

    # The loser: its upload is done, then another claim takes the job over before its
    # completion: the completion loses, its upload is deleted, no job names it.
    run = asyncio.create_task(worker.handle(HandDelivery(body_of(loser))))
    await asyncio.wait_for(uploaded.wait(), 30)
    loser_key = f"results/exports/acme/{loser}.attempt-1.csv"
    assert loser_key in await object_keys(s3_server.endpoint, bucket)
    async with rt.engine.begin() as conn:
        await conn.execute(
            update(jobs).where(jobs.c.id == loser).values(attempt=2, lease_owner="w-thief")
        )
    taken_over.set()
    await asyncio.wait_for(run, 30)
    assert await job_state(rt, loser) == (JobState.RUNNING, 2)
    lost = await rt.store.get_job(loser)
    assert lost is not None and lost.result_key is None

    async def cleaned() -> bool:
        return loser_key not in await object_keys(s3_server.endpoint, bucket)

    await eventually(cleaned, "the losing attempt's upload deleted")
    assert await object_keys(s3_server.endpoint, bucket) == [f"results/{own_key}"]
