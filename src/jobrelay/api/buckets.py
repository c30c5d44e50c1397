"""Token buckets, and the ``RATE/UNIT[:BURST]`` text that configures them.

A limit such as ``10/second:100`` is a bucket of ``burst`` requests (default: one unit's
worth) refilled at the rate. Two limits use them: per API token on what writes
(``JOBRELAY_RATE_LIMIT``, ``api/ratelimit.py``) and per client address on failed
authentication (``JOBRELAY_AUTH_FAILURE_LIMIT``, ``api/auth.py``). ``off`` (or nothing) is
no limit. Kept apart from both so the settings can check the text without importing FastAPI.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass

_SPEC = re.compile(r"\s*(\d+(?:\.\d+)?)\s*/\s*(second|minute|hour)s?\s*(?::\s*(\d+)\s*)?")
_UNITS = {"second": 1.0, "minute": 60.0, "hour": 3600.0}
_MAX_BUCKETS = 100_000  # distinct keys remembered; beyond that, start again
OFF = "off"


@dataclass(frozen=True)
class Limit:
    per_second: float
    burst: float


def parse_limit(text: str) -> Limit | None:
    """``100/second[:burst]`` -> Limit; ``off`` or empty -> None (no limit); ValueError
    otherwise."""
    if text.strip().lower() in ("", OFF):
        return None
    match = _SPEC.fullmatch(text)
    if match is None:
        raise ValueError(
            f"expected RATE/second|minute|hour[:BURST] (e.g. 100/second) or off, got {text!r}"
        )
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

    def _tokens(self, key: str, limit: Limit, now: float) -> float:
        tokens, at = self._buckets.get(key, (limit.burst, now))
        return min(limit.burst, tokens + (now - at) * limit.per_second)

    def take(self, key: str) -> float | None:
        """Take one request from ``key``'s bucket: None if allowed, else seconds to wait."""
        limit = self.limit
        if limit is None:
            return None
        now = self._clock()
        tokens = self._tokens(key, limit, now)
        if tokens >= 1:
            if len(self._buckets) >= _MAX_BUCKETS and key not in self._buckets:
                self._buckets.clear()
            self._buckets[key] = (tokens - 1, now)
            return None
        self._buckets[key] = (tokens, now)
        return (1 - tokens) / limit.per_second

    def empty(self, key: str) -> float | None:
        """Seconds until ``key``'s bucket holds a request again, or None when it holds one
        now; takes nothing (for a check made before the work that would be counted)."""
        limit = self.limit
        if limit is None or key not in self._buckets:
            return None
        tokens = self._tokens(key, limit, self._clock())
        return None if tokens >= 1 else (1 - tokens) / limit.per_second
