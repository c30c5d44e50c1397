"""Waiting on a job (issue 37, item 4): ``App.wait`` / ``App.result`` and their sync twins.

On both databases, through the relay, the broker and a real worker. The fallback read is
pushed out to a minute here, so a waiter that returns at all was woken by the commit that
ended its job: PostgreSQL's ``NOTIFY`` on ``jobrelay_done`` (one per completion statement),
SQLite's ``data_version`` (the worker's commit, seen from the waiter's connection).
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import asyncpg
import httpx
import pytest
from pydantic import BaseModel

import jobrelay
from jobrelay.api import create_app
from jobrelay.domain.states import JobState
from jobrelay.library import waiting
from jobrelay.storage.admin import AdminQueries

from .api_fixtures import bearer, make_token
from .ops_fixtures import eventually

pytestmark = pytest.mark.timeout(120)

WAIT = 20.0  # the test's own bound: far below the fallback, far above any real wake-up


class Ask(BaseModel):
    n: int


app = jobrelay.App()


@app.job("lab.square", params=Ask, max_attempts=1)
async def square(ctx: jobrelay.JobContext[Ask], p: Ask) -> Any:
    if p.n < 0:
        raise jobrelay.Permanent(f"no square for {p.n} today")
    return {"square": p.n * p.n}


@pytest.fixture(autouse=True)
def no_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(waiting, "FALLBACK_SECONDS", 60.0)


async def test_every_waiter_is_woken_by_the_commit_that_ends_the_job(make_pipeline: Any) -> None:
    async with make_pipeline() as p:
        p.rt = dataclasses.replace(p.rt, app=app)
        waiter = jobrelay.App(settings=p.rt.settings)
        try:
            job_id, _ = await p.store.submit(square.new_job(Ask(n=7)), p.rt.clock())
            waits = [asyncio.create_task(waiter.wait(job_id)) for _ in range(100)]
            values = asyncio.create_task(waiter.result(job_id))
            await asyncio.sleep(0)  # registered before anything runs
            assert not any(w.done() for w in waits)
            p.start_relay()
            await p.start_worker()
            jobs = await asyncio.wait_for(asyncio.gather(*waits), WAIT)
            assert {(j.id, j.state, j.attempt) for j in jobs} == {(job_id, JobState.SUCCEEDED, 1)}
            assert all(j.result == {"square": 49} for j in jobs)
            assert await asyncio.wait_for(values, WAIT) == {"square": 49}
            # A job that has already ended: answered by the first read.
            assert (await waiter.wait(job_id, timeout=WAIT)).state is JobState.SUCCEEDED
        finally:
            await waiter.aclose()


async def test_result_raises_job_failed_for_a_job_that_did_not_succeed(
    make_pipeline: Any,
) -> None:
    async with make_pipeline() as p:
        p.rt = dataclasses.replace(p.rt, app=app)
        waiter = jobrelay.App(settings=p.rt.settings)
        try:
            failed, _ = await p.store.submit(square.new_job(Ask(n=-1)), p.rt.clock())
            dropped, _ = await p.store.submit(square.new_job(Ask(n=2)), p.rt.clock())
            outcome = asyncio.create_task(waiter.result(failed))
            cancelled = asyncio.create_task(waiter.result(dropped))
            await asyncio.sleep(0)
            # Cancelled while queued (no relay yet): the cancel's commit wakes its waiter.
            done = await AdminQueries(p.store).cancel(
                dropped, actor="ops", reason="not needed", now=p.rt.clock()
            )
            assert done.done
            with pytest.raises(jobrelay.JobFailed) as stopped:
                await asyncio.wait_for(cancelled, WAIT)
            assert stopped.value.state == "cancelled"
            p.start_relay()
            await p.start_worker()
            with pytest.raises(jobrelay.JobFailed) as raised:
                await asyncio.wait_for(outcome, WAIT)
            assert raised.value.state == "quarantined" and raised.value.job_id == failed
            assert "no square for -1 today" in (raised.value.reason or "")
        finally:
            await waiter.aclose()


async def test_a_wait_times_out_and_an_unknown_job_is_not_found(make_pipeline: Any) -> None:
    async with make_pipeline() as p:
        waiter = jobrelay.App(settings=p.rt.settings)
        try:
            job_id, _ = await p.store.submit(square.new_job(Ask(n=3)), p.rt.clock())
            with pytest.raises(TimeoutError):
                await waiter.wait(job_id, timeout=0.2)  # nobody runs it
            with pytest.raises(jobrelay.JobNotFound):
                await waiter.wait("00000000-0000-0000-0000-000000000000", timeout=WAIT)
        finally:
            await waiter.aclose()


async def test_the_sync_twins_wait_with_no_event_loop(make_pipeline: Any) -> None:
    async with make_pipeline() as p:
        p.rt = dataclasses.replace(p.rt, app=app)
        waiter = jobrelay.App(settings=p.rt.settings)
        job_id, _ = await p.store.submit(square.new_job(Ask(n=5)), p.rt.clock())
        p.start_relay()
        await p.start_worker()
        # A thread with no loop, as a Django view or a script is.
        value = await asyncio.wait_for(asyncio.to_thread(waiter.result_sync, job_id, WAIT), WAIT)
        assert value == {"square": 25}
        job = await asyncio.to_thread(waiter.wait_sync, job_id, WAIT)
        assert job.state is JobState.SUCCEEDED
        with pytest.raises(jobrelay.ConfigError, match="running event loop"):
            waiter.wait_sync(job_id)  # here, inside the test's loop


async def test_get_job_with_wait_answers_when_the_job_ends_or_the_time_is_up(
    make_pipeline: Any,
) -> None:
    async with make_pipeline() as p:
        p.rt = dataclasses.replace(p.rt, app=app)
        token = await make_token(p.rt, None, admin=True)
        api = create_app(p.rt.settings, runtime=p.rt)
        transport = httpx.ASGITransport(app=api)
        async with httpx.AsyncClient(transport=transport, base_url="http://api") as client:
            job_id, _ = await p.store.submit(square.new_job(Ask(n=4)), p.rt.clock())
            # Nobody runs it yet: the time is up, and the answer is its state then.
            quick = await client.get(f"/v1/jobs/{job_id}?wait=0.2", headers=bearer(token))
            assert quick.status_code == 200 and quick.json()["state"] == "queued"
            waiting_get = asyncio.create_task(
                client.get(f"/v1/jobs/{job_id}?wait=30", headers=bearer(token))
            )
            p.start_relay()
            await p.start_worker()
            answer = await asyncio.wait_for(waiting_get, WAIT)
            assert answer.status_code == 200
            assert answer.json()["state"] == "succeeded"
            assert answer.json()["result"] == {"square": 16}
            for bad in ("61", "-1", "soon"):
                refused = await client.get(f"/v1/jobs/{job_id}?wait={bad}", headers=bearer(token))
                assert refused.status_code == 422, (bad, refused.text)
                assert refused.headers["content-type"].startswith("application/problem+json")


async def test_a_waiter_whose_listening_connection_dies_is_still_woken_by_the_commit(
    make_pipeline: Any,
) -> None:
    """PostgreSQL: the watcher's ``LISTEN`` connection is terminated by the server while a
    waiter waits; the watcher listens again on a new one, reads once, and the commit that
    ends the job wakes the waiter (the fallback read is a minute away). Old code: no
    reconnection, and the waiter waited for the fallback read."""
    async with make_pipeline() as p:
        if not p.rt.settings.database_url.startswith("postgresql"):
            pytest.skip("LISTEN is PostgreSQL's; SQLite's waiters read data_version")
        p.rt = dataclasses.replace(p.rt, app=app)
        waiter = jobrelay.App(settings=p.rt.settings)
        admin = await asyncpg.connect(p.rt.settings.database_url.replace("+asyncpg", ""))
        try:
            job_id, _ = await p.store.submit(square.new_job(Ask(n=6)), p.rt.clock())
            waits = asyncio.create_task(waiter.wait(job_id))
            listening = "SELECT pid FROM pg_stat_activity WHERE query = 'LISTEN \"jobrelay_done\"'"

            async def listener() -> int | None:
                return await admin.fetchval(listening)  # type: ignore[no-any-return]

            first = await eventually(listener, what="the watcher to listen")
            await admin.execute("SELECT pg_terminate_backend($1)", first)

            async def listens_again() -> bool:
                pid = await listener()
                return pid is not None and pid != first

            await eventually(listens_again, what="the watcher to listen on a new connection")
            assert not waits.done()
            p.start_relay()
            await p.start_worker()
            job = await asyncio.wait_for(waits, WAIT)
            assert job.state is JobState.SUCCEEDED and job.result == {"square": 36}
        finally:
            await admin.close()
            await waiter.aclose()
