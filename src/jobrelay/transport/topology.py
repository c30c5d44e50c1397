"""Every broker name in one place, and how a logical destination maps onto them.

The outbox stores logical destinations ("work", "retry.5s"); only this module knows that
"retry.5s" is the queue ``jobrelay.retry.5s`` bound to the ``jobrelay`` exchange with that
routing key, and that expired messages there dead-letter back to the work queue.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

EXCHANGE = "jobrelay"
DEAD_LETTER_EXCHANGE = "jobrelay.dlx"
WORK_QUEUE = "jobrelay.work"
WORK_ROUTING_KEY = "work"
QUARANTINE_QUEUE = "jobrelay.quarantine"
QUARANTINE_ROUTING_KEY = "quarantine"
RETRY_QUEUE_PREFIX = "jobrelay.retry."

_RETRY = re.compile(r"^retry\.([1-9][0-9]*)s$")


def retry_queue(seconds: int) -> str:
    return f"{RETRY_QUEUE_PREFIX}{seconds}s"


def retry_routing_key(seconds: int) -> str:
    return f"retry.{seconds}s"


def retry_seconds(destination: str) -> int | None:
    """The delay of a retry destination, or None when it is not one."""
    match = _RETRY.match(destination)
    return int(match.group(1)) if match else None


@dataclass(frozen=True)
class Topology:
    """The tiers in force: one fixed-TTL queue per configured retry delay."""

    retry_delays: tuple[int, ...]
    delivery_limit: int

    @property
    def tiers(self) -> tuple[int, ...]:
        return tuple(sorted(set(self.retry_delays)))

    def routes(self, destination: str) -> bool:
        """True when the destination has a queue; anything else is unroutable."""
        if destination == WORK_ROUTING_KEY:
            return True
        seconds = retry_seconds(destination)
        return seconds is not None and seconds in self.tiers

    @property
    def shortest_delay(self) -> int:
        return self.tiers[0]
