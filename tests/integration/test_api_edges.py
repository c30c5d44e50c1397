"""The API's edges against a caller who chooses the Host and the forwarded headers: no
redirect to a host the caller named, and forwarded headers believed only from the proxies
named in ``JOBRELAY_TRUSTED_PROXIES``."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from jobrelay.processes.api_server import build_server
from jobrelay.runtime.wiring import Runtime
from tests.integration.api_fixtures import api_client, bearer, build_runtime, make_token

PROBLEM = "application/problem+json"


@pytest.fixture
async def runtime(database_url: str, tmp_path: Path) -> AsyncIterator[Runtime]:
    rt = build_runtime(database_url, tmp_path)
    yield rt
    await rt.engine.dispose()


@pytest.fixture
async def client(runtime: Runtime) -> AsyncIterator[httpx.AsyncClient]:
    async with api_client(runtime) as c:
        yield c


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/v1/jobs/0190c9a0-0000-7000-8000-000000000000/"),
        ("POST", "/v1/exports/"),
        ("POST", "/v1/jobs/"),
        ("GET", "/console/"),
        ("GET", "/healthz/"),
    ],
)
async def test_a_trailing_slash_is_a_404_never_a_redirect_to_the_callers_host(
    client: httpx.AsyncClient, runtime: Runtime, method: str, path: str
) -> None:
    headers = {
        "Host": "evil.example",
        "X-Forwarded-Proto": "https",
        "X-Forwarded-Host": "evil.example",
        **bearer(await make_token(runtime, "acme")),
    }
    response = await client.request(method, path, headers=headers, json={})
    assert not response.is_redirect, response.headers.get("location")
    assert "location" not in response.headers
    assert response.status_code == 404
    assert response.headers["content-type"].startswith(PROBLEM)
    assert "evil.example" not in response.text


def test_forwarded_headers_are_ignored_unless_the_proxy_is_trusted(runtime: Runtime) -> None:
    plain = build_server(runtime, "127.0.0.1", 0).config
    assert plain.proxy_headers is False
    trusted = runtime.settings.model_copy(update={"trusted_proxies": "10.0.0.5, 10.1.0.0/16"})
    runtime_behind_proxy = Runtime.__new__(Runtime)
    runtime_behind_proxy.__dict__.update({**runtime.__dict__, "settings": trusted})
    config = build_server(runtime_behind_proxy, "127.0.0.1", 0).config
    assert config.proxy_headers is True
    assert config.forwarded_allow_ips == ["10.0.0.5", "10.1.0.0/16"]


@pytest.mark.parametrize("value", ["10.0.0.x", "proxy.internal", "10.0.0.0/99"])
def test_a_trusted_proxy_that_is_not_an_address_is_refused(value: str) -> None:
    from jobrelay.errors import ConfigError
    from jobrelay.settings import load_settings

    with pytest.raises(ConfigError) as caught:
        load_settings(trusted_proxies=value)
    assert caught.value.variable == "JOBRELAY_TRUSTED_PROXIES"


# --- bodies and encodings ------------------------------------------------------------------

JOB = "0190c9a0-0000-7000-8000-000000000000"
BODY_ROUTES = [
    ("/v1/exports", False),
    (f"/v1/jobs/{JOB}/cancel", True),
    (f"/v1/jobs/{JOB}/replay", True),
]


async def _token(runtime: Runtime, admin: bool) -> dict[str, str]:
    return bearer(await make_token(runtime, None if admin else "acme", admin=admin))


@pytest.mark.parametrize(("path", "admin"), BODY_ROUTES)
async def test_a_body_over_16_kib_is_413(
    client: httpx.AsyncClient, runtime: Runtime, path: str, admin: bool
) -> None:
    body = b'{"reason": "' + b"x" * (16 * 1024) + b'"}'
    response = await client.post(path, content=body, headers=await _token(runtime, admin))
    assert response.status_code == 413
    assert response.headers["content-type"].startswith(PROBLEM)


@pytest.mark.parametrize(("path", "admin"), BODY_ROUTES)
async def test_bytes_that_are_not_utf8_are_422_not_400(
    client: httpx.AsyncClient, runtime: Runtime, path: str, admin: bool
) -> None:
    body = b'{"reason": "caf\xe9", "accountId": "acme", "period": "2020-05"}'
    response = await client.post(path, content=body, headers=await _token(runtime, admin))
    assert response.status_code == 422, response.text
    assert "UTF-8" in response.text


@pytest.mark.parametrize(("path", "admin"), BODY_ROUTES)
async def test_a_duplicate_key_is_refused_not_last_wins(
    client: httpx.AsyncClient, runtime: Runtime, path: str, admin: bool
) -> None:
    body = (
        b'{"reason": "a", "reason": "b", "accountId": "acme", "accountId": "globex",'
        b' "period": "2020-05"}'
    )
    response = await client.post(path, content=body, headers=await _token(runtime, admin))
    assert response.status_code == 422, response.text
    assert "same key twice" in response.text


async def test_admin_bodies_are_json_whatever_the_content_type(
    client: httpx.AsyncClient, runtime: Runtime
) -> None:
    """As /v1/exports does: the body is JSON even as text/plain (or with no type at all)."""
    headers = {**await _token(runtime, True), "Content-Type": "text/plain"}
    cancel = await client.post(
        f"/v1/jobs/{JOB}/cancel", content=b'{"reason": "r"}', headers=headers
    )
    assert cancel.status_code == 404  # parsed, then: no such job
    missing = await client.post(f"/v1/jobs/{JOB}/cancel", content=b"", headers=headers)
    assert missing.status_code == 422  # cancel needs a reason
    replay = await client.post(f"/v1/jobs/{JOB}/replay", content=b"", headers=headers)
    assert replay.status_code == 404  # replay's body is optional


async def test_the_openapi_schema_states_the_servers_limits(
    client: httpx.AsyncClient, runtime: Runtime
) -> None:
    import re

    schema = (await client.get("/openapi.json")).json()
    export = schema["paths"]["/v1/exports"]["post"]
    period = export["requestBody"]["content"]["application/json"]["schema"]["properties"]
    pattern = re.compile(period["period"]["pattern"])
    for bad in ("0000-00", "2020-13", "1899-12", "3000-01", "2020-00"):
        assert not pattern.match(bad), bad
    for good in ("1900-01", "2020-05", "2999-12"):
        assert pattern.match(good), good
    acme = await _token(runtime, False)
    refused = await client.post(
        "/v1/exports", json={"accountId": "acme", "period": "0000-00"}, headers=acme
    )
    assert refused.status_code == 422
    for path in ("/v1/jobs/{jobId}/cancel", "/v1/jobs/{jobId}/replay", "/v1/exports"):
        responses = schema["paths"][path]["post"]["responses"]
        assert {"413", "422", "429"} <= set(responses), (path, sorted(responses))
    cancel = schema["paths"]["/v1/jobs/{jobId}/cancel"]["post"]["requestBody"]
    assert cancel["required"] is True
    assert (
        cancel["content"]["application/json"]["schema"]["properties"]["reason"]["maxLength"] == 500
    )
