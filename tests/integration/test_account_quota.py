"""What one account may keep: at most ``JOBRELAY_ACCOUNT_MAX_UNFINISHED_JOBS`` unfinished
jobs (waiting on others, queued, delayed, running, waiting to retry), on every API route that
accepts jobs, and
a job list page of at most ``MAX_PAGE_BYTES`` whatever its ``limit`` (issue 34, item 13).
On SQLite and PostgreSQL."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import BaseModel
from sqlalchemy import func, select

import jobrelay
from jobrelay.api.job_search import MAX_PAGE_BYTES
from jobrelay.runtime.wiring import Runtime
from jobrelay.storage import jobs as jobs_module
from jobrelay.storage.engine import read_only
from jobrelay.storage.jobs import QUOTA_RECOUNT_SECONDS
from jobrelay.storage.store import Store
from jobrelay.storage.tables import jobs

from .api_fixtures import api_client, bearer, build_runtime, make_token

QUOTA = 3
PROBLEM = "application/problem+json"
app = jobrelay.App()


class Blob(BaseModel):
    n: int
    blob: str = ""


@app.job("quota.blob", params=Blob, http=True)
async def blob(ctx: jobrelay.JobContext[Blob], params: Blob) -> None:
    return None


@pytest.fixture
async def rt(database_url: str, tmp_path: Path) -> AsyncIterator[Runtime]:
    runtime = build_runtime(database_url, tmp_path)
    settings = runtime.settings.model_copy(
        update={"account_max_unfinished_jobs": QUOTA, "rate_limit": "off"}
    )
    runtime = dataclasses.replace(runtime, app=app, settings=settings)
    yield runtime
    await runtime.engine.dispose()


async def count(rt: Runtime) -> int:
    async with read_only(rt.engine) as conn:
        return int(await conn.scalar(select(func.count()).select_from(jobs)) or 0)


def later(n: int, **extra: Any) -> dict[str, Any]:
    """A job a year less a day ahead: it stays unfinished for the whole test."""
    return {"type": "quota.blob", "params": {"n": n}, "delaySeconds": 364 * 86400, **extra}


def over_quota(response: httpx.Response) -> None:
    assert response.status_code == 429, response.text
    assert response.headers["content-type"].startswith(PROBLEM)
    problem = response.json()
    assert problem["type"] == "urn:jobrelay:problem:quota-exceeded"
    assert problem["limit"] == QUOTA
    assert "retry-after" not in response.headers  # it frees when jobs finish, not in time


async def test_an_account_keeps_at_most_its_quota_of_unfinished_jobs(
    rt: Runtime, monkeypatch: pytest.MonkeyPatch
) -> None:
    now = [1000.0]
    monkeypatch.setattr(jobs_module, "_monotonic", lambda: now[0])
    reads = 0
    unfinished = rt.store.unfinished_jobs

    async def counted(account_id: str, at_most: int) -> int:
        nonlocal reads
        reads += 1
        return await unfinished(account_id, at_most)

    monkeypatch.setattr(rt.store, "unfinished_jobs", counted)
    acme = bearer(await make_token(rt, "acme"))
    other = bearer(await make_token(rt, "globex"))
    admin = bearer(await make_token(rt, None, admin=True))
    # The shipped app serves POST /v1/exports; this module's, POST /v1/jobs of quota.blob.
    shipped = dataclasses.replace(rt, app=None)
    async with api_client(rt) as client, api_client(shipped) as exports:
        accepted = [
            await client.post("/v1/jobs", json=later(n, key=f"k-{n}"), headers=acme)
            for n in range(QUOTA)
        ]
        assert [r.status_code for r in accepted] == [202] * QUOTA
        assert reads == 1  # under the quota, counted once for the second, not per job
        over_quota(await client.post("/v1/jobs", json=later(99), headers=acme))
        export = {"accountId": "acme", "period": "2020-01"}
        over_quota(await exports.post("/v1/exports", json=export, headers=acme))
        assert await count(rt) == QUOTA
        # A retry of a request already accepted is still that job, not a refusal.
        again = await client.post("/v1/jobs", json=later(0, key="k-0"), headers=acme)
        assert again.status_code == 202, again.text
        assert again.json()["jobId"] == accepted[0].json()["jobId"]
        # Another account, and an admin token (no account), have their own count.
        assert (await client.post("/v1/jobs", json=later(5), headers=other)).status_code == 202
        assert (await client.post("/v1/jobs", json=later(6), headers=admin)).status_code == 202
        # A finished job frees its place, at the next count.
        first = accepted[0].json()["jobId"]
        cancelled = await client.post(
            f"/v1/jobs/{first}/cancel", json={"reason": "done with it"}, headers=admin
        )
        assert cancelled.status_code == 200, cancelled.text
        over_quota(await client.post("/v1/jobs", json=later(8), headers=acme))  # full lately
        now[0] += QUOTA_RECOUNT_SECONDS
        assert (await exports.post("/v1/exports", json=export, headers=acme)).status_code == 202
        over_quota(await client.post("/v1/jobs", json=later(7), headers=acme))
    assert await count(rt) == QUOTA + 3


async def test_a_job_list_page_stays_under_its_byte_bound_and_the_cursor_goes_on(
    rt: Runtime,
) -> None:
    admin = bearer(await make_token(rt, None, admin=True))
    blob_text = "x" * 15_000  # near the 16 KiB body limit, as the pages were
    total = MAX_PAGE_BYTES // 15_000 * 2 + 5
    async with api_client(rt) as client:
        for n in range(total):
            body = {"type": "quota.blob", "params": {"n": n, "blob": blob_text}}
            assert (await client.post("/v1/jobs", json=body, headers=admin)).status_code == 202
        seen: list[str] = []
        cursor: str | None = None
        pages = 0
        while True:
            query = {"limit": "1000", **({"cursor": cursor} if cursor else {})}
            page = await client.get("/v1/jobs", params=query, headers=admin)
            assert page.status_code == 200, page.text
            assert len(page.content) <= MAX_PAGE_BYTES
            out = json.loads(page.content)
            seen += [job["jobId"] for job in out["jobs"]]
            pages += 1
            cursor = out["nextCursor"]
            if cursor is None:
                break
    assert pages >= 3
    assert len(seen) == len(set(seen)) == total


async def test_jobs_waiting_on_others_count_against_the_quota(rt: Runtime) -> None:
    """Issue 37: a ``waiting`` job (``after=``) is unfinished. Counted from the database (a
    fresh API process, no count of its own yet): an account at its quota cannot add jobs that
    wait on one of its own."""
    token = await make_token(rt, "acme")
    async with api_client(rt) as client:
        first = await client.post("/v1/jobs", json=later(0), headers=bearer(token))
        assert first.status_code == 202, first.text
        part = first.json()["jobId"]
        for n in (1, 2):
            body = {"type": "quota.blob", "params": {"n": n}, "after": [part]}
            waiting = await client.post("/v1/jobs", json=body, headers=bearer(token))
            assert waiting.status_code == 202, waiting.text
    # Another API process: a store with no count of its own reads it from the database.
    fresh = dataclasses.replace(rt, store=Store(rt.engine))
    async with api_client(fresh) as client:
        body = {"type": "quota.blob", "params": {"n": 3}, "after": [part]}
        over_quota(await client.post("/v1/jobs", json=body, headers=bearer(token)))
