"""Liveness and readiness probes.

``/healthz`` answers from memory: a process that can run this handler is alive, and a
restart would not fix a database outage. ``/readyz`` asks the database and the broker, both
at once and each under a timeout, so a hung dependency makes the probe fail rather than
hang, and the answer names which one is down.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from fastapi import APIRouter
from fastapi.responses import Response

from jobrelay.api.deps import RuntimeDep
from jobrelay.api.problems import NOT_READY, NotReadyProblem, ProblemError, problem_openapi
from jobrelay.api.schemas import Health, Ready
from jobrelay.errors import StoreError, TransportError

log = logging.getLogger("jobrelay.api")

PING_TIMEOUT_SECONDS = 5.0

router = APIRouter()


@router.get("/healthz", response_model=Health, summary="The process is alive (no I/O)")
async def healthz() -> Health:
    return Health()


@router.head(
    "/healthz",
    response_class=Response,
    summary="The same probe without a body",
    responses={200: {"description": "The process is alive."}},
)
async def healthz_head() -> Response:
    """Load balancers and uptime checks often probe with HEAD; a 405 reads as "down"."""
    return Response(status_code=200)


@router.get(
    "/readyz",
    response_model=Ready,
    summary="The database and the broker answer",
    responses={503: problem_openapi("Not ready; says which dependency failed.", NotReadyProblem)},
)
async def readyz(runtime: RuntimeDep) -> Ready:
    database_ok, broker_ok = await asyncio.gather(
        _check("database", runtime.store.ping),
        _check("broker", runtime.transport.ping),
    )
    if database_ok and broker_ok:
        return Ready()
    down = [name for name, ok in (("database", database_ok), ("broker", broker_ok)) if not ok]
    raise ProblemError(
        503,
        f"not ready: {' and '.join(down)} unavailable",
        type_=NOT_READY,
        title="Not ready",
        database="ok" if database_ok else "unavailable",
        broker="ok" if broker_ok else "unavailable",
    )


async def _check(name: str, ping: Callable[[], Awaitable[None]]) -> bool:
    """True when ``ping`` returns in time. The reason is logged, never sent to the caller."""
    try:
        async with asyncio.timeout(PING_TIMEOUT_SECONDS):
            await ping()
    except (StoreError, TransportError, TimeoutError) as exc:
        log.warning(
            "%s not ready",
            name,
            extra={
                "event": "readiness_failed",
                "dependency": name,
                "reason": str(exc) or type(exc).__name__,
            },
        )
        return False
    except Exception:
        # A bug in an adapter's ping still means "not ready", not a 500 from the probe.
        log.exception(
            "%s ping raised unexpectedly",
            name,
            extra={"event": "readiness_failed", "dependency": name},
        )
        return False
    return True
