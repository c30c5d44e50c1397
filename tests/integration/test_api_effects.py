"""The HTTP side of external effects: ``notifyEmail`` on accept, and s3:// result downloads.

Requests go through the real ASGI app and a real Store; S3 is moto over real HTTP, so the
presigned URL the API hands out is followed for real.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import httpx
import pytest

from jobrelay.api import create_app
from jobrelay.domain.ids import follow_up_job_id, request_hash
from jobrelay.results.s3 import S3Results
from jobrelay.runtime.wiring import Runtime
from jobrelay.storage.store import NewJob
from tests.id_keys import request_id
from tests.integration.api_fixtures import bearer, build_runtime, finish_job, make_token

from .effects_fixtures import (  # noqa: F401 (fixtures, registered by name)
    S3Server,
    aws_env_fixture,
    bucket_fixture,
    create_bucket,
    s3_client,
    s3_server_fixture,
)

BODY = {"accountId": "acme", "period": "2020-05"}
CSV = b"entry_id,booked_on,description,counterparty,amount,currency\r\n1,2020-05-01,x,y,1,EUR\r\n"
# 64 + 1 + 189: exactly the 254 characters an address may have.
LONGEST_ADDRESS = "x" * 64 + "@" + ".".join(["d" * 61] * 3) + ".com"


@pytest.fixture
async def runtime(sqlite_url: str, tmp_path: Path) -> AsyncIterator[Runtime]:
    rt = build_runtime(sqlite_url, tmp_path)
    yield rt
    await rt.engine.dispose()


@pytest.fixture
async def s3_runtime(runtime: Runtime, s3_server: S3Server, bucket: str) -> AsyncIterator[Runtime]:
    await create_bucket(s3_server.endpoint, bucket)
    results = S3Results(f"s3://{bucket}/results", endpoint_url=s3_server.endpoint)
    yield dataclasses.replace(runtime, results=results)
    await results.aclose()


def client_for(rt: Runtime) -> httpx.AsyncClient:
    app = create_app(rt.settings, runtime=rt)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://api.test")


async def test_longest_allowed_notify_email_is_accepted(runtime: Runtime) -> None:
    assert len(LONGEST_ADDRESS) == 254
    auth = bearer(await make_token(runtime, "acme"))
    async with client_for(runtime) as client:
        response = await client.post(
            "/v1/exports", json={**BODY, "notifyEmail": LONGEST_ADDRESS}, headers=auth
        )
    assert response.status_code == 202, response.text


async def test_notify_email_is_stored_and_is_part_of_the_job_identity(runtime: Runtime) -> None:
    auth = bearer(await make_token(runtime, "acme"))
    async with client_for(runtime) as client:
        plain = await client.post("/v1/exports", json=BODY, headers=auth)
        notify = await client.post(
            "/v1/exports", json={**BODY, "notifyEmail": "ops@example.com"}, headers=auth
        )
    assert plain.status_code == 202 and notify.status_code == 202, notify.text
    # Without notifyEmail the jobId is what it always was; with it, another job.
    assert plain.json()["jobId"] == await request_id(runtime.store, "acme", BODY)
    with_notify = {**BODY, "notifyEmail": "ops@example.com"}
    assert notify.json()["jobId"] == await request_id(runtime.store, "acme", with_notify)
    job = await runtime.store.get_job(notify.json()["jobId"])
    assert job.params == with_notify


@pytest.mark.parametrize(
    "value",
    [
        "ops@example.com\r\nBcc: victim@example.org",
        "ops@example.com\n",
        "ops@example.com, cfo@example.com",
        "ops@example.com;cfo@example.com",
        "Ops <ops@example.com>",
        "ops@@example.com",
        "not an address",
        "ops@localhost",
        LONGEST_ADDRESS[:-4] + "d.com",  # 255 characters
        "",
        123,
        ["ops@example.com"],
        None,
    ],
    ids=lambda v: repr(v)[:24],
)
async def test_bad_notify_email_is_422_and_creates_nothing(runtime: Runtime, value: Any) -> None:
    auth = bearer(await make_token(runtime, "acme"))
    async with client_for(runtime) as client:
        response = await client.post(
            "/v1/exports", json={**BODY, "notifyEmail": value}, headers=auth
        )
    if value is None:  # explicit null is the same as leaving it out
        assert response.status_code == 202
        assert response.json()["jobId"] == await request_id(runtime.store, "acme", BODY)
        return
    assert response.status_code == 422, response.text
    problem = response.json()
    assert problem["type"] == "urn:jobrelay:problem:validation"
    assert [e["field"] for e in problem["errors"]] == ["notifyEmail"]
    assert "victim" not in response.text and "cfo" not in response.text  # never echoed
    assert await runtime.store.list_jobs() == []


async def test_s3_result_is_a_307_to_a_short_lived_presigned_url(
    s3_runtime: Runtime, s3_server: S3Server
) -> None:
    acme = bearer(await make_token(s3_runtime, "acme"))
    other = bearer(await make_token(s3_runtime, "other"))
    async with client_for(s3_runtime) as client:
        accepted = await client.post("/v1/exports", json=BODY, headers=acme)
        job_id = accepted.json()["jobId"]
        pending = await client.get(f"/v1/jobs/{job_id}/result", headers=acme)
        assert pending.status_code == 409 and "location" not in pending.headers
        await finish_job(s3_runtime, job_id, CSV)

        stranger = await client.get(f"/v1/jobs/{job_id}/result", headers=other)
        assert stranger.status_code == 404 and "location" not in stranger.headers
        response = await client.get(f"/v1/jobs/{job_id}/result", headers=acme)

    assert response.status_code == 307, response.text
    assert response.headers["cache-control"] == "no-store"
    location = response.headers["location"]
    url = urlsplit(location)
    query = parse_qs(url.query)
    assert f"{url.scheme}://{url.netloc}" == s3_server.endpoint
    assert url.path == f"/{s3_runtime.results.bucket}/results/exports/acme/{job_id}.csv"  # type: ignore[attr-defined]
    assert 0 < int(query["X-Amz-Expires"][0]) <= 900
    assert query["X-Amz-Algorithm"] == ["AWS4-HMAC-SHA256"] and query["X-Amz-Signature"]
    async with httpx.AsyncClient() as browser:  # no token: the URL itself is the credential
        download = await browser.get(location)
    assert download.status_code == 200 and download.content == CSV
    assert download.headers["content-disposition"] == (
        'attachment; filename="export-acme-2020-05.csv"'
    )


async def test_s3_result_missing_is_410_and_unreachable_s3_is_503(
    s3_runtime: Runtime, s3_server: S3Server, bucket: str
) -> None:
    acme = bearer(await make_token(s3_runtime, "acme"))
    async with client_for(s3_runtime) as client:
        job_id = (await client.post("/v1/exports", json=BODY, headers=acme)).json()["jobId"]
        key = await finish_job(s3_runtime, job_id, CSV)
        async with s3_client(s3_server.endpoint) as s3:
            await s3.delete_object(Bucket=bucket, Key=f"results/{key}")
        gone = await client.get(f"/v1/jobs/{job_id}/result", headers=acme)
        assert gone.status_code == 410
        assert gone.json()["type"] == "urn:jobrelay:problem:result-gone"
        s3_server.stop()
        down = await client.get(f"/v1/jobs/{job_id}/result", headers=acme)
    assert down.status_code == 503
    assert down.json()["type"] == "urn:jobrelay:problem:dependency-unavailable"
    assert down.headers["retry-after"] == "5"
    assert s3_server.endpoint not in down.text  # internals stay in the log


async def test_notification_job_is_visible_but_has_no_result(runtime: Runtime) -> None:
    acme = bearer(await make_token(runtime, "acme"))
    export_id = await request_id(runtime.store, "acme", BODY)
    params = {"exportJobId": export_id, "to": "ops@example.com"}
    notify_id = follow_up_job_id(export_id, "notify.email")
    await runtime.store.submit(
        NewJob(notify_id, "notify.email", "acme", params, request_hash("acme", "x", params), 3),
        runtime.clock(),
    )
    async with client_for(runtime) as client:
        job = await client.get(f"/v1/jobs/{notify_id}", headers=acme)
        result = await client.get(f"/v1/jobs/{notify_id}/result", headers=acme)
    assert job.status_code == 200 and job.json()["type"] == "notify.email"
    assert result.status_code == 404


async def test_file_result_is_still_streamed_not_redirected(runtime: Runtime) -> None:
    acme = bearer(await make_token(runtime, "acme"))
    async with client_for(runtime) as client:
        job_id = (await client.post("/v1/exports", json=BODY, headers=acme)).json()["jobId"]
        await finish_job(runtime, job_id, CSV)
        response = await client.get(f"/v1/jobs/{job_id}/result", headers=acme)
    assert response.status_code == 200 and response.content == CSV
    assert "location" not in response.headers
    assert response.headers["content-type"].startswith("text/csv")
