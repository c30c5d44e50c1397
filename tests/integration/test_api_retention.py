"""The HTTP contract for pruned jobs: 410 ``job-pruned`` to whoever could have read the job,
404 to anyone else and for ids retention never saw; a repeated request (or Idempotency-Key)
after the job was pruned makes a new job. SQLite and PostgreSQL, on a moved test clock.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest

from jobrelay.domain.states import JobState
from jobrelay.maintenance.prune import Pruner
from jobrelay.runtime.wiring import Runtime
from tests.integration.api_fixtures import (
    Clock,
    api_client,
    bearer,
    build_runtime,
    finish_job,
    make_token,
)

BODY = {"accountId": "acme", "period": "2020-05"}
PROBLEM = "application/problem+json"
PRUNED = "urn:jobrelay:problem:job-pruned"


@pytest.fixture
async def runtime(database_url: str, tmp_path: Path) -> AsyncIterator[Runtime]:
    rt = build_runtime(database_url, tmp_path, clock=Clock())
    yield rt
    await rt.engine.dispose()


@pytest.fixture
async def client(runtime: Runtime) -> AsyncIterator[httpx.AsyncClient]:
    async with api_client(runtime) as c:
        yield c


async def accept(client: httpx.AsyncClient, auth: dict[str, str], **headers: str) -> str:
    response = await client.post("/v1/exports", json=BODY, headers={**auth, **headers})
    assert response.status_code == 202, response.text
    return str(response.json()["jobId"])


def problem(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == PROBLEM
    body: dict[str, Any] = response.json()
    body.pop("instance")
    return body


async def pruned_job(runtime: Runtime, client: httpx.AsyncClient, auth: dict[str, str]) -> str:
    """A succeeded export, 31 days later pruned (job row, events and result file)."""
    job_id = await accept(client, auth, **{"Idempotency-Key": "order-42"})
    await finish_job(runtime, job_id, b"a,b\n1,2\n")
    assert isinstance(runtime.clock, Clock)
    runtime.clock.advance(timedelta(days=31).total_seconds())
    counts = await Pruner(runtime).run_once()
    assert (counts.jobs, counts.results) == (1, 1)
    return job_id


async def test_a_pruned_job_is_410_to_its_account_and_404_to_others(
    runtime: Runtime, client: httpx.AsyncClient
) -> None:
    acme = bearer(await make_token(runtime, "acme"))
    other = bearer(await make_token(runtime, "other"))
    admin = bearer(await make_token(runtime, None, admin=True))
    job_id = await pruned_job(runtime, client, acme)

    for suffix in ("", "/events", "/result", "/explain"):
        for auth in (acme, admin):
            gone = problem(await client.get(f"/v1/jobs/{job_id}{suffix}", headers=auth), 410)
            assert gone["type"] == PRUNED and gone["title"] == "Job pruned"
            assert gone["prunedAt"].startswith(runtime.clock().date().isoformat())
        hidden = problem(await client.get(f"/v1/jobs/{job_id}{suffix}", headers=other), 404)
        absent = problem(await client.get(f"/v1/jobs/{uuid.uuid4()}{suffix}", headers=acme), 404)
        assert hidden == absent and absent["type"] == "about:blank"
    for action, body in (("replay", {}), ("cancel", {"reason": "r"})):
        url = f"/v1/jobs/{job_id}/{action}"
        assert problem(await client.post(url, json=body, headers=admin), 410)["type"] == PRUNED
        assert (
            problem(
                await client.post(f"/v1/jobs/{uuid.uuid4()}/{action}", json=body, headers=admin),
                404,
            )["type"]
            == "about:blank"
        )


async def test_a_repeated_idempotency_key_after_the_prune_creates_a_new_job(
    runtime: Runtime, client: httpx.AsyncClient
) -> None:
    acme = bearer(await make_token(runtime, "acme"))
    job_id = await pruned_job(runtime, client, acme)

    again = await accept(client, acme, **{"Idempotency-Key": "order-42"})

    assert again == job_id  # the id comes from the key: same id, a new job behind it
    response = await client.get(f"/v1/jobs/{again}", headers=acme)
    assert response.status_code == 200
    job = response.json()
    assert job["state"] == JobState.QUEUED.value and job["resultKey"] is None
    assert job["createdAt"].startswith(runtime.clock().date().isoformat())
    events = (await client.get(f"/v1/jobs/{again}/events", headers=acme)).json()["events"]
    assert [e["kind"] for e in events] == ["accepted"]
