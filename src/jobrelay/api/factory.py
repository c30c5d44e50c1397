"""The FastAPI application: routes, problem handlers, and where its ``Runtime`` comes from.

``create_app(settings)`` opens its own runtime in the lifespan and closes it on shutdown
(``jobrelay api``). ``create_app(settings, runtime=rt)`` serves from a runtime someone else
owns and will close (``jobrelay up``, tests); it is attached at once, because an ASGI client
used in tests does not run the lifespan.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI

from jobrelay import __version__
from jobrelay.api import (
    admin,
    bulk,
    console,
    docs_ui,
    health,
    job_search,
    jobs,
    limits,
    observability,
    overview,
    queues,
    routes,
    schedules,
)
from jobrelay.api.buckets import RateLimiter, parse_limit
from jobrelay.api.deps import set_runtime
from jobrelay.api.problems import PROBLEM_MEDIA_TYPE, install_problem_handlers
from jobrelay.library.loader import load_app
from jobrelay.observe import tracing
from jobrelay.runtime.wiring import Runtime, open_runtime
from jobrelay.settings import Settings

DESCRIPTION = (
    "Reliable background jobs. `POST /v1/exports` answers 202 with a stable `jobId` once the "
    "job and its outbox message are committed; follow it at `/v1/jobs/{jobId}`. Every error "
    "is `application/problem+json` (RFC 9457)."
)
# Every route that may answer 401 may also answer this (api/auth.py).
_AUTH_FAILURES_429 = {
    "description": "Too many requests with a token that is not valid from this client address "
    "(JOBRELAY_AUTH_FAILURE_LIMIT); Retry-After says when to try again. Nothing was changed.",
    "content": {PROBLEM_MEDIA_TYPE: {"schema": {"$ref": "#/components/schemas/Problem"}}},
}
# FastAPI's stock 422 schema; ours is ValidationProblem, declared where a 422 can happen.
_STOCK_VALIDATION_SCHEMAS = ("HTTPValidationError", "ValidationError")


class JobrelayAPI(FastAPI):
    """FastAPI with the generated OpenAPI corrected to what the handlers really send."""

    def openapi(self) -> dict[str, Any]:
        if self.openapi_schema is None:
            _describe_problems(super().openapi())
        assert self.openapi_schema is not None
        return self.openapi_schema


def create_app(settings: Settings, *, runtime: Runtime | None = None) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if runtime is not None:
            yield  # owned by the caller, who closes it
            return
        # The accepts' own connections (PostgreSQL): the job's one statement on raw asyncpg,
        # prepared once per connection, not through SQLAlchemy's pool (``write_new_job``).
        async with open_runtime(settings) as opened, opened.store.intake_connections():
            set_runtime(app, opened)
            try:
                yield
            finally:
                set_runtime(app, None)

    app = JobrelayAPI(
        title="jobrelay",
        version=__version__,
        description=DESCRIPTION,
        lifespan=lifespan,
        # Starlette answers a path with a stray trailing slash with a 307 to the same path on
        # the Host the caller sent (and keeps a POST body): an open redirect, before any auth.
        # Such paths are a plain 404 problem instead.
        redirect_slashes=False,
        # FastAPI's /docs and /redoc load their assets from CDNs: docs_ui serves /docs from
        # the package instead, and there is no /redoc.
        docs_url=None,
        redoc_url=None,
        telemetry=tracing.fastapi_telemetry(),  # type: ignore[arg-type]  # a TelemetryConfig
    )
    set_runtime(app, runtime)
    app.state.rate_limiter = RateLimiter(parse_limit(settings.rate_limit))
    app.state.auth_failure_limiter = RateLimiter(parse_limit(settings.auth_failure_limit))
    install_problem_handlers(app)
    app.add_middleware(observability.RequestMiddleware)  # outermost: sees the final status
    job_app = runtime.job_app() if runtime is not None else load_app(settings.app)
    for router in job_app.routers:  # the application's own routes (App.http_router)
        app.include_router(router)
    app.include_router(routes.router)
    app.include_router(jobs.router)
    app.include_router(admin.router)
    app.include_router(job_search.router)
    app.include_router(bulk.router)
    app.include_router(overview.router)
    app.include_router(queues.router)
    app.include_router(limits.router)
    app.include_router(schedules.router)
    app.include_router(health.router)
    app.include_router(observability.router)
    app.include_router(console.router)
    app.include_router(docs_ui.router)
    return app


def _describe_problems(schema: dict[str, Any]) -> None:
    """Error responses are problem+json, and the stock 422 FastAPI adds to every route with a
    path parameter is dropped: an unknown jobId is a 404 here, never a 422."""
    for path_item in schema.get("paths", {}).values():
        for operation in path_item.values():
            responses: dict[str, Any] = operation.get("responses", {})
            if "401" in responses and "429" not in responses:
                responses["429"] = _AUTH_FAILURES_429
            for code in list(responses):
                response = responses[code]
                content = response.get("content") or {}
                if any(_is_stock_validation(media) for media in content.values()):
                    del responses[code]
                elif (code == "default" or code[0] in "45") and content:
                    response["content"] = {PROBLEM_MEDIA_TYPE: next(iter(content.values()))}
    components = schema.get("components", {}).get("schemas", {})
    for name in _STOCK_VALIDATION_SCHEMAS:
        components.pop(name, None)


def _is_stock_validation(media: dict[str, Any]) -> bool:
    ref = media.get("schema", {}).get("$ref", "")
    return isinstance(ref, str) and ref.endswith("/HTTPValidationError")
