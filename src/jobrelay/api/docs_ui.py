"""The interactive API docs at ``/docs``: Swagger UI served from the package, not a CDN.

FastAPI's own ``/docs`` page loads Swagger UI's script and stylesheet from a CDN (and its
favicon from fastapi.tiangolo.com), so on a machine without internet access, or behind a
proxy that blocks them, the page is blank. The files are vendored instead, unmodified, under
``static/swagger-ui/`` (swagger-ui-dist 5.35.0, Apache-2.0; its LICENSE and NOTICE are
there too) and served here. The online validator badge is switched off for the same reason.
ReDoc (FastAPI's ``/redoc``, also CDN-only) is not offered.

The page carries a Content-Security-Policy like the console's: scripts only from this origin
plus the one inline script that starts Swagger UI (allowed by its hash, so no other inline
script runs), requests only to this origin, and ``frame-ancestors 'none'`` so no other site
can frame the page (with a token typed into it) to click-jack it. Styles allow inline ones:
Swagger UI sets them as it renders.
"""

from __future__ import annotations

import base64
import hashlib
import re
from functools import cache
from importlib import resources

from fastapi import APIRouter, Request
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse, Response

from jobrelay.api.problems import ProblemError

router = APIRouter(include_in_schema=False)

ASSETS = "/docs/assets"
_FILES = {
    "swagger-ui-bundle.js": "text/javascript; charset=utf-8",
    "swagger-ui.css": "text/css; charset=utf-8",
    "favicon-32x32.png": "image/png",
}


@cache
def _read(name: str) -> bytes:
    return resources.files("jobrelay.api").joinpath("static", "swagger-ui", name).read_bytes()


_INLINE_SCRIPT = re.compile(rb"<script>(.*?)</script>", re.S)


def content_security_policy(html: bytes) -> str:
    """The page's policy: its own inline scripts allowed by their SHA-256, nothing else."""
    hashes = " ".join(
        f"'sha256-{base64.b64encode(hashlib.sha256(m.group(1)).digest()).decode()}'"
        for m in _INLINE_SCRIPT.finditer(html)
    )
    return (
        f"default-src 'none'; script-src 'self' {hashes}; style-src 'self' 'unsafe-inline'; "
        "img-src 'self' data:; connect-src 'self'; base-uri 'none'; form-action 'none'; "
        "frame-ancestors 'none'"
    )


@router.get("/docs")
async def docs_page(request: Request) -> HTMLResponse:
    root = request.scope.get("root_path", "").rstrip("/")
    page = get_swagger_ui_html(
        openapi_url=f"{root}{request.app.openapi_url}",
        title=f"{request.app.title} - Swagger UI",
        swagger_js_url=f"{root}{ASSETS}/swagger-ui-bundle.js",
        swagger_css_url=f"{root}{ASSETS}/swagger-ui.css",
        swagger_favicon_url=f"{root}{ASSETS}/favicon-32x32.png",
        swagger_ui_parameters={"validatorUrl": None},
    )
    page.headers["Content-Security-Policy"] = content_security_policy(bytes(page.body))
    page.headers["X-Frame-Options"] = "DENY"  # frame-ancestors for browsers without CSP 2
    page.headers["X-Content-Type-Options"] = "nosniff"
    page.headers["Referrer-Policy"] = "no-referrer"
    return page


@router.get(ASSETS + "/{name}")
async def docs_asset(name: str) -> Response:
    media_type = _FILES.get(name)
    if media_type is None:
        raise ProblemError(404, "no such file")
    # The files change only with a jobrelay release; a day in the browser's cache is safe.
    return Response(
        _read(name), media_type=media_type, headers={"Cache-Control": "public, max-age=86400"}
    )
