"""The dashboard's API: the jobs list's filters and keyset pages, the bulk actions and the
overview, over HTTP on SQLite and PostgreSQL (``database_url``) with the local transport."""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import AsyncIterator
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import insert, update

from jobrelay.domain.states import JobState
from jobrelay.runtime.wiring import Runtime
from jobrelay.storage.heartbeats import ProcessBeat, beat, seen_since
from jobrelay.storage.queue_pauses import paused_queues, queue_history
from jobrelay.storage.tables import job_events, jobs
from jobrelay.transport.base import OutgoingMessage
from tests.integration.api_fixtures import T0, api_client, bearer, build_runtime, make_token

from .ops_fixtures import WORKER, job_in_state, new_job

pytestmark = pytest.mark.timeout(90)
S = JobState


@pytest.fixture
async def runtime(database_url: str, tmp_path: Path) -> AsyncIterator[Runtime]:
    rt = build_runtime(database_url, tmp_path, local_transport=True)
    await rt.transport.connect()
    yield rt
    await rt.transport.close()
    await rt.engine.dispose()


@pytest.fixture
async def client(runtime: Runtime) -> AsyncIterator[httpx.AsyncClient]:
    async with api_client(runtime) as c:
        yield c


@pytest.fixture
async def admin(runtime: Runtime) -> dict[str, str]:
    return bearer(await make_token(runtime, None, admin=True))


async def quarantined_for(runtime: Runtime, period: str, reason: str, account: str) -> str:
    store = runtime.store
    job_id, _ = await store.submit(await new_job(store, period, account=account), T0)
    claim = await store.claim_job(job_id, WORKER, T0, timedelta(seconds=30))
    assert claim is not None
    assert await store.quarantine(job_id, reason, T0, claim=claim)
    return job_id


async def listed(client: httpx.AsyncClient, headers: dict[str, str], query: str) -> list[str]:
    response = await client.get("/v1/jobs?" + query, headers=headers)
    assert response.status_code == 200, response.text
    return [j["jobId"] for j in response.json()["jobs"]]


async def test_filters_narrow_the_list_and_pages_cover_it_once(
    client: httpx.AsyncClient, runtime: Runtime, admin: dict[str, str]
) -> None:
    store = runtime.store
    ids = {}
    for i, (state, account) in enumerate(
        [(S.QUEUED, "acme"), (S.QUARANTINED, "acme"), (S.SUCCEEDED, "globex"), (S.QUEUED, "acme")]
    ):
        at = T0 + timedelta(minutes=i)
        ids[i] = await job_in_state(store, state, at, f"2020-0{i + 1}", account=account)
    assert await listed(client, admin, "") == [ids[3], ids[2], ids[1], ids[0]]
    assert await listed(client, admin, "state=queued") == [ids[3], ids[0]]
    assert await listed(client, admin, "accountId=globex") == [ids[2]]
    assert await listed(client, admin, "reason=PERIOD+2020-13") == [ids[1]]
    assert await listed(client, admin, "type=report.export&queue=default&state=succeeded") == [
        ids[2]
    ]
    assert await listed(client, admin, "queue=bulk") == []
    window = "createdAfter=2026-01-01T12:01:00Z&createdBefore=2026-01-01T12:03:00%2B00:00"
    assert await listed(client, admin, window) == [ids[2], ids[1]]
    empty = "createdAfter=2026-01-02T00:00:00Z&createdBefore=2026-01-01T00:00:00Z"
    assert await listed(client, admin, empty) == []

    seen: list[str] = []
    cursor = ""
    for _ in range(5):
        page = (await client.get(f"/v1/jobs?limit=3{cursor}", headers=admin)).json()
        seen += [j["jobId"] for j in page["jobs"]]
        if page["nextCursor"] is None:
            break
        cursor = "&cursor=" + page["nextCursor"]
    assert seen == [ids[3], ids[2], ids[1], ids[0]]

    for query, field in [
        ("cursor=bm90LWEtY3Vyc29y", "cursor"),
        ("createdAfter=2026-01-01T12:00:00", "createdAfter"),
        ("accountId=Not+An+Account", "accountId"),
        ("state=sleeping", "state"),
    ]:
        bad = await client.get("/v1/jobs?" + query, headers=admin)
        assert bad.status_code == 422, query
        assert bad.headers["content-type"] == "application/problem+json"
        assert [e["field"] for e in bad.json()["errors"]] == [field], query


