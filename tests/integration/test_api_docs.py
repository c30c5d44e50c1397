"""``/docs`` works offline (Swagger UI served from the package, no CDN), and the probes
answer ``HEAD`` as load balancers send it."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from importlib import resources
from pathlib import Path

import httpx
import pytest

from jobrelay.runtime.wiring import Runtime
from tests.integration.api_fixtures import api_client, build_runtime


@pytest.fixture
async def client(sqlite_url: str, tmp_path: Path) -> AsyncIterator[httpx.AsyncClient]:
    runtime: Runtime = build_runtime(sqlite_url, tmp_path)
    try:
        async with api_client(runtime) as c:
            yield c
    finally:
        await runtime.engine.dispose()


async def test_docs_load_nothing_from_another_origin(client: httpx.AsyncClient) -> None:
    page = await client.get("/docs")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    html = page.text
    assert "SwaggerUIBundle" in html
    assert not re.search(r"""(?:src|href|url)\s*[=:]\s*["']?(?:https?:)?//""", html), html
    assets = re.findall(r"""(?:src|href)="([^"]+)""", html)
    assert {a.rsplit(".", 1)[-1] for a in assets} >= {"js", "css"}, assets
    for asset in assets:
        assert asset.startswith("/"), asset
        answer = await client.get(asset)
        assert answer.status_code == 200, asset
        assert answer.content, asset
    assert "'/openapi.json'" in html or '"/openapi.json"' in html
    assert (await client.get("/openapi.json")).status_code == 200


def test_the_swagger_ui_files_ship_with_their_licence() -> None:
    shipped = resources.files("jobrelay.api").joinpath("static", "swagger-ui")
    assert "Apache License" in shipped.joinpath("LICENSE").read_text()
    assert "SmartBear" in shipped.joinpath("NOTICE").read_text()
    package_data = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    assert '"api/static/swagger-ui/*"' in package_data


async def test_an_unknown_docs_asset_is_a_404(client: httpx.AsyncClient) -> None:
    for name in ("nothing.js", "..%2F..%2Fsettings.py", "LICENSE"):
        assert (await client.get(f"/docs/assets/{name}")).status_code == 404, name


async def test_head_healthz_is_200_without_a_body(client: httpx.AsyncClient) -> None:
    head = await client.head("/healthz")
    assert head.status_code == 200 and head.content == b""
    assert (await client.get("/healthz")).status_code == 200
