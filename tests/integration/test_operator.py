"""Operator actions — replay, cancel, bulk replay, list — in the store, the pipeline and HTTP.

Store-level tests run on SQLite and PostgreSQL (``database_url``); the pipeline tests run on
SQLite + local transport and PostgreSQL + RabbitMQ (``backend``), because what happens to a
cancelled or replayed job's messages depends on the broker.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import select

from jobrelay.api import create_app
from jobrelay.domain.disclosure import FAILED
from jobrelay.domain.states import JobState
from jobrelay.library.operator import Operator
from jobrelay.runtime.wiring import Runtime
from jobrelay.storage.tables import outbox
from tests.integration.api_fixtures import MAX_ATTEMPTS, T0, bearer, build_runtime, make_token

from .ops_fixtures import (
    eventually,
    job_in_state,
    kinds,
)

pytestmark = pytest.mark.timeout(90)
S = JobState


@pytest.fixture
async def runtime(database_url: str, tmp_path: Path) -> AsyncIterator[Runtime]:
    rt = build_runtime(database_url, tmp_path)
    yield rt
    await rt.engine.dispose()


async def outbox_rows(rt: Runtime, job_id: str) -> list[Any]:
    async with rt.engine.connect() as conn:
        rows = await conn.execute(
            select(outbox.c.destination, outbox.c.published_at, outbox.c.headers)
            .where(outbox.c.job_id == job_id)
            .order_by(outbox.c.id)
        )
        return list(rows)


# --- replay ---------------------------------------------------------------------------------


async def test_replay_sends_a_quarantined_job_back_with_a_fresh_budget(runtime: Runtime) -> None:
    store = runtime.store
    job_id = await job_in_state(store, S.QUARANTINED, T0)
    async with runtime.engine.begin() as conn:  # its first message went out long ago
        await conn.execute(outbox.update().values(published_at=T0))

    outcome = await Operator(runtime).replay(job_id, actor="cli:alice@ops", reason="fixed data")

    assert outcome.done and outcome.previous_state is S.QUARANTINED and outcome.state is S.QUEUED
    job = await store.get_job(job_id)
    assert job.state is S.QUEUED and job.attempt == 1
    assert job.max_attempts == 1 + MAX_ATTEMPTS  # attempts keep counting; a fresh budget on top
    assert job.quarantine_reason is None and not job.published
    replayed = (await store.events(job_id))[-1]
    assert replayed.kind == "replayed"
    assert replayed.detail == {
        "actor": "cli:alice@ops",
        "reason": "fixed data",
        "previousReason": "invalid period 2020-13",
        "attempt": 1,
        "maxAttempts": 1 + MAX_ATTEMPTS,
    }
    rows = await outbox_rows(runtime, job_id)
    assert [(r.destination, r.published_at is None) for r in rows] == [
        ("work", False),
        ("work", True),
    ]
    assert runtime.metrics.operator_actions.labels(action="replay")._value.get() == 1


@pytest.mark.parametrize("state", [S.QUEUED, S.RUNNING, S.RETRY_WAIT, S.SUCCEEDED, S.CANCELLED])
async def test_replay_refuses_every_state_but_quarantined(runtime: Runtime, state: S) -> None:
    job_id = await job_in_state(runtime.store, state, T0)
    before = (await kinds(runtime, job_id), await outbox_rows(runtime, job_id))

    outcome = await Operator(runtime).replay(job_id, actor="cli:alice@ops", reason="oops")

    assert not outcome.done and outcome.state is state
    assert (await runtime.store.get_job(job_id)).state is state
    assert (await kinds(runtime, job_id), await outbox_rows(runtime, job_id)) == before


async def test_actions_on_an_unknown_job_say_so(runtime: Runtime) -> None:
    missing = "00000000-0000-0000-0000-000000000000"
    operator = Operator(runtime)
    assert (await operator.replay(missing, actor="a", reason="r")).state is None
    assert (await operator.cancel(missing, actor="a", reason="r")).state is None


# --- cancel ---------------------------------------------------------------------------------


@pytest.mark.parametrize("state", [S.QUEUED, S.RETRY_WAIT, S.QUARANTINED])
async def test_cancel_from_an_allowed_state(runtime: Runtime, state: S) -> None:
    job_id = await job_in_state(runtime.store, state, T0)

    outcome = await Operator(runtime).cancel(job_id, actor="token#1 (support)", reason="dup")

    assert outcome.done and outcome.previous_state is state
    job = await runtime.store.get_job(job_id)
    assert job.state is S.CANCELLED and job.next_attempt_at is None
    last = (await runtime.store.events(job_id))[-1]
    assert (last.kind, last.detail) == (
        "cancelled",
        {"actor": "token#1 (support)", "reason": "dup", "previousState": state.value},
    )


@pytest.mark.parametrize("state", [S.SUCCEEDED, S.CANCELLED])
async def test_cancel_never_touches_a_finished_job(runtime: Runtime, state: S) -> None:
    job_id = await job_in_state(runtime.store, state, T0)
    before = await kinds(runtime, job_id)

    outcome = await Operator(runtime).cancel(job_id, actor="a", reason="r")

    assert not outcome.done and outcome.state is state
    assert (await runtime.store.get_job(job_id)).state is state
    assert await kinds(runtime, job_id) == before


# --- bulk replay and listing ------------------------------------------------------------------


async def test_bulk_replay_selects_by_reason_and_dry_run_changes_nothing(runtime: Runtime) -> None:
    store = runtime.store
    bad_period = await job_in_state(store, S.QUARANTINED, T0, "2020-01")
    other = await job_in_state(store, S.QUARANTINED, T0, "2020-02")
    async with runtime.engine.begin() as conn:  # a different reason for the second one
        from jobrelay.storage.tables import jobs

        await conn.execute(
            jobs.update().where(jobs.c.id == other).values(quarantine_reason="Disk 100% full")
        )
    untouched = await job_in_state(store, S.QUEUED, T0, "2020-03")
    operator = Operator(runtime)

    dry = await operator.bulk_replay(
        actor="a", reason_filter="INVALID PERIOD", job_type="report.export", dry_run=True
    )
    assert [j.id for j in dry.matched] == [bad_period] and dry.replayed == []
    assert (await store.get_job(bad_period)).state is S.QUARANTINED

    # LIKE wildcards in the filter are literal text, not patterns.
    percent = await operator.bulk_replay(actor="a", reason_filter="100%", job_type=None)
    assert percent.replayed == [other]
    assert (await operator.bulk_replay(actor="a", reason_filter="%", job_type=None)).matched == []

    done = await operator.bulk_replay(actor="bulk-op", reason_filter="invalid", job_type=None)
    assert done.replayed == [bad_period]
    assert (await store.get_job(bad_period)).state is S.QUEUED
    assert (await store.get_job(untouched)).state is S.QUEUED
    detail = (await store.events(bad_period))[-1].detail
    assert detail["actor"] == "bulk-op" and "'invalid'" in detail["reason"]


# --- through the pipeline ---------------------------------------------------------------------


async def test_cancelled_job_is_acked_without_work(make_pipeline: Any, tmp_path: Path) -> None:
    async with make_pipeline() as p:
        job_id = await p.submit()
        assert (await Operator(p.rt).cancel(job_id, actor="a", reason="not wanted")).done
        p.start_relay()
        await p.start_worker()

        async def acked() -> bool:
            return "duplicate_acked" in await kinds(p.rt, job_id)

        await eventually(acked, what="the delivery of the cancelled job to be acked")
        job = await p.store.get_job(job_id)
        assert job.state is S.CANCELLED and job.attempt == 0 and job.result_key is None
        assert "claimed" not in await kinds(p.rt, job_id)
        assert not (tmp_path / "exports").exists() or not any((tmp_path / "exports").rglob("*.csv"))
        assert await p.rt.transport.quarantine_depth() == 0


async def test_replayed_job_runs_to_success_once(make_pipeline: Any) -> None:
    async with make_pipeline(faults="export.run:invalid:1") as p:
        job_id = await p.submit()
        p.start_relay()
        await p.start_worker()
        await p.wait_for(job_id, lambda j: j.state is S.QUARANTINED)

        assert (await Operator(p.rt).replay(job_id, actor="a", reason="bug fixed")).done

        job = await p.wait_for(job_id, lambda j: j.state is S.SUCCEEDED)
        assert job.attempt == 2  # attempt 1 was the invalid one; the fault fires only there
        history = await kinds(p.rt, job_id)
        assert history.count("result_saved") == 1 and history.count("claimed") == 2
        assert (
            history.index("quarantined") < history.index("replayed") < history.index("result_saved")
        )
        assert p.rt.metrics.transitions.labels("quarantined", "queued")._value.get() == 1


# --- HTTP -------------------------------------------------------------------------------------


@pytest.fixture
async def client(runtime: Runtime) -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(runtime.settings, runtime=runtime)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://api.test") as c:
        yield c


async def admin_headers(runtime: Runtime, label: str = "support-alice") -> dict[str, str]:
    from jobrelay.api.auth import hash_token, new_token

    token = new_token()
    await runtime.store.add_token(hash_token(token), None, True, T0, label)
    return bearer(token)


async def test_account_tokens_get_403_on_every_admin_endpoint(
    client: httpx.AsyncClient, runtime: Runtime
) -> None:
    acme = bearer(await make_token(runtime, "acme"))
    job_id = await job_in_state(runtime.store, S.QUARANTINED, T0)  # acme's own job
    for method, path, body in [
        ("POST", f"/v1/jobs/{job_id}/replay", {}),
        ("POST", f"/v1/jobs/{job_id}/cancel", {"reason": "x"}),
        ("GET", "/v1/jobs?state=quarantined&accountId=other", None),  # not its account
        ("POST", "/v1/bulk/replay", {"reason": "x"}),
        ("POST", "/v1/bulk/cancel", {"reason": "x"}),
        ("GET", "/v1/overview", None),
    ]:
        response = await client.request(method, path, json=body, headers=acme)
        assert response.status_code == 403, (path, response.text)
        assert response.headers["content-type"] == "application/problem+json"
    assert (await client.post(f"/v1/jobs/{job_id}/replay")).status_code == 401
    assert (await runtime.store.get_job(job_id)).state is S.QUARANTINED


async def test_admin_replays_cancels_and_lists_over_http(
    client: httpx.AsyncClient, runtime: Runtime
) -> None:
    admin = await admin_headers(runtime)
    quarantined = await job_in_state(runtime.store, S.QUARANTINED, T0, "2020-01")
    queued = await job_in_state(runtime.store, S.QUEUED, T0, "2020-02")

    listed = await client.get("/v1/jobs?state=quarantined&reason=PERIOD", headers=admin)
    assert listed.status_code == 200
    [item] = listed.json()["jobs"]
    assert item["jobId"] == quarantined and item["quarantineReason"] == "invalid period 2020-13"

    replayed = await client.post(
        f"/v1/jobs/{quarantined}/replay", json={"reason": "fixed"}, headers=admin
    )
    assert replayed.status_code == 200, replayed.text
    assert replayed.json() == {
        "jobId": quarantined,
        "action": "replay",
        "state": "queued",
        "previousState": "quarantined",
        "actor": replayed.json()["actor"],
        "cancelRequested": False,
    }
    actor = replayed.json()["actor"]
    assert actor.startswith("token#") and "support-alice" in actor and "jr_" not in actor
    assert (await runtime.store.events(quarantined))[-1].detail["actor"] == actor

    again = await client.post(f"/v1/jobs/{quarantined}/replay", headers=admin)
    problem = again.json()
    assert again.status_code == 409 and problem["state"] == "queued"
    assert problem["type"] == "urn:jobrelay:problem:invalid-transition"

    for bad in ({}, {"reason": "   "}, {"reason": "x", "force": True}):
        response = await client.post(f"/v1/jobs/{queued}/cancel", json=bad, headers=admin)
        assert response.status_code == 422, bad
    cancelled = await client.post(
        f"/v1/jobs/{queued}/cancel", json={"reason": "dup"}, headers=admin
    )
    assert cancelled.status_code == 200 and cancelled.json()["state"] == "cancelled"
    assert (await runtime.store.get_job(queued)).state is S.CANCELLED

    missing = "00000000-0000-0000-0000-000000000000"
    assert (await client.post(f"/v1/jobs/{missing}/replay", headers=admin)).status_code == 404
    assert (await client.post("/v1/jobs/not-a-uuid/replay", headers=admin)).status_code == 404
    assert (await client.get("/v1/jobs?state=sleeping", headers=admin)).status_code == 422
    everything = (await client.get("/v1/jobs", headers=admin)).json()["jobs"]
    assert {j["jobId"] for j in everything} == {quarantined, queued}


async def test_explain_and_whoami_follow_the_read_rules(
    client: httpx.AsyncClient, runtime: Runtime
) -> None:
    acme = bearer(await make_token(runtime, "acme"))
    other = bearer(await make_token(runtime, "other"))
    job_id = await job_in_state(runtime.store, S.RETRY_WAIT, T0)

    explained = await client.get(f"/v1/jobs/{job_id}/explain", headers=acme)
    assert explained.status_code == 200
    body = explained.json()
    assert body["state"] == "retry_wait" and body["attempts"][0]["outcome"] == "retry"
    # The raw error ("boom") is the operators': the account reads the public fallback.
    assert body["attempts"][0]["error"] == FAILED
    # The account's next step is the customer's; the operator's names the outbox (and hosts).
    assert body["nextStep"] == f"waiting to retry (in 5 s), attempt 1 of 3 used after: {FAILED}"
    assert [e["kind"] for e in body["events"]][:2] == ["accepted", "claimed"]
    assert (await client.get(f"/v1/jobs/{job_id}/explain", headers=other)).status_code == 404

    assert (await client.get("/v1/whoami", headers=acme)).json() == {
        "accountId": "acme",
        "admin": False,
    }
    admin = await admin_headers(runtime)
    operator_view = (await client.get(f"/v1/jobs/{job_id}/explain", headers=admin)).json()
    assert operator_view["nextStep"].startswith(
        "retry scheduled 0 s ago, outbox row not yet published"
    )
    assert operator_view["attempts"][0]["worker"] == "host-w:1:abcdef"
    assert (await client.get("/v1/whoami", headers=admin)).json()["admin"] is True


async def test_replay_grants_the_job_types_own_max_attempts(runtime: Runtime) -> None:
    import dataclasses

    from pydantic import BaseModel

    import jobrelay

    class Sync(BaseModel):
        shop: str

    app = jobrelay.App()

    @app.job("shop.sync", params=Sync, max_attempts=MAX_ATTEMPTS + 4)
    async def sync(ctx: jobrelay.JobContext[Sync], params: Sync) -> None:
        return None

    rt = dataclasses.replace(runtime, app=app)
    async with rt.engine.begin() as conn:
        job_id = await sync.enqueue(conn, {"shop": "acme"})
    assert await rt.store.quarantine(job_id, "operator test", rt.clock())
    outcome = await Operator(rt).replay(job_id, actor="cli:alice@ops", reason="fixed")
    assert outcome.done
    job = await rt.store.get_job(job_id)
    assert job is not None and job.max_attempts == job.attempt + MAX_ATTEMPTS + 4
    # A type this app does not define (an old job of a removed type) gets the global budget.
    other = await job_in_state(rt.store, S.QUARANTINED, T0)
    assert Operator(rt).attempt_budget("report.gone") == MAX_ATTEMPTS
    assert (await Operator(runtime).replay(other, actor="a", reason="r")).done


async def test_explain_names_a_paused_queue_to_operators_only(
    client: httpx.AsyncClient, runtime: Runtime
) -> None:
    from jobrelay.storage.queue_pauses import set_paused

    job_id = await job_in_state(runtime.store, S.QUEUED, T0)
    await set_paused(runtime.store, "default", True, actor="alice", reason="deploy 42", now=T0)
    admin = await admin_headers(runtime)
    body = (await client.get(f"/v1/jobs/{job_id}/explain", headers=admin)).json()
    assert body["queue"] == "default"
    assert body["queuePause"] == {"since": T0.isoformat(), "by": "alice", "reason": "deploy 42"}
    assert body["nextStep"].startswith(
        f"queue default is paused since {T0.isoformat(timespec='seconds')}"
    )
    assert "by alice: deploy 42" in body["nextStep"]
    # An account reads its own job's story, not the operator's name or notes.
    acme = bearer(await make_token(runtime, "acme"))
    account = (await client.get(f"/v1/jobs/{job_id}/explain", headers=acme)).json()
    assert "queuePause" not in account and "alice" not in str(account)


async def test_admin_resends_a_stuck_queued_job_over_http(
    client: httpx.AsyncClient, runtime: Runtime
) -> None:
    # Issue 21, item 4: the console's "Re-send message" on a queued job whose message was lost.
    admin = await admin_headers(runtime)
    acme = bearer(await make_token(runtime, "acme"))
    queued = await job_in_state(runtime.store, S.QUEUED, T0, "2020-03")
    done = await job_in_state(runtime.store, S.SUCCEEDED, T0, "2020-04")
    path = f"/v1/jobs/{queued}/resend"
    assert (await client.post(path, json={"reason": "x"}, headers=acme)).status_code == 403
    assert (await client.post(path, json={}, headers=admin)).status_code == 422
    sent = await client.post(path, json={"reason": "dead-lettered"}, headers=admin)
    assert sent.status_code == 200, sent.text
    assert (sent.json()["state"], sent.json()["previousState"]) == ("queued", "queued")
    last = (await runtime.store.events(queued))[-1]
    assert last.kind == "resent" and last.detail["reason"] == "dead-lettered"
    assert "support-alice" in last.detail["actor"]
    refused = await client.post(f"/v1/jobs/{done}/resend", json={"reason": "x"}, headers=admin)
    assert refused.status_code == 409 and refused.json()["state"] == "succeeded"
    assert refused.headers["content-type"] == "application/problem+json"
