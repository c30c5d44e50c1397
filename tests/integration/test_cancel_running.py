"""Cancelling a running job (issue 24, item 5).

An operator's cancel of a ``running`` job is recorded (``cancel_requested``); the worker that
holds the claim learns it with its lease renewal, stops the function (an ``async def`` is
cancelled, a ``def`` job sees ``ctx.cancelled``), publishes nothing and ends the job
``cancelled`` with the operator's reason. The fences refuse any outcome of a claim whose
cancel was requested, so a run finishing just after the request cannot become
``succeeded``; a job that finished first stays ``succeeded`` and the cancel says so (409,
CLI exit 1). A cancelled job whose worker died is ended by the reconciler or the next
delivery.

The pipeline tests run on SQLite + local transport and PostgreSQL + RabbitMQ (``backend``):
the cancelled job's delivery must be acked on either broker. The store and HTTP tests run on
SQLite and PostgreSQL (``database_url``).
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import BaseModel
from sqlalchemy import func, select

import jobrelay
from jobrelay.admin.explain import next_step
from jobrelay.api import create_app
from jobrelay.domain.ids import follow_up_job_id
from jobrelay.domain.states import JobState
from jobrelay.errors import AttemptSuperseded
from jobrelay.library.operator import Operator
from jobrelay.maintenance.reconcile import LEASE_EXPIRED, Reconciler
from jobrelay.runtime.wiring import Runtime
from jobrelay.storage.store import Claim
from jobrelay.storage.tables import effects_ledger

from .api_fixtures import T0, bearer, build_runtime
from .ops_fixtures import LEASE, WORKER, eventually, job_in_state, kinds
from .test_cli_job_ids import cli, make_job, state_of
from .test_library import Delivery  # a delivery that records its ack or reject

pytestmark = pytest.mark.timeout(90)
S = JobState
APP = "tests.integration.test_cancel_running:app"


class Item(BaseModel):
    n: int


app = jobrelay.App()
started = threading.Event()
stopped: list[str] = []  # how each run ended, as the function saw it
gate: dict[str, asyncio.Event] = {}  # the test's loop: set to let ``cancel.gate`` return


@app.job("cancel.waits", params=Item)
async def waits(ctx: jobrelay.JobContext[Item], params: Item) -> jobrelay.Result:
    key = ctx.result_key("out.csv")
    async with ctx.writer(key) as w:  # staged: visible only with a committed success
        await w.write(b"partial\n")
    started.set()
    try:
        await asyncio.Event().wait()  # runs until it is stopped
    except asyncio.CancelledError:
        stopped.append("async cancelled")
        raise
    return jobrelay.Result(key=key)


@app.job("cancel.sync", params=Item)
def sync_waits(ctx: jobrelay.SyncJobContext[Item], params: Item) -> jobrelay.Result:
    started.set()
    ctx.cancelled.wait(30)
    stopped.append(f"def saw cancelled={ctx.cancelled.is_set()}")
    return jobrelay.Result(key="late")  # discarded: the run was cancelled


@app.job("cancel.after", params=Item)
async def after(ctx: jobrelay.JobContext[Item], params: Item) -> None:
    return None


@app.job("cancel.gate", params=Item)
async def gated(ctx: jobrelay.JobContext[Item], params: Item) -> jobrelay.Result:
    started.set()
    await gate["open"].wait()
    ctx.follow_up(after, Item(n=params.n))  # created only with a committed success
    return jobrelay.Result(key=ctx.result_key("done.csv"), meta={"n": params.n})


@pytest.fixture(autouse=True)
def _reset() -> None:
    started.clear()
    stopped.clear()
    gate["open"] = asyncio.Event()


async def enqueue(rt: Runtime, job: jobrelay.JobDefinition[Any], n: int = 1) -> str:
    async with rt.engine.begin() as conn:
        return await job.enqueue(conn, Item(n=n))


async def effect_rows(rt: Runtime, job_id: str) -> int:
    async with rt.engine.connect() as conn:
        count = await conn.scalar(
            select(func.count())
            .select_from(effects_ledger)
            .where(effects_ledger.c.job_id == job_id)
        )
    return int(count or 0)


def cancelled_event(events: list[Any]) -> dict[str, Any]:
    [event] = [e.detail for e in events if e.kind == "cancelled"]
    return dict(event)


# --- the pipeline: both brokers ---------------------------------------------------------------


@pytest.mark.parametrize("job", [waits, sync_waits], ids=["async", "def"])
async def test_a_running_job_is_stopped_and_ends_cancelled_with_the_reason(
    make_pipeline: Any, job: jobrelay.JobDefinition[Item]
) -> None:
    async with make_pipeline(app=APP) as p:
        p.start_relay()
        await p.start_worker()
        job_id = await enqueue(p.rt, job)
        assert await asyncio.to_thread(started.wait, 30)

        outcome = await Operator(p.rt).cancel(job_id, actor="ops:alice", reason="customer asked")

        assert outcome.done and outcome.requested and outcome.state is S.RUNNING
        ended = await p.wait_for(job_id, lambda j: j.state is S.CANCELLED)
        assert ended.result_key is None and ended.cancel_reason == "customer asked"
        assert ended.cancel_requested_by == "ops:alice" and ended.lease_owner is None
        events = await p.rt.store.events(job_id)
        timeline = [e.kind for e in events]
        assert timeline.index("cancel_requested") < timeline.index("cancelled")
        assert "result_saved" not in timeline and "retry_scheduled" not in timeline
        detail = cancelled_event(events)
        assert detail["reason"] == "customer asked" and detail["actor"] == "ops:alice"
        assert detail["previousState"] == "running" and detail["attempt"] == 1
        # Its delivery is acked (not redelivered, not quarantined): the broker is done with it.
        await eventually(
            lambda: _has(p.rt, job_id, "ack_sent"), what="the cancelled job's delivery acked"
        )
        if job is waits:
            assert stopped == ["async cancelled"]
            staged = waits.type + f"/{job_id}/out.csv"
            assert not await p.rt.results.exists(staged)  # its staged result was discarded
        else:
            await eventually(lambda: _async(bool(stopped)), what="the def job's thread to end")
            assert stopped == ["def saw cancelled=True"]
            job_now = await p.rt.store.get_job(job_id)
            assert job_now is not None and job_now.state is S.CANCELLED  # its return discarded
        assert await effect_rows(p.rt, job_id) == 0


async def _has(rt: Runtime, job_id: str, kind: str) -> bool:
    return kind in await kinds(rt, job_id)


async def _async(value: bool) -> bool:
    return value


async def test_a_run_finishing_after_the_request_cannot_succeed(make_pipeline: Any) -> None:
    """The worker has not learnt the request yet (a long cancel check) when its run returns:
    the fence refuses the success, its follow-up job and its staged result, and the worker
    ends the job cancelled instead."""
    async with make_pipeline(app=APP, cancel_check_seconds="300", lease_seconds="600") as p:
        p.start_relay()
        await p.start_worker()
        job_id = await enqueue(p.rt, gated, n=7)
        assert await asyncio.to_thread(started.wait, 30)
        asked = await p.rt.store.request_cancel(
            job_id, actor="ops:bob", reason="too late", now=p.rt.clock()
        )
        assert asked.requested and asked.first

        gate["open"].set()

        ended = await p.wait_for(job_id, lambda j: j.state is not S.RUNNING)
        assert ended.state is S.CANCELLED and ended.result_key is None
        assert cancelled_event(await p.rt.store.events(job_id))["reason"] == "too late"
        assert await p.rt.store.get_job(follow_up_job_id(job_id, after.type)) is None
        assert "result_saved" not in await kinds(p.rt, job_id)


async def test_a_job_that_finished_first_stays_succeeded(make_pipeline: Any) -> None:
    async with make_pipeline(app=APP) as p:
        p.start_relay()
        await p.start_worker()
        job_id = await enqueue(p.rt, gated, n=3)
        gate["open"].set()
        await p.wait_for(job_id, lambda j: j.state is S.SUCCEEDED)
        await eventually(lambda: _has(p.rt, job_id, "ack_sent"), what="the success acked")

        outcome = await Operator(p.rt).cancel(job_id, actor="ops", reason="too late")

        assert not outcome.done and not outcome.requested and outcome.state is S.SUCCEEDED
        job = await p.rt.store.get_job(job_id)
        assert job is not None and job.state is S.SUCCEEDED and job.cancel_requested_at is None
        assert not {"cancel_requested", "cancelled"} & set(await kinds(p.rt, job_id))


# --- the store, the reconciler, HTTP, the CLI: both databases ---------------------------------


@pytest.fixture
async def runtime(database_url: str, tmp_path: Path) -> AsyncIterator[Runtime]:
    rt = build_runtime(database_url, tmp_path)
    yield rt
    await rt.engine.dispose()


async def test_a_cancel_request_is_recorded_once_and_refuses_the_claims_outcomes(
    runtime: Runtime,
) -> None:
    store = runtime.store
    job_id = await job_in_state(store, S.RUNNING, T0)
    claim = Claim(job_id, 1, WORKER)

    first = await store.request_cancel(job_id, actor="a", reason="r", now=T0)
    again = await store.request_cancel(job_id, actor="b", reason="other", now=T0)

    assert first.requested and first.first and again.requested and not again.first
    assert (await kinds(runtime, job_id)).count("cancel_requested") == 1
    job = await store.get_job(job_id)
    assert job is not None and job.cancel_reason == "r" and job.cancel_requested_by == "a"
    assert next_step(job, T0).startswith("cancel requested by a 0 s ago (r): ")  # job show
    # Every outcome of the claim is refused; the lease renewal is not, and says so.
    assert not (await store.complete(claim, "k", {}, T0)).won
    assert await store.complete_many([_request(claim)], T0) == set()  # batched too
    assert not (await store.schedule_retry(claim, "report.export", "boom", 5, T0)).won
    assert not await store.quarantine(job_id, "bad", T0, claim=claim)
    renewed = await store.renew_leases([claim], LEASE, T0)
    assert renewed == {claim} and renewed.cancel_requested == {claim}
    with pytest.raises(AttemptSuperseded):  # no effect is started
        await store.effects.begin(job_id, "email", "m-1", T0, attempt=1, worker=WORKER)
    assert await effect_rows(runtime, job_id) == 0
    # A redelivery does not claim it again while its worker's lease is live.
    assert await store.claim_delivered(job_id, "report.export", "w-2", T0, LEASE) is None
    assert await store.end_cancelled(claim, T0)
    job = await store.get_job(job_id)
    assert job is not None and job.state is S.CANCELLED and job.result_key is None


def _request(claim: Claim) -> Any:
    from jobrelay.storage.store import CompleteRequest

    return CompleteRequest(claim, "k", {})


async def test_the_reconciler_ends_a_cancelled_job_whose_worker_died(runtime: Runtime) -> None:
    store = runtime.store
    job_id = await job_in_state(store, S.RUNNING, T0)
    assert (await Operator(runtime).cancel(job_id, actor="ops", reason="stuck")).requested
    runtime.clock.advance(LEASE.total_seconds() + runtime.settings.reconcile_grace_seconds + 1)

    report = await Reconciler(runtime).run_once(scan_quarantine=False)

    [finding] = [f for f in report.findings if f.kind == LEASE_EXPIRED]
    assert finding.repaired and "cancel requested by ops: cancelled" in finding.detail
    job = await store.get_job(job_id)
    assert job is not None and job.state is S.CANCELLED and job.attempt == 1
    detail = cancelled_event(await store.events(job_id))
    assert detail["reason"] == "stuck" and detail["leaseExpired"] is True


async def test_a_delivery_ends_a_cancelled_job_whose_lease_expired(runtime: Runtime) -> None:
    store = runtime.store
    job_id = await job_in_state(store, S.RUNNING, T0)
    assert (await Operator(runtime).cancel(job_id, actor="ops", reason="stuck")).requested
    live = Delivery(json.dumps({"jobId": job_id, "type": "report.export", "version": 1}).encode())
    from jobrelay.worker.consumer import Worker

    await Worker(runtime).handle(live)  # the lease is live: deferred, not ended, not run
    assert (await store.get_job(job_id)).state is S.RUNNING  # type: ignore[union-attr]
    runtime.clock.advance(LEASE.total_seconds() + 1)
    late = Delivery(live.body)

    await Worker(runtime).handle(late)

    assert late.outcomes == ["ack"]
    job = await store.get_job(job_id)
    assert job is not None and job.state is S.CANCELLED and job.attempt == 1  # not run again


async def test_cancel_over_http_answers_202_for_running_and_409_once_finished(
    runtime: Runtime,
) -> None:
    from jobrelay.api.auth import hash_token, new_token

    token = new_token()
    await runtime.store.add_token(hash_token(token), None, True, T0, "support")
    admin = bearer(token)
    running = await job_in_state(runtime.store, S.RUNNING, T0, "2020-01")
    done = await job_in_state(runtime.store, S.SUCCEEDED, T0, "2020-02")
    transport = httpx.ASGITransport(app=create_app(runtime.settings, runtime=runtime))
    async with httpx.AsyncClient(transport=transport, base_url="http://api.test") as client:
        asked = await client.post(
            f"/v1/jobs/{running}/cancel", json={"reason": "not wanted"}, headers=admin
        )
        refused = await client.post(f"/v1/jobs/{done}/cancel", json={"reason": "x"}, headers=admin)
        bulk = await client.post(
            "/v1/bulk/cancel",
            json={"filter": {"state": "running"}, "reason": "all of them"},
            headers=admin,
        )

    assert asked.status_code == 202, asked.text
    body = asked.json()
    assert body["cancelRequested"] is True and body["state"] == "running"
    assert refused.status_code == 409
    assert refused.headers["content-type"] == "application/problem+json"
    assert "already succeeded" in refused.json()["detail"]
    # The bulk cancel accepts running jobs; one already asked no longer matches.
    assert bulk.status_code == 200, bulk.text
    assert bulk.json()["matched"] == 0 and bulk.json()["remaining"] == 0


async def test_bulk_cancel_requests_the_cancel_of_running_jobs(runtime: Runtime) -> None:
    from jobrelay.api.auth import hash_token, new_token

    token = new_token()
    await runtime.store.add_token(hash_token(token), None, True, T0, "support")
    running = await job_in_state(runtime.store, S.RUNNING, T0, "2020-03")
    transport = httpx.ASGITransport(app=create_app(runtime.settings, runtime=runtime))
    async with httpx.AsyncClient(transport=transport, base_url="http://api.test") as client:
        answer = await client.post(
            "/v1/bulk/cancel",
            json={"filter": {"state": "running"}, "reason": "maintenance"},
            headers=bearer(token),
        )
    assert answer.status_code == 200, answer.text
    assert answer.json()["done"] == 1 and answer.json()["remaining"] == 0
    job = await runtime.store.get_job(running)
    assert job is not None and job.state is S.RUNNING and job.cancel_reason == "maintenance"


def test_cli_cancel_of_a_running_job_and_of_a_finished_one(
    database_url: str, tmp_path: Path
) -> None:
    running = make_job(database_url, S.RUNNING, "2020-04")
    done = make_job(database_url, S.SUCCEEDED, "2020-05")

    asked = cli(database_url, tmp_path, "job", "cancel", running, "--reason", "not wanted")
    refused = cli(database_url, tmp_path, "job", "cancel", done, "--reason", "not wanted")

    assert asked[0] == 0, asked
    assert f"cancel of running job {running} requested" in asked[1]
    assert refused[0] == 1, refused
    assert refused[2].strip().splitlines() == [
        f"jobrelay: error: job {done} already succeeded; nothing to cancel"
    ]
    assert state_of(database_url, running) == "running"


async def test_claims_after_the_request_are_refused_even_with_an_expired_lease(
    runtime: Runtime,
) -> None:
    """A second delivery never claims a job whose cancel was requested (it would run it)."""
    store = runtime.store
    job_id = await job_in_state(store, S.RUNNING, T0)
    assert (await store.request_cancel(job_id, actor="a", reason="r", now=T0)).requested
    later = runtime.clock.advance(LEASE.total_seconds() + 1)
    assert await store.claim_job(job_id, "w-2", later, LEASE) is None
    assert await store.claim_delivered(job_id, "report.export", "w-2", later, LEASE) is None
