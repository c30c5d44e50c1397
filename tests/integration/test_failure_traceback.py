"""The traceback of a job's last failure (issue 24, the newcomer's traps): stored with the
failure, scrubbed, bounded, and shown to operators only.

Through the in-process pipeline on SQLite + the local transport and on PostgreSQL + RabbitMQ
(``backend``): an ``async def`` job raising inside a nested call ends ``quarantined`` and a
``def`` job (run in the thread pool) ends ``retry_wait``, each with a traceback that names
the inner function and ends with the exception line, and the DSN password and API token in
the message masked. Through the worker alone on SQLite and PostgreSQL (``database_url``): a
traceback far over 8 KiB is cut to its end, a lone surrogate does not break the store, and a
success keeps the last failure's traceback. Then who reads it: an account token never
(``GET /v1/jobs/{id}``, ``/explain``), an admin in ``/explain``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from pydantic import BaseModel
from sqlalchemy import update

import jobrelay
from jobrelay.domain.states import JobState
from jobrelay.library.operator import Operator
from jobrelay.runtime.wiring import Runtime, open_runtime
from jobrelay.storage.store import JobRecord
from jobrelay.storage.tables import jobs
from jobrelay.worker.consumer import Worker
from jobrelay.worker.failures import CUT_MARKER, MAX_TRACEBACK_BYTES

from .api_fixtures import api_client, bearer, build_runtime, make_token
from .ops_fixtures import LEASE
from .pipeline import Pipeline, settings_for
from .test_cli_job_ids import (
    cli,
    restore_logging,  # noqa: F401 (its autouse fixture)
)
from .test_library import Delivery  # a delivery that records its ack or reject

pytestmark = pytest.mark.timeout(90)

SECRET = "s3cret-pw"
TOKEN = "jr_" + "A1b2C3d4E5f6G7h8I9j0"
DEPTH = 120  # frames of mutual recursion: far over 8 KiB of traceback


class Row(BaseModel):
    n: int


class LedgerError(Exception):
    pass


app = jobrelay.App()


def _parse_ledger_row(n: int) -> None:
    raise LedgerError(f"row {n} unreadable from postgresql://app:{SECRET}@db/ledger ({TOKEN})")


def _load(n: int) -> None:
    _parse_ledger_row(n)


@app.job("tb.nested", params=Row, max_attempts=1)
async def nested(ctx: jobrelay.JobContext[Row], params: Row) -> None:
    _load(params.n)


@app.job("tb.sync", params=Row, max_attempts=3, retry_delays=(60,))
def sync_nested(ctx: jobrelay.SyncJobContext[Row], params: Row) -> None:
    _load(params.n)


def _ping(n: int) -> None:
    if n == 0:
        _deepest()
    _pong(n - 1)


def _pong(n: int) -> None:
    _ping(n)


def _deepest() -> None:
    raise ValueError("at the bottom \udc80 of the stack")


@app.job("tb.deep", params=Row, max_attempts=2, retry_delays=(60,))
async def deep(ctx: jobrelay.JobContext[Row], params: Row) -> jobrelay.Result | None:
    if params.n < 0:
        return None  # the second attempt succeeds
    _ping(params.n)
    return None


def assert_names_where_it_raised(job: JobRecord) -> str:
    text = job.last_traceback
    assert text is not None, job
    assert text.startswith("Traceback (most recent call last):"), text
    assert "in _load" in text and "in _parse_ledger_row" in text, text
    assert text.rstrip("\n").endswith("(jr_***)"), text  # the exception line is the last
    assert "LedgerError: row 7 unreadable from postgresql://app:***@db/ledger" in text, text
    assert SECRET not in text and TOKEN not in text
    return text


async def test_a_job_raising_in_a_nested_call_keeps_where_it_raised(
    backend: tuple[str, str], tmp_path: Path
) -> None:
    database_url, broker_url = backend
    settings = settings_for(
        database_url,
        broker_url,
        tmp_path / "results",
        app="tests.integration.test_failure_traceback:app",
    )
    async with open_runtime(settings) as rt:
        p = Pipeline(rt)
        try:
            async with rt.engine.begin() as conn:
                quarantined = await nested.enqueue(conn, {"n": 7})
                retrying = await sync_nested.enqueue(conn, {"n": 7})
            p.start_relay()
            await p.start_worker()
            job = await p.wait_for(quarantined, lambda j: j.state is JobState.QUARANTINED)
            text = assert_names_where_it_raised(job)
            assert 'raise LedgerError(f"row {n} unreadable' in text  # the source line
            job = await p.wait_for(retrying, lambda j: j.state is JobState.RETRY_WAIT)
            assert "in sync_nested" in assert_names_where_it_raised(job)
        finally:
            await p.stop_all()


@pytest.fixture
async def rt(database_url: str, tmp_path: Path) -> AsyncIterator[Runtime]:
    runtime = dataclasses.replace(build_runtime(database_url, tmp_path), app=app)
    yield runtime
    await runtime.engine.dispose()


async def run_job(rt: Runtime, job_id: str, job_type: str) -> Delivery:
    body = json.dumps({"jobId": job_id, "type": job_type, "version": 1}).encode()
    delivery = Delivery(body)
    await Worker(rt).handle(delivery)
    return delivery


async def test_a_huge_traceback_is_cut_to_its_end_and_a_success_keeps_it(rt: Runtime) -> None:
    async with rt.engine.begin() as conn:
        job_id = await deep.enqueue(conn, {"n": DEPTH})
    assert (await run_job(rt, job_id, "tb.deep")).outcomes == ["ack"]
    job = await rt.store.get_job(job_id)
    assert job is not None and job.state is JobState.RETRY_WAIT, job
    text = job.last_traceback
    assert text is not None
    assert len(text.encode("utf-8")) <= MAX_TRACEBACK_BYTES
    assert text.startswith(CUT_MARKER), text[:200]
    # The end is kept: the innermost frame and the exception line, its lone surrogate escaped.
    assert text.endswith("ValueError: at the bottom \\udc80 of the stack\n"), text[-200:]
    assert "in _deepest" in text
    assert "in run" not in text  # the worker's own outer frames are what was cut
    assert job.last_error is not None and "at the bottom" in job.last_error

    # A later attempt succeeds: the last failure's traceback is kept for the operators.
    async with rt.engine.begin() as conn:
        await conn.execute(
            update(jobs).where(jobs.c.id == job_id).values(params={"n": -1}, next_attempt_at=None)
        )
    assert (await run_job(rt, job_id, "tb.deep")).outcomes == ["ack"]
    done = await rt.store.get_job(job_id)
    assert done is not None and done.state is JobState.SUCCEEDED, done
    assert done.last_error is None and done.last_traceback == text


PLANTED = 'File "/srv/app/billing/secret_module.py", line 42, in charge'


async def _quarantined_with_traceback(rt: Runtime) -> str:
    async with rt.engine.begin() as conn:
        job_id = await nested.enqueue(conn, {"n": 1})
    claim = await rt.store.claim_job(job_id, "host-w:1:abcdef", rt.clock(), LEASE)
    assert claim is not None
    tb = f"Traceback (most recent call last):\n  {PLANTED}\nLedgerError: boom\n"
    assert await rt.store.quarantine(job_id, "boom", rt.clock(), claim=claim, traceback=tb)
    return job_id


async def test_an_account_never_reads_the_traceback_and_an_admin_does(rt: Runtime) -> None:
    job_id = await _quarantined_with_traceback(rt)
    async with rt.engine.begin() as conn:
        await conn.execute(update(jobs).where(jobs.c.id == job_id).values(account_id="acme"))
    async with api_client(rt) as client:
        acme = bearer(await make_token(rt, "acme"))
        admin = bearer(await make_token(rt, None, admin=True))
        for path in ("", "/explain", "/events"):
            response = await client.get(f"/v1/jobs/{job_id}{path}", headers=acme)
            assert response.status_code == 200, response.text
            assert "lastTraceback" not in response.json()
            assert "secret_module" not in response.text and "Traceback" not in response.text
        explained = await client.get(f"/v1/jobs/{job_id}/explain", headers=admin)
        assert explained.status_code == 200, explained.text
        assert PLANTED in explained.json()["lastTraceback"]
        # The job resource itself keeps its documented fields, for admins too.
        plain = await client.get(f"/v1/jobs/{job_id}", headers=admin)
        assert "lastTraceback" not in plain.json()


async def test_a_failure_without_a_traceback_clears_an_earlier_one(rt: Runtime) -> None:
    job_id = await _quarantined_with_traceback(rt)
    assert (await Operator(rt).replay(job_id, actor="t", reason="t")).done
    kept = await rt.store.get_job(job_id)
    assert kept is not None and kept.last_traceback is not None  # a replay keeps it
    claim = await rt.store.claim_job(job_id, "host-w:1:abcdef", rt.clock(), LEASE)
    assert claim is not None
    # A lost lease or a refused outcome: recorded with no traceback of its own.
    assert (await rt.store.schedule_retry(claim, "tb.nested", "lease lost", 5, rt.clock())).won
    job = await rt.store.get_job(job_id)
    assert job is not None and job.last_traceback is None


def _stored_with_traceback(database_url: str, tmp_path: Path, traceback: bool) -> str:
    """A quarantined job as the worker leaves it, with or without a traceback."""

    async def go() -> str:
        runtime = dataclasses.replace(build_runtime(database_url, tmp_path), app=app)
        try:
            if traceback:
                return await _quarantined_with_traceback(runtime)
            async with runtime.engine.begin() as conn:
                job_id = await nested.enqueue(conn, {"n": 2})
            claim = await runtime.store.claim_job(job_id, "host-w:1:abcdef", runtime.clock(), LEASE)
            assert claim is not None
            assert await runtime.store.quarantine(job_id, "boom", runtime.clock(), claim=claim)
            return job_id
        finally:
            await runtime.engine.dispose()

    return asyncio.run(go())


def test_job_show_hints_at_the_traceback_and_prints_it_with_the_flag(
    database_url: str, tmp_path: Path
) -> None:
    job_id = _stored_with_traceback(database_url, tmp_path, traceback=True)
    code, out, err = cli(database_url, tmp_path, "job", "show", job_id)
    assert code == 0, err
    assert out.rstrip("\n").endswith("last failure has a traceback: --traceback"), out
    assert "secret_module" not in out
    code, out, err = cli(database_url, tmp_path, "job", "show", job_id, "--traceback")
    assert code == 0, err
    view, _, shown = out.partition("traceback of the last failure:\n")
    assert f"job {job_id}" in view and "next: quarantined" in view  # the normal view first
    assert shown == f"Traceback (most recent call last):\n  {PLANTED}\nLedgerError: boom\n"
    code, out, _ = cli(database_url, tmp_path, "job", "show", job_id, "--json")
    assert code == 0 and PLANTED in json.loads(out)["lastTraceback"]

    bare = _stored_with_traceback(database_url, tmp_path, traceback=False)
    code, out, _ = cli(database_url, tmp_path, "job", "show", bare)
    assert code == 0 and "--traceback" not in out
    code, out, _ = cli(database_url, tmp_path, "job", "show", bare, "--traceback")
    assert code == 0 and out.rstrip("\n").endswith("no traceback stored for this job"), out
