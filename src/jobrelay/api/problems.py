"""Every error the API answers with is an RFC 9457 problem, and nothing else ever leaks out.

Clients (and support) get one shape for every failure: ``type``, ``title``, ``status``,
``detail``, ``instance``, plus ``errors`` for validation and a few named extras. Handlers are
installed for our own ``ProblemError``, FastAPI's validation errors, Starlette's HTTP errors
(unknown route, wrong method) and the store/transport errors; a last-resort ASGI middleware
turns anything else into a bare 500 problem and logs the traceback, because Starlette's own
500 handler re-raises after answering and would show internals in development mode.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from jobrelay.errors import StoreError, TransportError

log = logging.getLogger("jobrelay.api")

PROBLEM_MEDIA_TYPE = "application/problem+json"
# Problem types clients may branch on. Plain HTTP conditions use "about:blank" (RFC 9457 §4.2),
# where the title is simply the status phrase.
VALIDATION = "urn:jobrelay:problem:validation"
IDEMPOTENCY_CONFLICT = "urn:jobrelay:problem:idempotency-conflict"
NOT_FINISHED = "urn:jobrelay:problem:job-not-finished"
RESULT_GONE = "urn:jobrelay:problem:result-gone"
JOB_PRUNED = "urn:jobrelay:problem:job-pruned"
NOT_READY = "urn:jobrelay:problem:not-ready"
UNAVAILABLE = "urn:jobrelay:problem:dependency-unavailable"
_STANDARD_MEMBERS = frozenset({"type", "title", "status", "detail", "instance"})


class FieldError(BaseModel):
    model_config = ConfigDict(frozen=True)

    field: str
    message: str


class Problem(BaseModel):
    """RFC 9457 problem details; also the OpenAPI schema of every error response."""

    type: str = "about:blank"
    title: str
    status: int
    detail: str | None = None
    instance: str | None = None


class ValidationProblem(Problem):
    errors: list[FieldError]


class NotFinishedProblem(Problem):
    state: str


class NotReadyProblem(Problem):
    database: str
    broker: str


class ProblemError(Exception):
    """Raised anywhere in a request to answer with a problem; the handler renders it."""

    def __init__(
        self,
        status: int,
        detail: str,
        *,
        type_: str = "about:blank",
        title: str | None = None,
        headers: Mapping[str, str] | None = None,
        **extra: Any,
    ) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail
        self.type = type_
        self.title = title or HTTPStatus(status).phrase
        self.headers = dict(headers or {})
        self.extra = extra


def problem_response(
    request: Request | None,
    status: int,
    detail: str | None,
    *,
    type_: str = "about:blank",
    title: str | None = None,
    headers: Mapping[str, str] | None = None,
    **extra: Any,
) -> JSONResponse:
    body: dict[str, Any] = {
        "type": type_,
        "title": title or HTTPStatus(status).phrase,
        "status": status,
    }
    if detail:
        body["detail"] = detail
    if request is not None:
        body["instance"] = request.url.path
    # Extension members may add to a problem, never redefine its standard members.
    body.update({k: v for k, v in extra.items() if k not in _STANDARD_MEMBERS})
    return JSONResponse(body, status_code=status, headers=headers, media_type=PROBLEM_MEDIA_TYPE)


def validation_response(
    request: Request, errors: Sequence[FieldError], detail: str
) -> JSONResponse:
    return problem_response(
        request,
        422,
        detail,
        type_=VALIDATION,
        title="Invalid request",
        errors=[e.model_dump() for e in errors],
    )


def field_errors(raw: Sequence[Any]) -> list[FieldError]:
    """Pydantic/FastAPI error dicts -> ``{"field", "message"}``, never echoing the input."""
    out: list[FieldError] = []
    for error in raw:
        loc = [str(part) for part in error.get("loc", ())]
        if loc and loc[0] == "body":
            # JSON decode errors carry a character offset after "body"; that is not a field.
            rest = [] if error.get("type") == "json_invalid" else loc[1:]
            field = ".".join(rest) or "body"
        elif loc and loc[0] in ("header", "query", "path", "cookie"):
            field = ".".join(loc[1:]) or loc[0]
        else:
            field = ".".join(loc) or "body"
        out.append(FieldError(field=field, message=str(error.get("msg", "invalid value"))))
    return out


async def _on_problem(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ProblemError)
    return problem_response(
        request,
        exc.status,
        exc.detail,
        type_=exc.type,
        title=exc.title,
        headers=exc.headers,
        **exc.extra,
    )


async def _on_validation(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    errors = field_errors(exc.errors())
    names = ", ".join(dict.fromkeys(e.field for e in errors))
    return validation_response(request, errors, f"invalid value for: {names}")


async def _on_http(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    phrase = HTTPStatus(exc.status_code).phrase
    detail = exc.detail if isinstance(exc.detail, str) and exc.detail != phrase else None
    return problem_response(request, exc.status_code, detail, headers=exc.headers)


async def _on_unavailable(request: Request, exc: Exception) -> JSONResponse:
    which = "database" if isinstance(exc, StoreError) else "broker"
    # The reason goes to the log only: driver messages can name hosts and users.
    log.warning(
        "%s unavailable during a request",
        which,
        extra={"event": "api_dependency_unavailable", "dependency": which, "reason": str(exc)},
    )
    if request.method in ("GET", "HEAD", "OPTIONS"):
        detail = f"the {which} is unavailable; nothing was changed, try again later"
    else:
        # A write cut off mid-way (a failover) may have committed: the client cannot tell,
        # and neither can this process. The same key names the same job, so a retry with it
        # answers that job if it was accepted, and accepts it once if it was not.
        detail = (
            f"the {which} is unavailable; the request may or may not have been carried out:"
            " send it again with the same Idempotency-Key (or key), which names the same job"
        )
    return problem_response(request, 503, detail, type_=UNAVAILABLE, headers={"Retry-After": "5"})


def install_problem_handlers(app: FastAPI) -> None:
    app.add_exception_handler(ProblemError, _on_problem)
    app.add_exception_handler(RequestValidationError, _on_validation)
    app.add_exception_handler(StarletteHTTPException, _on_http)
    app.add_exception_handler(StoreError, _on_unavailable)
    app.add_exception_handler(TransportError, _on_unavailable)
    app.add_middleware(CatchAllMiddleware)


class CatchAllMiddleware:
    """Last line: an unexpected exception becomes a 500 problem with no internals, and is logged.

    If the response had already started (a stream failing half-way) there is nothing valid
    left to send, so the exception propagates and the server drops the connection.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception:
            log.exception(
                "unhandled error in request",
                extra={
                    "event": "api_unhandled_error",
                    "method": scope.get("method"),
                    "path": scope.get("path"),
                },
            )
            if started:
                raise
            request = Request(scope)
            response = problem_response(
                request, 500, "an unexpected error occurred; it has been logged"
            )
            await response(scope, receive, send)


def problem_openapi(description: str, model: type[Problem] = Problem) -> dict[str, Any]:
    """An entry for a route's ``responses=``; the media type is fixed up in ``app.openapi``."""
    return {"model": model, "description": description}
