"""Per-token rate limits on what writes: job creation and admin actions.

``JOBRELAY_RATE_LIMIT`` is ``RATE/UNIT`` (``100/second``, ``600/minute``), optionally with a
burst, ``100/second:300``, or ``off``; it is on by default (``settings.py``), because
one token creating jobs as fast as it can slows every other tenant's jobs (the same workers
and database), and a deployment without a proxy has nothing else in front. Each token gets
a token bucket (``api/buckets.py``); a request that finds it empty is answered ``429``
problem+json with ``Retry-After`` (whole seconds until one request is available again),
before its body is read, so a refused request changes nothing.

The buckets live in each API process's memory, so N API processes behind a balancer allow up
to N times the limit in total. That is deliberate: sharing the count through PostgreSQL
would cost a write per request on the one path (accept) that is a single statement now, to
enforce a limit whose purpose is to stop a runaway client, not to bill it exactly.
"""

from __future__ import annotations

import math
from typing import Annotated

from fastapi import Depends, Request

from jobrelay.api.auth import Principal, PrincipalDep
from jobrelay.api.buckets import Limit, RateLimiter, parse_limit
from jobrelay.api.problems import ProblemError, problem_openapi

__all__ = ["RATE_LIMIT_RESPONSES", "Limit", "RateLimitedDep", "RateLimiter", "parse_limit"]


def limiter_of(request: Request) -> RateLimiter:
    limiter = getattr(request.app.state, "rate_limiter", None)
    if not isinstance(limiter, RateLimiter):  # an app built without create_app: no limit
        limiter = request.app.state.rate_limiter = RateLimiter(None)
    return limiter


async def rate_limited(request: Request, principal: PrincipalDep) -> Principal:
    """The caller, once its token is within ``JOBRELAY_RATE_LIMIT``; 429 otherwise."""
    wait = limiter_of(request).take(principal.key)
    if wait is not None:
        seconds = max(1, math.ceil(wait))
        raise ProblemError(
            429,
            f"too many requests for this token: try again in {seconds} s",
            headers={"Retry-After": str(seconds)},
        )
    return principal


RateLimitedDep = Annotated[Principal, Depends(rate_limited)]
RATE_LIMIT_RESPONSES: dict[int | str, dict[str, object]] = {
    429: problem_openapi(
        "Too many requests for this token (JOBRELAY_RATE_LIMIT); Retry-After says when to "
        "try again. Nothing was changed."
    )
}
