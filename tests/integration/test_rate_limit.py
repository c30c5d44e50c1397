"""Per-token rate limits: ``JOBRELAY_RATE_LIMIT`` on job creation and admin actions, 429
problem+json with ``Retry-After``, nothing written by a refused request, reads not limited."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from sqlalchemy import func, select

from jobrelay.api.ratelimit import Limit, RateLimiter, parse_limit
from jobrelay.errors import ConfigError
from jobrelay.roles.runtime import Runtime
from jobrelay.settings import load_settings
from jobrelay.storage.tables import jobs
from tests.integration.api_fixtures import api_client, bearer, build_runtime, make_token

PROBLEM = "application/problem+json"


@pytest.fixture
async def runtime(database_url: str, tmp_path: Path) -> AsyncIterator[Runtime]:
    rt = build_runtime(database_url, tmp_path)
    limited = dataclasses.replace(
        rt, settings=rt.settings.model_copy(update={"rate_limit": "3/minute"})
    )
    yield limited
    await rt.engine.dispose()


@pytest.fixture
async def client(runtime: Runtime) -> AsyncIterator[httpx.AsyncClient]:
    async with api_client(runtime) as c:
        yield c


async def job_count(rt: Runtime) -> int:
    async with rt.engine.connect() as conn:
        return int(await conn.scalar(select(func.count()).select_from(jobs)) or 0)


@pytest.mark.parametrize(
    ("text", "limit"),
    [
        ("100/second", Limit(100.0, 100.0)),
        ("600/minute:50", Limit(10.0, 50.0)),
        ("1/hour", Limit(1 / 3600, 1.0)),
        ("", None),
    ],
)
def test_the_limit_setting(text: str, limit: Limit | None) -> None:
    assert parse_limit(text) == limit


@pytest.mark.parametrize("text", ["100", "ten/second", "0/second", "5/week", "5/second:0"])
def test_a_bad_limit_names_the_variable(text: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load_settings(rate_limit=text)
    assert caught.value.variable == "JOBRELAY_RATE_LIMIT"


def test_a_bucket_allows_its_burst_then_the_rate() -> None:
    now = [0.0]
    limiter = RateLimiter(Limit(per_second=2.0, burst=3.0), clock=lambda: now[0])
    assert [limiter.take("t") for _ in range(3)] == [None, None, None]
    assert limiter.take("t") == pytest.approx(0.5)
    assert limiter.take("other") is None  # per token
    now[0] += 0.5
    assert limiter.take("t") is None
    assert limiter.take("t") == pytest.approx(0.5)


async def test_a_hammering_client_gets_429s_and_writes_nothing(
    client: httpx.AsyncClient, runtime: Runtime
) -> None:
    acme = bearer(await make_token(runtime, "acme"))
    periods = [f"2020-{m:02d}" for m in range(1, 13)]
    answers = [
        await client.post("/v1/exports", json={"accountId": "acme", "period": p}, headers=acme)
        for p in periods
    ]
    assert [a.status_code for a in answers[:3]] == [202, 202, 202]
    refused = answers[3:]
    assert {a.status_code for a in refused} == {429}
    assert all(a.headers["content-type"].startswith(PROBLEM) for a in refused)
    assert all(int(a.headers["retry-after"]) >= 1 for a in refused)
    assert await job_count(runtime) == 3  # the refused requests changed nothing
    # Another token has its own bucket; reading is not limited.
    globex = bearer(await make_token(runtime, "globex"))
    other = await client.post(
        "/v1/exports", json={"accountId": "globex", "period": "2020-01"}, headers=globex
    )
    assert other.status_code == 202
    job_id = answers[0].json()["jobId"]
    for _ in range(5):
        assert (await client.get(f"/v1/jobs/{job_id}", headers=acme)).status_code == 200


async def test_admin_actions_are_limited_too(client: httpx.AsyncClient, runtime: Runtime) -> None:
    admin = bearer(await make_token(runtime, None, admin=True))
    job = "0190c9a0-0000-7000-8000-000000000000"
    codes = [
        (
            await client.post(f"/v1/jobs/{job}/cancel", json={"reason": "r"}, headers=admin)
        ).status_code
        for _ in range(5)
    ]
    assert codes == [404, 404, 404, 429, 429]