async def test_an_account_token_lists_only_its_own_jobs_in_the_account_view(
    client: httpx.AsyncClient, runtime: Runtime
) -> None:
    store = runtime.store
    mine = await quarantined_for(runtime, "2020-01", "db at 10.1.2.3:5432 refused", "acme")
    await job_in_state(store, S.RUNNING, T0, "2020-02", account="globex")
    acme = bearer(await make_token(runtime, "acme"))
    response = await client.get("/v1/jobs", headers=acme)
    [job] = response.json()["jobs"]
    assert job["jobId"] == mine and job["accountId"] == "acme"
    assert "10.1.2.3" not in response.text and "leaseOwner" not in job
    assert await listed(client, acme, "accountId=acme") == [mine]
    other = await client.get("/v1/jobs?accountId=globex", headers=acme)
    assert other.status_code == 403
    assert (await client.get("/v1/overview", headers=acme)).status_code == 403


async def test_bulk_replay_by_reason_counts_first_then_works_in_batches(
    client: httpx.AsyncClient, runtime: Runtime, admin: dict[str, str]
) -> None:
    store = runtime.store
    broken = [
        await quarantined_for(runtime, f"2020-0{i}", f"upstream TIMEOUT #{i}", "acme")
        for i in (1, 2, 3)
    ]
    other = await quarantined_for(runtime, "2020-04", "invalid period", "acme")
    body: dict[str, Any] = {"filter": {"reason": "timeout"}, "reason": "upstream fixed"}

    for bad, field in [
        ({"filter": {"reason": "timeout"}}, "reason"),
        ({**body, "reason": "  "}, "reason"),
        ({**body, "filter": {"state": "succeeded"}}, "filter.state"),
        ({**body, "limit": 0}, "limit"),
        ({**body, "filter": {"colour": "red"}}, "filter.colour"),
    ]:
        refused = await client.post("/v1/bulk/replay", json=bad, headers=admin)
        assert refused.status_code == 422, bad
        assert field in [e["field"] for e in refused.json()["errors"]], refused.text

    dry = await client.post("/v1/bulk/replay", json={**body, "dryRun": True}, headers=admin)
    assert dry.json()["matched"] == 3 and dry.json()["done"] == 0
    assert {(await store.get_job(j)).state for j in broken} == {S.QUARANTINED}

    first = (await client.post("/v1/bulk/replay", json={**body, "limit": 2}, headers=admin)).json()
    assert (first["matched"], first["done"], first["refused"], first["remaining"]) == (3, 2, 0, 1)
    second = (await client.post("/v1/bulk/replay", json={**body, "limit": 2}, headers=admin)).json()
    assert (second["done"], second["remaining"]) == (1, 0)
    assert sorted(first["jobIds"] + second["jobIds"]) == sorted(broken)
    for job_id in broken:
        assert (await store.get_job(job_id)).state is S.QUEUED
        [event] = [e for e in await store.events(job_id) if e.kind == "replayed"]
        assert event.detail["actor"] == first["actor"]
        assert event.detail["reason"] == "upstream fixed"
        assert first["actor"].startswith("token#")
    assert (await store.get_job(other)).state is S.QUARANTINED

    cancel = {"filter": {"accountId": "acme", "state": "queued"}, "reason": "duplicates"}
    cancelled = (await client.post("/v1/bulk/cancel", json=cancel, headers=admin)).json()
    assert (cancelled["done"], cancelled["remaining"]) == (3, 0)
    assert {(await store.get_job(j)).state for j in broken} == {S.CANCELLED}
    assert (await store.get_job(other)).state is S.QUARANTINED


