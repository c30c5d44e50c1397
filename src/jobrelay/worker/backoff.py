"""A pause that grows between failed tries of the same write, so nothing loops hot.

Waiting for the database (``Worker._wait_for_database``) returns at once when its ping
succeeds, yet the write may fail again (a lock timeout, a refused grant, a server that
answers pings but not this statement). Without a pause of its own such a write would be
retried thousands of times a second; with one, a repeated failure costs a statement every
few seconds at most, and the first retry after a real outage is still immediate.
"""

from __future__ import annotations

import asyncio

FIRST_SECONDS = 0.05
MAX_SECONDS = 5.0


class Backoff:
    """Per write: no pause before the first retry, then 0.05 s doubling up to 5 s."""

    def __init__(self, first: float = FIRST_SECONDS, most: float = MAX_SECONDS) -> None:
        self._first = first
        self._most = most
        self._next = 0.0
        self.failures = 0  # how many times this write failed (for logs and tests)

    async def wait(self) -> None:
        """Called after each failure: sleeps longer each time this same write failed."""
        self.failures += 1
        if self._next > 0:
            await asyncio.sleep(self._next)
        self._next = min(self._most, max(self._first, self._next * 2))
