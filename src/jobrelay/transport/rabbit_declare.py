"""Declaring jobrelay's topology on RabbitMQ: the queue arguments and what each one is for.

``topology.py`` names the queues; this module says how they are made:

- Every queue is a quorum queue whose initial group is ``topology.quorum_size`` nodes
  (RabbitMQ takes fewer when the cluster is smaller), so it keeps working while a minority of
  its members is down.
- Queues dead-letter ``at-least-once`` (which needs ``x-overflow: reject-publish``): an
  expired retry or a rejected message stays in its queue until the target queue confirms
  it, instead of being dropped when the target is missing.
- Each retry tier has one fixed TTL, so its messages expire in order (no head-of-line
  blocking), and dead-letters back to the work queue of its own queue.
"""

from __future__ import annotations

import contextlib
import logging
import re
from typing import Any

import aio_pika
import aiormq
from aio_pika.abc import AbstractChannel

from jobrelay.domain.queues import DEFAULT_QUEUE
from jobrelay.errors import TransportError
from jobrelay.transport.rabbit_nodes import AMQP_ERRORS, connect_first, short, split_broker_urls
from jobrelay.transport.topology import (
    DEAD_LETTER_EXCHANGE,
    EXCHANGE,
    QUARANTINE_QUEUE,
    QUARANTINE_ROUTING_KEY,
    Topology,
    retry_queue,
    retry_routing_key,
    work_queue,
    work_routing_key,
)

log = logging.getLogger("jobrelay.transport.rabbitmq")

_SAFE_DEAD_LETTERING = {"x-dead-letter-strategy": "at-least-once", "x-overflow": "reject-publish"}


_GROUP_SIZE = "x-quorum-initial-group-size"


def _quorum(size: int) -> dict[str, Any]:
    return {"x-queue-type": "quorum", _GROUP_SIZE: size}


async def _declare_queue(
    channel: AbstractChannel, name: str, arguments: dict[str, Any]
) -> aio_pika.abc.AbstractQueue:
    """Declare a queue; one declared by a version before the group size was set is kept.

    RabbitMQ refuses a redeclaration with arguments the queue was not created with, and
    queues made before jobrelay set ``x-quorum-initial-group-size`` have none. The argument
    only matters at creation (membership changes with ``rabbitmq-queues add_member``), so
    such a queue is declared as it is rather than failing every start after an upgrade.
    """
    try:
        return await channel.declare_queue(name, durable=True, arguments=arguments)
    except aiormq.exceptions.ChannelPreconditionFailed as exc:
        if _GROUP_SIZE not in str(exc) or "current is none" not in str(exc):
            raise
    await channel.reopen()  # the refusal closed the channel
    log.warning(
        "queue %s predates the quorum group size setting; its membership is kept as it is",
        name,
        extra={"event": "queue_group_size_unset", "queue": name},
    )
    legacy = {k: v for k, v in arguments.items() if k != _GROUP_SIZE}
    return await channel.declare_queue(name, durable=True, arguments=legacy)


def work_queue_arguments(topology: Topology) -> dict[str, Any]:
    return {
        **_quorum(topology.quorum_size),
        "x-dead-letter-exchange": DEAD_LETTER_EXCHANGE,
        "x-dead-letter-routing-key": QUARANTINE_ROUTING_KEY,
        "x-delivery-limit": topology.delivery_limit,
        **_SAFE_DEAD_LETTERING,
    }


def retry_queue_arguments(
    seconds: int, queue: str = DEFAULT_QUEUE, *, quorum_size: int = Topology.quorum_size
) -> dict[str, Any]:
    # One fixed TTL per queue: every message expires in order, no head-of-line blocking.
    # Expired messages go back to the work queue of the tier's own queue.
    return {
        **_quorum(quorum_size),
        "x-message-ttl": seconds * 1000,
        "x-dead-letter-exchange": EXCHANGE,
        "x-dead-letter-routing-key": work_routing_key(queue),
        **_SAFE_DEAD_LETTERING,
    }


async def declare(channel: AbstractChannel, topology: Topology) -> None:
    direct = aio_pika.ExchangeType.DIRECT
    exchange = await channel.declare_exchange(EXCHANGE, direct, durable=True)
    dlx = await channel.declare_exchange(DEAD_LETTER_EXCHANGE, direct, durable=True)
    for name in topology.queues:
        work = await _declare_queue(channel, work_queue(name), work_queue_arguments(topology))
        await work.bind(exchange, work_routing_key(name))
        for seconds in topology.tiers:
            tier = await _declare_queue(
                channel,
                retry_queue(seconds, name),
                retry_queue_arguments(seconds, name, quorum_size=topology.quorum_size),
            )
            await tier.bind(exchange, retry_routing_key(seconds, name))
    quarantine = await _declare_queue(channel, QUARANTINE_QUEUE, _quorum(topology.quorum_size))
    await quarantine.bind(dlx, QUARANTINE_ROUTING_KEY)


# RabbitMQ's refusal of a work queue declared with another delivery limit than it has.
_LIMIT_MISMATCH = re.compile(
    r"inequivalent arg 'x-delivery-limit' for queue '([^']*)'.*current is (?:the value )?'(\d+)'"
)


def declare_error(exc: BaseException) -> TransportError:
    if isinstance(exc, aiormq.exceptions.ChannelPreconditionFailed):
        if found := _LIMIT_MISMATCH.search(str(exc)):
            # Typically an upgrade from the older default (5): RabbitMQ changes no argument
            # of an existing queue, so the operator chooses.
            queue, current = found.groups()
            return TransportError(
                f"topology mismatch: queue {queue} exists with delivery limit {current}, not "
                f"JOBRELAY_DELIVERY_LIMIT; a queue argument cannot change in place: set "
                f"JOBRELAY_DELIVERY_LIMIT={current} to keep the queue as it is, or drain and "
                "delete it to declare it anew (docs/reference/topology.md)"
            )
        return TransportError(
            "topology mismatch: a jobrelay queue exists with other arguments (another delivery "
            f"limit, or declared by an older version); delete it or align the settings: {exc}"
        )
    return TransportError(f"declaring the topology failed: {short(exc)}")


async def declare_topology(url: str, topology: Topology) -> None:
    """Declare exchanges, queues and bindings; safe to run again with the same settings."""
    connection = await connect_first(split_broker_urls(url))
    try:
        async with connection.channel(publisher_confirms=False) as channel:
            await declare(channel, topology)
    except AMQP_ERRORS as exc:
        raise declare_error(exc) from exc
    finally:
        with contextlib.suppress(*AMQP_ERRORS):
            await connection.close()


__all__ = [
    "declare",
    "declare_error",
    "declare_topology",
    "retry_queue_arguments",
    "work_queue_arguments",
]
