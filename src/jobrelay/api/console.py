"""The support console at ``/console``: one static page, plain JavaScript, no build step.

The page talks to the same ``/v1`` API as everyone else with the token the person pastes in
(kept in the tab's ``sessionStorage`` only): look a job up (``/v1/jobs/{id}/explain``), list
quarantined jobs with their reasons (``GET /v1/jobs``, admin), and replay or cancel
(admin); list the periodic schedules (``GET /v1/schedules``, admin) and pause or resume
one. The server adds nothing the API does not already allow. Files are read once from the
package; a strict Content-Security-Policy allows only this origin's script and style,
and the script writes every value with ``textContent``, never as HTML.
"""

from __future__ import annotations

from functools import cache
from importlib import resources

from fastapi import APIRouter
from fastapi.responses import Response

router = APIRouter(include_in_schema=False)

_FILES = {
    "console.html": "text/html; charset=utf-8",
    "console.js": "text/javascript; charset=utf-8",
    "console.css": "text/css; charset=utf-8",
}
_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
        "img-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}


@cache
def _read(name: str) -> bytes:
    return resources.files("jobrelay.api").joinpath("static", name).read_bytes()


def _serve(name: str) -> Response:
    return Response(_read(name), media_type=_FILES[name], headers=_HEADERS)


@router.get("/console")
async def console_page() -> Response:
    return _serve("console.html")


@router.get("/console/console.js")
async def console_script() -> Response:
    return _serve("console.js")


@router.get("/console/console.css")
async def console_style() -> Response:
    return _serve("console.css")
