"""Per-token rate limits: ``JOBRELAY_RATE_LIMIT`` on job creation and admin actions, 429
problem+json with ``Retry-After``, nothing written by a refused request, reads not limited."""

from __future__ import annotations

import contextlib
import dataclasses
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from sqlalchemy import func, select

from jobrelay.api import create_app
from jobrelay.api.ratelimit import Limit, RateLimiter, parse_limit
from jobrelay.errors import ConfigError
from jobrelay.runtime.wiring import Runtime
from jobrelay.settings import Settings, load_settings
from jobrelay.storage import tokens as tokens_module
from jobrelay.storage.tables import jobs
from jobrelay.storage.tokens import TOKEN_CACHE_SECONDS
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
        ("off", None),
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


# --- on by default, and failed authentication per client address (issue 25, item 7) -------


@contextlib.asynccontextmanager
async def frozen_app_client(
    rt: Runtime, address: str = "198.51.100.7"
) -> AsyncIterator[tuple[httpx.AsyncClient, FastAPI]]:
    """A client of an app built from ``rt``'s settings whose buckets never refill: what a
    burst allows is then exact, however slow the machine."""
    app = create_app(rt.settings, runtime=rt)
    for name in ("rate_limiter", "auth_failure_limiter"):
        limit = getattr(app.state, name).limit
        setattr(app.state, name, RateLimiter(limit, clock=lambda: 0.0))
    transport = httpx.ASGITransport(app=app, client=(address, 40000))
    async with httpx.AsyncClient(transport=transport, base_url="http://api.test") as client:
        yield client, app


def test_both_limits_are_on_by_default_and_can_be_turned_off() -> None:
    defaults = Settings()
    assert parse_limit(defaults.rate_limit) == Limit(per_second=10.0, burst=100.0)
    assert parse_limit(defaults.auth_failure_limit) == Limit(per_second=1.0, burst=30.0)
    off = load_settings(rate_limit="off", auth_failure_limit="OFF")
    assert parse_limit(off.rate_limit) is None and parse_limit(off.auth_failure_limit) is None


async def test_one_token_is_limited_by_default(database_url: str, tmp_path: Path) -> None:
    rt = build_runtime(database_url, tmp_path)  # the default settings' limits
    try:
        acme = bearer(await make_token(rt, "acme"))
        async with frozen_app_client(rt) as (client, _):
            body = {"accountId": "acme", "period": "2020-01"}
            codes = Counter(
                [
                    (await client.post("/v1/exports", json=body, headers=acme)).status_code
                    for _ in range(102)
                ]
            )
        assert codes == {202: 100, 429: 2}
    finally:
        await rt.engine.dispose()


async def test_bad_tokens_are_limited_per_address_and_lock_no_valid_token_out(
    database_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """30 made-up tokens empty the address's bucket; then made-up tokens are refused without
    a lookup, while the valid tokens at that address (one used before, one never used, the
    admin's) go on being served (issue 34, item 12: they were all 429)."""
    now = [1000.0]
    monkeypatch.setattr(tokens_module, "_monotonic", lambda: now[0])
    rt = build_runtime(database_url, tmp_path)
    try:
        used = bearer(await make_token(rt, "acme"))
        unused = bearer(await make_token(rt, "acme"))
        admin = bearer(await make_token(rt, None, admin=True))
        lookups = 0
        find = rt.store.find_token

        async def counted(token_hash: str) -> Any:
            nonlocal lookups
            lookups += 1
            return await find(token_hash)

        monkeypatch.setattr(rt.store, "find_token", counted)
        bad = bearer("jr_" + "x" * 43)
        export = {"accountId": "acme", "period": "2020-01"}
        job = "/v1/jobs/0190c9a0-0000-7000-8000-000000000000"
        async with frozen_app_client(rt) as (client, _):
            assert (await client.post("/v1/exports", json=export, headers=used)).status_code == 202
            codes = [(await client.get(job, headers=bad)) for _ in range(30)]
            before = lookups
            # Bad and valid tokens interleaved at the blocked address: only the bad refused.
            mixed = []
            for headers in (bad, used, bad, unused, bad, admin, bad):
                mixed.append((await client.get(job, headers=headers)).status_code)
            over = lookups - before
            # A token created after the address was blocked is known within the cache's time.
            late = bearer(await make_token(rt, "acme"))
            refused_late = (await client.get(job, headers=late)).status_code
            now[0] += TOKEN_CACHE_SECONDS + 1
            served_late = (await client.get(job, headers=late)).status_code
        assert [c.status_code for c in codes] == [401] * 30
        assert mixed == [429, 404, 429, 404, 429, 404, 429]  # 404: no such job, but served
        assert all(c.headers["content-type"].startswith(PROBLEM) for c in codes)
        assert over == 3  # the valid tokens' lookups; the refused bad tokens cost none
        assert (refused_late, served_late) == (429, 404)
    finally:
        await rt.engine.dispose()


async def test_bad_tokens_from_another_address_do_not_count_here(
    database_url: str, tmp_path: Path
) -> None:
    rt = build_runtime(database_url, tmp_path)
    try:
        good = bearer(await make_token(rt, "acme"))
        bad = bearer("jr_" + "x" * 43)
        async with frozen_app_client(rt) as (client, app):
            codes = [(await client.get("/v1/jobs", headers=bad)).status_code for _ in range(33)]
            other_address = httpx.ASGITransport(app=app, client=("203.0.113.9", 40000))
            async with httpx.AsyncClient(transport=other_address, base_url="http://t") as other:
                elsewhere = await other.post(
                    "/v1/exports", json={"accountId": "acme", "period": "2020-01"}, headers=good
                )
                bad_elsewhere = await other.get("/v1/jobs", headers=bad)
        assert codes == [401] * 30 + [429] * 3
        assert elsewhere.status_code == 202  # another address has its own bucket
        assert bad_elsewhere.status_code == 401
    finally:
        await rt.engine.dispose()


def test_the_openapi_document_declares_the_429_where_a_401_is() -> None:
    app = create_app(Settings(database_url="sqlite:///unused.db"))
    for path, item in app.openapi()["paths"].items():
        for method, operation in item.items():
            if "401" in operation["responses"]:
                assert "429" in operation["responses"], (method, path)
