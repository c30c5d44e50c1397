"""``GET /metrics`` and the request middleware: the request's trace, request counts.

With spans recorded, FastAPI's own telemetry makes each request's server span, a child of the
caller's W3C ``traceparent`` (``observe.tracing.fastapi_telemetry``). Without, the
middleware makes the caller's trace context current for the request: its log lines carry the
trace id, and a job it enqueues carries the context on to the relay and the worker. It counts
requests by route template, never by raw path, so job ids do not become label values.
"""

from __future__ import annotations

import logging

from fastapi import APIRouter, Request
from fastapi.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from jobrelay.api.deps import RuntimeDep
from jobrelay.api.problems import ProblemError
from jobrelay.errors import StoreError
from jobrelay.observe import tracing
from jobrelay.observe.metrics import CONTENT_TYPE, Metrics, authorized, refresh_database_gauges
from jobrelay.runtime.wiring import Runtime

log = logging.getLogger("jobrelay.api")

router = APIRouter()


@router.get("/metrics", include_in_schema=False)
async def metrics(runtime: RuntimeDep, request: Request) -> Response:
    """Prometheus text. The database gauges are read at most once per
    ``JOBRELAY_METRICS_CACHE_SECONDS``, and skipped (kept at their last value) when the
    database does not answer; the counters are always served. With
    ``JOBRELAY_METRICS_TOKEN``, only to ``Authorization: Bearer <it>``."""
    settings = runtime.settings
    if not authorized(settings.metrics_token, request.headers.get("authorization")):
        raise ProblemError(
            401,
            "send the metrics token as 'Authorization: Bearer <token>'",
            headers={"WWW-Authenticate": 'Bearer realm="jobrelay-metrics"'},
        )
    try:
        await refresh_database_gauges(runtime, settings.metrics_cache_seconds)
    except StoreError as exc:
        log.warning(
            "metrics: database gauges not refreshed: %s", exc, extra={"event": "metrics_refresh"}
        )
    return Response(runtime.metrics.render(), media_type=CONTENT_TYPE)


_TRACE_HEADERS = {name.encode() for name in tracing.TRACE_HEADERS}


class RequestMiddleware:
    """Outermost: binds the request's trace id to its log lines and counts the answer."""

    def __init__(self, app: ASGIApp, metrics: Metrics | None = None) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500

        async def tracking_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        headers = {
            name.decode("latin-1"): value.decode("latin-1")
            for name, value in scope.get("headers") or []
            if name in _TRACE_HEADERS
        }
        with tracing.request_context(headers):
            try:
                await self.app(scope, receive, tracking_send)
            finally:
                self._count(scope, status)

    def _count(self, scope: Scope, status: int) -> None:
        metrics = self.metrics
        if metrics is None:
            runtime = getattr(getattr(scope.get("app"), "state", None), "runtime", None)
            metrics = runtime.metrics if isinstance(runtime, Runtime) else None
        if metrics is None:
            return
        route = getattr(scope.get("route"), "path", None) or "unmatched"
        metrics.http_requests.labels(
            method=str(scope.get("method", "")), route=route, status=str(status)
        ).inc()
