"""Per-token rate limits on what writes: job creation and admin actions.

``JOBRELAY_RATE_LIMIT`` is ``RATE/UNIT`` (``100/second``, ``600/minute``), optionally with a
burst, ``100/second:300``. Each token gets a token bucket of ``burst`` requests (default: one
unit's worth) refilled at the rate; a request that finds it empty is answered ``429``
problem+json with ``Retry-After`` (whole seconds until one request is available again),
before its body is read, so a refused request changes nothing.

The buckets live in each API process's memory, so N API processes behind a balancer allow up
to N times the limit in total. That is deliberate: sharing the count through PostgreSQL
would cost a write per request on the one path (accept) that is a single statement now, to
enforce a limit whose purpose is to stop a runaway client, not to bill it exactly.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request

from jobrelay.api.auth import Principal, PrincipalDep
from jobrelay.api.problems import ProblemError, problem_openapi

_SPEC = re.compile(r"\s*(\d+(?:\.\d+)?)\s*/\s*(second|minute|hour)s?\s*(?::\s*(\d+)\s*)?")
_UNITS = {"second": 1.0, "minute": 60.0, "hour": 3600.0}
_MAX_BUCKETS = 100_000  # distinct tokens remembered; beyond that, start again


@dataclass(frozen=True)
class Limit:
    per_second: float
    burst: float


def parse_limit(text: str) -> Limit | None:
    """``100/second[:burst]`` -> Limit; empty -> None (no limit); ValueError otherwise."""
    if not text.strip():
        return None
    match = _SPEC.fullmatch(text)
    if match is None:
        raise ValueError(f"expected RATE/second|minute|hour[:BURST], e.g. 100/second, got {text!r}")
    rate = float(match[1])
    if rate <= 0:
        raise ValueError(f"the rate must be positive, got {text!r}")
    per_second = rate / _UNITS[match[2]]
    burst = float(match[3]) if match[3] else max(rate, 1.0)
    if burst < 1:
        raise ValueError(f"the burst must be at least 1, got {text!r}")
    return Limit(per_second, burst)


class RateLimiter:
    def __init__(self, limit: Limit | None, clock: Callable[[], float] = time.monotonic) -> None:
        self.limit = limit
        self._clock = clock
        self._buckets: dict[str, tuple[float, float]] = {}  # key -> (tokens, at)

    def take(self, key: str) -> float | None:
        """Take one request from ``key``'s bucket: None if allowed, else seconds to wait."""
        limit = self.limit
        if limit is None:
            return None
        now = self._clock()
        tokens, at = self._buckets.get(key, (limit.burst, now))
        tokens = min(limit.burst, tokens + (now - at) * limit.per_second)
        if tokens >= 1:
            if len(self._buckets) >= _MAX_BUCKETS and key not in self._buckets:
                self._buckets.clear()
            self._buckets[key] = (tokens - 1, now)
            return None
        self._buckets[key] = (tokens, now)
        return (1 - tokens) / limit.per_second


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
