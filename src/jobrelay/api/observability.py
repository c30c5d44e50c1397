"""``GET /metrics`` and the request middleware: trace id on log lines, request counts.

The middleware binds the ``traceparent`` trace id of each request to its log lines (the
same id the job's message carries to the relay and the worker) and counts requests by route
template, never by raw path, so job ids do not become label values.
"""

from __future__ import annotations

import logging

from fastapi import APIRouter, Request
from fastapi.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from jobrelay.api.deps import RuntimeDep
from jobrelay.api.problems import ProblemError
from jobrelay.api.schemas import valid_traceparent
from jobrelay.errors import StoreError
from jobrelay.observe import logs
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

        raw = dict(scope.get("headers") or []).get(b"traceparent")
        trace = valid_traceparent(raw.decode("latin-1")) if raw else None
        try:
            with logs.bound(traceId=logs.trace_id(trace)):
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
