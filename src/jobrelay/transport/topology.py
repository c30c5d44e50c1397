"""Every broker name in one place, and how a logical destination maps onto them.

The outbox stores logical destinations (``jobrelay.domain.queues``); this module knows which
broker queue each one is: ``work`` the default queue's ``jobrelay.work``, ``retry.<n>s`` the
tier ``jobrelay.retry.<n>s`` (whose expired messages dead-letter back to ``work``), ``work.Q``
the queue Q's ``jobrelay.work.Q``, ``retry.Q.<n>s`` Q's own tier ``jobrelay.retry.Q.<n>s``
(dead-lettering back to ``work.Q``, so a retry returns to the queue its job came from). Each
destination is also the routing key on the ``jobrelay`` exchange.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from jobrelay.domain.queues import (
    DEFAULT_QUEUE,
    check_queue_name,
    destination,
    parse_destination,
)

EXCHANGE = "jobrelay"
DEAD_LETTER_EXCHANGE = "jobrelay.dlx"
WORK_QUEUE = "jobrelay.work"
QUARANTINE_QUEUE = "jobrelay.quarantine"
QUARANTINE_ROUTING_KEY = "quarantine"
RETRY_QUEUE_PREFIX = "jobrelay.retry."


def work_routing_key(queue: str = DEFAULT_QUEUE) -> str:
    return destination(queue)


def work_queue(queue: str = DEFAULT_QUEUE) -> str:
    return WORK_QUEUE if queue == DEFAULT_QUEUE else f"{WORK_QUEUE}.{queue}"


def retry_queue(seconds: int, queue: str = DEFAULT_QUEUE) -> str:
    prefix = RETRY_QUEUE_PREFIX if queue == DEFAULT_QUEUE else f"{RETRY_QUEUE_PREFIX}{queue}."
    return f"{prefix}{seconds}s"


def retry_routing_key(seconds: int, queue: str = DEFAULT_QUEUE) -> str:
    return destination(queue, seconds)


@dataclass(frozen=True)
class Topology:
    """The queues and tiers in force.

    One work queue per queue name (``default`` always among them), and for each of them one
    fixed-TTL tier per configured retry delay.
    """

    retry_delays: tuple[int, ...]
    delivery_limit: int
    queues: tuple[str, ...] = field(default=(DEFAULT_QUEUE,))
    # How many cluster nodes hold each (quorum) queue; a smaller cluster holds it on all.
    quorum_size: int = 3
    # The local transport delays each row by its own time: any whole-second tier routes.
    # RabbitMQ has a fixed-TTL queue per declared tier only.
    dynamic_delays: bool = False

    def __post_init__(self) -> None:
        names = {check_queue_name(q) for q in self.queues} - {DEFAULT_QUEUE}
        object.__setattr__(self, "queues", (DEFAULT_QUEUE, *sorted(names)))

    @property
    def tiers(self) -> tuple[int, ...]:
        return tuple(sorted(set(self.retry_delays)))

    def routes(self, value: str) -> bool:
        """True when the destination has a queue; anything else is unroutable."""
        parsed = parse_destination(value)
        if parsed is None:
            return False
        queue, delay = parsed
        return queue in self.queues and (
            delay is None or delay in self.tiers or self.dynamic_delays
        )

    def retry_delay(self, asked: float) -> int:
        """The delay a retry asked to wait ``asked`` seconds really waits (``Retry(delay=)``).

        Whole seconds, rounded up; with fixed tiers (RabbitMQ) the smallest declared tier at
        or above that, and past the longest tier the longest one (a retry is never dropped
        for want of a queue). Never less than asked, except past the longest tier.
        """
        seconds = max(1, math.ceil(asked))
        if self.dynamic_delays:
            return seconds
        return next((t for t in self.tiers if t >= seconds), self.tiers[-1])

    @property
    def shortest_delay(self) -> int:
        return self.tiers[0]

    def names(self) -> list[str]:
        """Every queue declared on the broker, work queues and their tiers, then quarantine."""
        out: list[str] = []
        for queue in self.queues:
            out.append(work_queue(queue))
            out.extend(retry_queue(t, queue) for t in self.tiers)
        out.append(QUARANTINE_QUEUE)
        return out
