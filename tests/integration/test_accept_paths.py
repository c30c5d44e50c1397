"""``POST /v1/jobs`` and the application routes (``POST /v1/exports``, on ``AcceptDep``)
accept a job the same way (issue 35): the ``new -> queued`` transition is counted once per
new job, the ``api.before_response`` fault point follows the commit, and a repeat of a
request is logged as a repeat, not as a new job; ``max_attempts`` is the serving
runtime's (``/v1/jobs`` took the app's own ``Settings``). Each check runs on both routes, on SQLite
and PostgreSQL, so the two cannot drift apart again unnoticed.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, NoReturn

import httpx
import pytest
from pydantic import BaseModel

import jobrelay
from jobrelay.observe.faults import Faults
from jobrelay.runtime.wiring import Runtime

from .api_fixtures import MAX_ATTEMPTS, api_client, bearer, build_runtime, make_token
from .test_metrics import samples, value

pytestmark = pytest.mark.timeout(90)

app = jobrelay.App()


class Ping(BaseModel):
    n: int


@app.job("accept.ping", params=Ping, http=True)
async def ping(ctx: jobrelay.JobContext[Ping], params: Ping) -> None:
    return None


# Each route with a body that asks for one job, and a runtime that serves that route.
ROUTES: dict[str, tuple[str, dict[str, Any], jobrelay.App | None]] = {
    "exports": ("/v1/exports", {"accountId": "acme", "period": "2020-05"}, None),
    "jobs": ("/v1/jobs", {"type": "accept.ping", "params": {"n": 1}, "key": "k-1"}, app),
}


class Crash(Exception):
    pass


def crash(point: str) -> NoReturn:
    raise Crash(point)


@dataclasses.dataclass
class Route:
    rt: Runtime
    path: str
    body: dict[str, Any]
    headers: dict[str, str]


@pytest.fixture(params=sorted(ROUTES))
async def route(request: pytest.FixtureRequest, database_url: str, tmp_path: Path) -> Any:
    @dataclasses.dataclass
    class Factory:
        made: list[Runtime] = dataclasses.field(default_factory=list)

        async def __call__(self, faults: Faults | None = None) -> Route:
            path, body, job_app = ROUTES[request.param]
            rt = dataclasses.replace(
                build_runtime(database_url, tmp_path, faults=faults), app=job_app
            )
            self.made.append(rt)
            return Route(rt, path, body, bearer(await make_token(rt, "acme")))

    factory = Factory()
    yield factory
    for rt in factory.made:
        await rt.engine.dispose()


@pytest.fixture
async def served(route: Any) -> AsyncIterator[tuple[Route, httpx.AsyncClient]]:
    r = await route()
    async with api_client(r.rt) as client:
        yield r, client


async def test_a_new_job_is_counted_once_as_new_to_queued(
    served: tuple[Route, httpx.AsyncClient],
) -> None:
    r, client = served
    first = await client.post(r.path, json=r.body, headers=r.headers)
    again = await client.post(r.path, json=r.body, headers=r.headers)
    assert first.status_code == again.status_code == 202, first.text
    assert first.json()["jobId"] == again.json()["jobId"]

    page = samples((await client.get("/metrics")).text)

    transitions = "jobrelay_job_transitions_total"
    assert value(page, transitions, from_state="new", to_state="queued") == 1


async def test_the_fault_point_follows_the_commit(route: Any) -> None:
    r = await route(Faults("api.before_response:crash:1", crash))
    async with api_client(r.rt) as client:
        crashed = await client.post(r.path, json=r.body, headers=r.headers)
        assert crashed.status_code == 500
        [job] = await r.rt.store.list_jobs()  # committed before the fault point
        retried = await client.post(r.path, json=r.body, headers=r.headers)
    assert retried.status_code == 202, retried.text
    assert retried.json()["jobId"] == job.id
    assert await r.rt.store.outbox_backlog() == 1


async def test_a_repeat_is_logged_as_a_repeat(
    served: tuple[Route, httpx.AsyncClient], caplog: pytest.LogCaptureFixture
) -> None:
    r, client = served
    with caplog.at_level(logging.INFO, logger="jobrelay.api"):
        for _ in range(2):
            response = await client.post(r.path, json=r.body, headers=r.headers)
            assert response.status_code == 202, response.text
    job_id = response.json()["jobId"]

    accepts = [rec for rec in caplog.records if getattr(rec, "event", None) == "job_accepted"]

    assert [(rec.getMessage(), getattr(rec, "isNew", None)) for rec in accepts] == [
        ("job accepted", True),
        ("job already accepted", False),
    ]
    assert {getattr(rec, "jobId", None) for rec in accepts} == {job_id}


async def test_max_attempts_come_from_the_serving_settings(
    served: tuple[Route, httpx.AsyncClient],
) -> None:
    r, client = served
    accepted = await client.post(r.path, json=r.body, headers=r.headers)
    assert accepted.status_code == 202, accepted.text

    job = await r.rt.store.get_job(accepted.json()["jobId"])

    assert job is not None
    assert job.max_attempts == r.rt.settings.max_attempts == MAX_ATTEMPTS


async def test_a_post_whose_commit_went_unanswered_says_so_and_its_retry_is_the_same_job(
    database_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 38: a failover can cut the connection after the accept's commit, before its
    answer. The 503 must not say "nothing was changed" (it may have been), and the retry
    with the same key must answer the job that was written, not make a second one."""
    from jobrelay.errors import StoreError

    rt = dataclasses.replace(build_runtime(database_url, tmp_path), app=app)
    token = await make_token(rt, "acme")
    submit = rt.store.submit
    cut: list[str] = []

    async def committed_then_cut(job: Any, now: Any) -> tuple[str, bool]:
        job_id, created = await submit(job, now)
        if not cut:
            cut.append(job_id)
            raise StoreError("database write failed: connection was closed in the middle")
        return job_id, created

    monkeypatch.setattr(rt.store, "submit", committed_then_cut)
    body = {"type": "accept.ping", "params": {"n": 7}, "key": "order-7"}
    try:
        async with api_client(rt) as client:
            first = await client.post("/v1/jobs", json=body, headers=bearer(token))
            assert first.status_code == 503, first.text
            detail = first.json()["detail"]
            assert "nothing was changed" not in detail
            assert "may or may not" in detail and "same Idempotency-Key" in detail
            again = await client.post("/v1/jobs", json=body, headers=bearer(token))
            assert again.status_code == 202, again.text
            assert again.json()["jobId"] == cut[0]
            read = await client.get(f"/v1/jobs/{cut[0]}", headers=bearer(token))
            assert read.status_code == 200
    finally:
        await rt.engine.dispose()
