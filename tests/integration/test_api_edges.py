"""The API's edges against a caller who chooses the Host and the forwarded headers: no
redirect to a host the caller named, and forwarded headers believed only from the proxies
named in ``JOBRELAY_TRUSTED_PROXIES``."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from jobrelay.api import create_app
from jobrelay.roles.processes import build_server
from jobrelay.roles.runtime import Runtime
from tests.integration.api_fixtures import bearer, build_runtime, make_token

PROBLEM = "application/problem+json"


@pytest.fixture
async def runtime(database_url: str, tmp_path: Path) -> AsyncIterator[Runtime]:
    rt = build_runtime(database_url, tmp_path)
    yield rt
    await rt.engine.dispose()


@pytest.fixture
async def client(runtime: Runtime) -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(runtime.settings, runtime=runtime)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://api.test") as c:
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