async def test_the_overview_counts_states_throughput_backlog_and_queues(
    client: httpx.AsyncClient, runtime: Runtime, admin: dict[str, str]
) -> None:
    store = runtime.store
    now = runtime.clock()
    await job_in_state(store, S.QUEUED, now, "2020-01")
    await job_in_state(store, S.SUCCEEDED, now, "2020-02", account="globex")
    old = await job_in_state(store, S.QUARANTINED, now, "2020-03")
    async with runtime.engine.begin() as conn:  # an event before the hour is not counted
        at = now - timedelta(minutes=61)
        await conn.execute(insert(job_events).values(job_id=old, at=at, kind="accepted", detail={}))
    await runtime.transport.publish(OutgoingMessage("work", b"{}"))
    response = await client.get("/v1/overview", headers=admin)
    assert response.status_code == 200, response.text
    view = response.json()
    assert view["counts"]["byState"] == {"queued": 1, "succeeded": 1, "quarantined": 1}
    assert view["counts"]["byType"] == {"report.export": 3}
    assert view["counts"]["byQueue"] == {"default": 3} and view["counts"]["total"] == 3
    flow = view["throughput"]
    assert len(flow["minutes"]) == 60 and len(flow["accepted"]) == 60
    assert (sum(flow["accepted"]), sum(flow["succeeded"]), sum(flow["quarantined"])) == (3, 1, 1)
    assert view["outbox"]["backlog"] == 3 and view["outbox"]["oldestAgeSeconds"] >= 0
    assert view["outbox"]["lagSampled"] == 0 and view["outbox"]["lagMaxSeconds"] is None
    assert view["processes"] == []  # no worker or relay ran
    [default] = [q for q in view["queues"] if q["queue"] == "default"]
    assert default == {
        "queue": "default",
        "ready": 1,
        "consumers": 0,  # local transport: workers with a recent heartbeat (none ran)
        "inFlight": 0,
        "paused": False,
        "pausedAt": None,
        "pausedBy": None,
        "pausedReason": None,
    }


async def test_queues_pause_and_resume_over_http_audited(
    client: httpx.AsyncClient, runtime: Runtime, admin: dict[str, str]
) -> None:
    queues = (await client.get("/v1/queues", headers=admin)).json()["queues"]
    assert [q["queue"] for q in queues] == list(runtime.topology.queues)
    assert not any(q["paused"] for q in queues)

    for path, body, status in [
        ("/v1/queues/default/pause", {}, 422),
        ("/v1/queues/default/pause", {"reason": " "}, 422),
        ("/v1/queues/nope/pause", {"reason": "x"}, 404),
    ]:
        response = await client.post(path, json=body, headers=admin)
        assert response.status_code == status, (path, body, response.text)
        assert response.headers["content-type"] == "application/problem+json"
    assert await paused_queues(runtime.store) == set()

    paused = await client.post("/v1/queues/default/pause", json={"reason": "deploy"}, headers=admin)
    assert paused.status_code == 200, paused.text
    row = paused.json()
    assert row["paused"] and row["pausedReason"] == "deploy"
    assert row["pausedBy"].startswith("token#")
    assert await paused_queues(runtime.store) == {"default"}
    again = await client.post("/v1/queues/default/pause", json={"reason": "x"}, headers=admin)
    assert again.status_code == 409
    view = (await client.get("/v1/overview", headers=admin)).json()
    assert [q["paused"] for q in view["queues"] if q["queue"] == "default"] == [True]

    resumed = await client.post("/v1/queues/default/resume", json={"reason": "ok"}, headers=admin)
    assert resumed.status_code == 200 and not resumed.json()["paused"]
    assert await paused_queues(runtime.store) == set()
    history = await queue_history(runtime.store, "default")
    assert [(e.kind, e.actor, e.reason) for e in history] == [
        ("resumed", row["pausedBy"], "ok"),
        ("paused", row["pausedBy"], "deploy"),
    ]
    acme = bearer(await make_token(runtime, "acme"))
    for method, path in [("GET", "/v1/queues"), ("POST", "/v1/queues/default/pause")]:
        response = await client.request(method, path, json={"reason": "x"}, headers=acme)
        assert response.status_code == 403


async def test_a_job_on_no_account_lists_with_a_null_account(
    client: httpx.AsyncClient, runtime: Runtime, admin: dict[str, str]
) -> None:
    job = dataclasses.replace(
        await new_job(runtime.store, "2020-09"), account_id=None, job_id=str(uuid.uuid4())
    )
    job_id, _ = await runtime.store.submit(job, T0)
    response = await client.get("/v1/jobs", headers=admin)
    assert response.status_code == 200, response.text
    assert [(j["jobId"], j["accountId"]) for j in response.json()["jobs"]] == [(job_id, None)]


