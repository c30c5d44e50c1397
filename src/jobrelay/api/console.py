"""The console at ``/console``: one static page, plain JavaScript, no build step.

The page talks to the same ``/v1`` API as everyone else with the token the person pastes in
(kept in the tab's ``sessionStorage`` only): the live overview (``/v1/overview``, admin),
the jobs list with its filters and bulk actions (``/v1/jobs``, ``/v1/bulk/*``), the queues
(``/v1/queues``), the limits per key (``/v1/limits``), one job (``/v1/jobs/{id}/explain``),
the quarantined jobs and the schedules. The server adds nothing the API does not already
allow. Files are read once from the package, the chart library (uPlot) included, vendored
under ``static/vendor`` (no CDN); a strict Content-Security-Policy allows only this origin's
script and style, and the script writes every value with ``textContent``, never as HTML.
"""

from __future__ import annotations

from functools import cache
from importlib import resources

from fastapi import APIRouter
from fastapi.responses import Response

from jobrelay.api.problems import ProblemError

router = APIRouter(include_in_schema=False)

_JS = "text/javascript; charset=utf-8"
_CSS = "text/css; charset=utf-8"
_FILES = {
    "console.html": "text/html; charset=utf-8",
    "common.js": _JS,
    "console.js": _JS,
    "lane.js": _JS,
    "overview.js": _JS,
    "jobs.js": _JS,
    "limits.js": _JS,
    "console.css": _CSS,
    "vendor/uPlot.iife.min.js": _JS,
    "vendor/uPlot.min.css": _CSS,
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
    return resources.files("jobrelay.api").joinpath("static", *name.split("/")).read_bytes()


def _serve(name: str) -> Response:
    return Response(_read(name), media_type=_FILES[name], headers=_HEADERS)


@router.get("/console")
async def console_page() -> Response:
    return _serve("console.html")


@router.get("/console/{name}")
async def console_file(name: str) -> Response:
    return _asset(name)


@router.get("/console/vendor/{name}")
async def console_vendor_file(name: str) -> Response:
    return _asset("vendor/" + name)


def _asset(name: str) -> Response:
    """Only the files listed in ``_FILES``; anything else is the plain 404 problem."""
    if name not in _FILES or name == "console.html":
        raise ProblemError(404, "no such console file")
    return _serve(name)
