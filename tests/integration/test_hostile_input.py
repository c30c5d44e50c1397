"""Input any token can send must never be a 500 (issue 25, items 4 and 8).

Times at the calendar's edges (their UTC instant is outside years 1-9999), in a query, a
cursor or a bulk filter; a body of 8,000 ``[`` on every JSON route; a NUL in a reason or a
filter: each is a 4xx problem+json and logs no traceback. Error details do not echo the
input, and ``/docs`` may not be framed.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import re
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest

from jobrelay.runtime.wiring import Runtime
from tests.integration.api_fixtures import api_client, bearer, build_runtime, make_token

pytestmark = pytest.mark.timeout(60)

PROBLEM = "application/problem+json"
JOB = "0190c9a0-0000-7000-8000-000000000000"
# (path, admin): every route that takes a JSON body.
BODY_ROUTES = [
    ("/v1/exports", False),
    ("/v1/jobs", False),
    (f"/v1/jobs/{JOB}/cancel", True),
    (f"/v1/jobs/{JOB}/replay", True),
    ("/v1/bulk/replay", True),
    ("/v1/bulk/cancel", True),
    ("/v1/queues/default/pause", True),
    ("/v1/queues/default/resume", True),
    ("/v1/schedules/nightly/pause", True),
    ("/v1/schedules/nightly/resume", True),
]
LATE = "9999-12-31T23:59:59-23:59"  # 10000-01-01 in UTC
EARLY = "0001-01-01T00:00:00+23:59"  # year 0 in UTC


@pytest.fixture
async def runtime(database_url: str, tmp_path: Path) -> AsyncIterator[Runtime]:
    rt = build_runtime(database_url, tmp_path)
    yield rt
    await rt.engine.dispose()


@pytest.fixture
async def client(runtime: Runtime) -> AsyncIterator[httpx.AsyncClient]:
    async with api_client(runtime) as c:
        yield c


@pytest.fixture
def no_traceback(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    caplog.set_level(logging.INFO, logger="jobrelay.api")
    yield
    unhandled = [r for r in caplog.records if getattr(r, "event", "") == "api_unhandled_error"]
    assert not unhandled, [r.getMessage() for r in unhandled]
    assert not [r for r in caplog.records if r.exc_info], "a traceback was logged"


async def _token(runtime: Runtime, admin: bool) -> dict[str, str]:
    return bearer(await make_token(runtime, None if admin else "acme", admin=admin))


def _problem(response: httpx.Response, *statuses: int) -> dict[str, object]:
    assert response.status_code in statuses, response.text
    assert response.headers["content-type"].startswith(PROBLEM)
    body: dict[str, object] = response.json()
    return body


@pytest.mark.parametrize(("path", "admin"), BODY_ROUTES)
@pytest.mark.parametrize("body", [b"[" * 8000, b'{"params": ' + b"[" * 8000])
@pytest.mark.usefixtures("no_traceback")
async def test_a_body_nested_too_deep_is_a_problem_not_a_500(
    client: httpx.AsyncClient, runtime: Runtime, path: str, admin: bool, body: bytes
) -> None:
    response = await client.post(path, content=body, headers=await _token(runtime, admin))
    # 404: a schedule that does not exist is answered before its body is read.
    problem = _problem(response, 400, 404, 422)
    if response.status_code == 422:
        assert "nested too deeply" in str(problem["detail"]) + json.dumps(problem["errors"])


@pytest.mark.parametrize(
    ("query", "field"),
    [
        ({"createdAfter": LATE}, "createdAfter"),
        ({"createdBefore": EARLY}, "createdBefore"),
        ({"createdBefore": LATE, "createdAfter": EARLY}, "createdAfter"),
    ],
)
@pytest.mark.parametrize("admin", [False, True])
@pytest.mark.usefixtures("no_traceback")
async def test_a_time_at_the_calendars_edge_is_a_422(
    client: httpx.AsyncClient, runtime: Runtime, query: dict[str, str], field: str, admin: bool
) -> None:
    response = await client.get("/v1/jobs", params=query, headers=await _token(runtime, admin))
    problem = _problem(response, 422)
    assert field in str(problem["detail"])


@pytest.mark.parametrize("at", [LATE, EARLY])
@pytest.mark.usefixtures("no_traceback")
async def test_a_forged_cursor_at_the_calendars_edge_is_a_422(
    client: httpx.AsyncClient, runtime: Runtime, at: str
) -> None:
    raw = json.dumps([at, JOB]).encode()
    cursor = base64.urlsafe_b64encode(raw).decode().rstrip("=")
    response = await client.get(
        "/v1/jobs", params={"cursor": cursor}, headers=await _token(runtime, False)
    )
    assert "cursor" in str(_problem(response, 422)["detail"])


@pytest.mark.parametrize("action", ["replay", "cancel"])
@pytest.mark.parametrize("field", ["createdAfter", "createdBefore"])
@pytest.mark.parametrize("at", [LATE, EARLY])
@pytest.mark.usefixtures("no_traceback")
async def test_a_bulk_filter_at_the_calendars_edge_is_a_422(
    client: httpx.AsyncClient, runtime: Runtime, action: str, field: str, at: str
) -> None:
    body = {"filter": {field: at}, "reason": "x", "dryRun": True}
    response = await client.post(
        f"/v1/bulk/{action}", json=body, headers=await _token(runtime, True)
    )
    assert f"filter.{field}" in str(_problem(response, 422)["detail"])


@pytest.mark.parametrize("field", ["reason", "type", "queue"])
@pytest.mark.parametrize("admin", [False, True])
async def test_a_nul_in_a_list_filter_is_a_422(
    client: httpx.AsyncClient, runtime: Runtime, field: str, admin: bool
) -> None:
    response = await client.get(
        "/v1/jobs", params={field: "a\x00"}, headers=await _token(runtime, admin)
    )
    assert field in str(_problem(response, 422)["detail"])


@pytest.mark.parametrize("action", ["replay", "cancel"])
@pytest.mark.parametrize(
    "body",
    [
        {"filter": {"reason": "\x00"}, "reason": "x"},
        {"filter": {"type": "\x00"}, "reason": "x"},
        {"filter": {}, "reason": "fixed\x00"},
    ],
)
async def test_a_nul_in_a_bulk_filter_or_reason_is_a_422_and_selects_nothing(
    client: httpx.AsyncClient, runtime: Runtime, action: str, body: dict[str, object]
) -> None:
    response = await client.post(
        f"/v1/bulk/{action}", json=body, headers=await _token(runtime, True)
    )
    _problem(response, 422)


async def test_a_nul_in_an_operators_reason_is_a_422(
    client: httpx.AsyncClient, runtime: Runtime
) -> None:
    response = await client.post(
        f"/v1/jobs/{JOB}/cancel", json={"reason": "a\x00b"}, headers=await _token(runtime, True)
    )
    _problem(response, 422)


async def test_error_details_do_not_echo_the_input(
    client: httpx.AsyncClient, runtime: Runtime
) -> None:
    acme = await _token(runtime, False)
    mark = "<img src=x onerror=alert(1)>"
    answers = [
        await client.post("/v1/jobs", json={"type": mark}, headers=acme),
        await client.post(
            "/v1/exports", json={"accountId": "zz-" + "q" * 20, "period": "2020-05"}, headers=acme
        ),
        await client.post(
            "/v1/exports",
            content=json.dumps({mark: 1}).encode()[:-1] + b', "' + mark.encode() + b'": 2}',
            headers=acme,
        ),
    ]
    assert [a.status_code for a in answers] == [404, 403, 422]
    for answer in answers:
        assert mark not in answer.text and "qqqq" not in answer.text, answer.text


async def test_docs_may_not_be_framed_and_run_only_their_own_scripts(
    client: httpx.AsyncClient,
) -> None:
    page = await client.get("/docs")
    assert page.status_code == 200
    policy = page.headers["content-security-policy"]
    assert "frame-ancestors 'none'" in policy
    assert page.headers["x-frame-options"] == "DENY"
    inline = re.findall(r"<script>(.*?)</script>", page.text, re.S)
    assert len(inline) == 1
    digest = base64.b64encode(hashlib.sha256(inline[0].encode()).digest()).decode()
    script_src = next(d for d in policy.split(";") if d.strip().startswith("script-src"))
    assert script_src.split() == ["script-src", "'self'", f"'sha256-{digest}'"]
    assert "unsafe-inline" not in script_src and "unsafe-eval" not in policy