async def test_the_overview_lists_processes_seen_lately_and_beats_prune_old_ones(
    client: httpx.AsyncClient, runtime: Runtime, admin: dict[str, str]
) -> None:
    now = runtime.clock()
    started = now - timedelta(minutes=30)

    def process(name: str, role: str, queues: tuple[str, ...] = ()) -> ProcessBeat:
        return ProcessBeat(name, role, "host-a", 41, queues, started, started)

    await beat(runtime.store, process("gone", "worker"), now - timedelta(hours=2))
    await beat(runtime.store, process("quiet", "relay"), now - timedelta(minutes=10))
    await beat(runtime.store, process("w1", "worker", ("default",)), now - timedelta(minutes=1))
    await beat(runtime.store, process("w1", "worker", ("default",)), now)  # the same row again
    await beat(runtime.store, process("r1", "relay"), now)
    view = (await client.get("/v1/overview", headers=admin)).json()
    assert sorted((p["id"], p["role"], p["queues"]) for p in view["processes"]) == [
        ("r1", "relay", []),
        ("w1", "worker", ["default"]),
    ]
    [w1] = [p for p in view["processes"] if p["id"] == "w1"]
    assert w1["host"] == "host-a" and w1["pid"] == 41
    assert datetime.fromisoformat(w1["lastSeenAt"]) == now
    assert datetime.fromisoformat(w1["startedAt"]) == started
    older = await seen_since(runtime.store, now - timedelta(days=1))
    assert {p.id for p in older} == {"w1", "r1", "quiet"}  # "gone" was pruned by a beat
    # On the local transport a queue's consumers are its workers with a recent heartbeat.
    [default] = [q for q in view["queues"] if q["queue"] == "default"]
    assert default["consumers"] == 1


async def test_the_overview_marks_a_process_gone_after_three_missed_heartbeats(
    client: httpx.AsyncClient, runtime: Runtime, admin: dict[str, str]
) -> None:
    now = runtime.clock()
    interval = timedelta(seconds=runtime.settings.heartbeat_seconds)
    for name, seen in [
        ("w-now", now),
        ("w-late", now - 2.5 * interval),  # two missed beats: late, not gone
        ("w-gone", now - 3.5 * interval),
        ("r-gone", now - timedelta(minutes=4)),  # still listed, so an operator sees it went
    ]:
        started = seen - timedelta(minutes=1)
        role = "worker" if name.startswith("w") else "relay"
        queues = ("default",) if role == "worker" else ()
        process = ProcessBeat(name, role, "h", 7, queues, started, started)
        await beat(runtime.store, process, seen)
    view = (await client.get("/v1/overview", headers=admin)).json()
    assert [(p["id"], p["status"]) for p in view["processes"]] == [
        ("w-now", "alive"),
        ("w-late", "alive"),
        ("w-gone", "gone"),
        ("r-gone", "gone"),
    ]
    gone = next(p for p in view["processes"] if p["id"] == "w-gone")
    assert datetime.fromisoformat(gone["lastSeenAt"]) == now - 3.5 * interval
    # The local transport's consumers are the live workers of the queue, by the same rule.
    [default] = [q for q in view["queues"] if q["queue"] == "default"]
    assert default["consumers"] == 2


async def test_the_jobs_list_carries_params_and_a_retry_waits_next_attempt(
    client: httpx.AsyncClient, runtime: Runtime, admin: dict[str, str]
) -> None:
    now = runtime.clock()
    waiting = await job_in_state(runtime.store, S.RETRY_WAIT, now, "2020-04")
    queued = await job_in_state(runtime.store, S.QUEUED, now, "2020-05")
    acme = bearer(await make_token(runtime, "acme"))
    for headers in (admin, acme):  # params are the account's own: both views carry them
        response = await client.get("/v1/jobs", headers=headers)
        assert response.status_code == 200, response.text
        rows = {j["jobId"]: j for j in response.json()["jobs"]}
        assert rows[waiting]["params"] == {"accountId": "acme", "period": "2020-04"}
        assert rows[waiting]["state"] == "retry_wait"
        assert datetime.fromisoformat(rows[waiting]["nextAttemptAt"]) == now + timedelta(seconds=5)
        assert rows[queued]["nextAttemptAt"] is None


async def test_the_overview_shows_the_reconcilers_findings_without_repairing(
    client: httpx.AsyncClient, runtime: Runtime, admin: dict[str, str]
) -> None:
    stuck = await job_in_state(runtime.store, S.RUNNING, T0)
    async with runtime.engine.begin() as conn:  # its worker died: the lease ran out long ago
        expired = T0 - timedelta(hours=1)
        await conn.execute(update(jobs).values(lease_expires_at=expired).where(jobs.c.id == stuck))
    view = (await client.get("/v1/overview", headers=admin)).json()
    assert view["reconciler"]["counts"]["lease_expired"] == 1, view["reconciler"]
    [finding] = [f for f in view["reconciler"]["findings"] if f["kind"] == "lease_expired"]
    assert finding["jobId"] == stuck
    assert (await runtime.store.get_job(stuck)).state is S.RUNNING  # a look, not a repair
    assert "reconciled_lease_expired" not in [e.kind for e in await runtime.store.events(stuck)]
