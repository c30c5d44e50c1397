"""The RabbitMQ transport across a restart of its broker, on a node of the test's own
(``own_rabbitmq_cluster``: a cluster of one on free ports, started and removed by the
tests): the machine's own broker is never stopped."""

from __future__ import annotations

import asyncio
import json

import pytest

from jobrelay.chaos.rabbit_cluster import RabbitCluster
from jobrelay.errors import PublishError, TransportError
from jobrelay.transport.base import OutgoingMessage
from jobrelay.transport.rabbitmq import RabbitTransport, declare_topology
from jobrelay.transport.topology import Topology

from .ops_fixtures import eventually
from .transport_fixtures import body_of

pytestmark = [pytest.mark.long, pytest.mark.rabbitmq]
TOPOLOGY = Topology(retry_delays=(1,), delivery_limit=3)


async def test_a_consumer_opened_while_the_broker_is_down_waits_for_it(
    own_rabbitmq_cluster: RabbitCluster,
) -> None:
    """Chaos soak (stop 55): a worker that started as the broker stopped exited 1, its first
    consumer's channel refused on a closed connection, and its restarts, with the broker
    still down, exited 2. A consumer opened during the outage now waits for the connection,
    as the consumers already open do, and then consumes."""
    url = own_rabbitmq_cluster.broker_url()
    await declare_topology(url, TOPOLOGY)
    transport = RabbitTransport(url, TOPOLOGY, settle_grace_seconds=1.0)
    await transport.connect()
    connection = transport._connection  # whether it is up is not public; the test needs it
    assert connection is not None
    try:
        await asyncio.to_thread(own_rabbitmq_cluster.stop_node, 1)

        async def down() -> bool:
            return not connection.connected.is_set()

        await eventually(down, timeout=30, what="the connection to drop")
        deliveries = transport.consume(1)
        first = asyncio.create_task(anext(deliveries))
        await asyncio.to_thread(own_rabbitmq_cluster.start_node, 1)
        assert not first.done() or first.exception() is None, first.exception()

        async def published() -> bool:
            try:
                await transport.publish(
                    OutgoingMessage("work", json.dumps({"n": 1}).encode(), message_id="m1")
                )
            except (PublishError, TransportError):
                return False  # the connection is still coming back
            return True

        await eventually(published, timeout=60, what="a publish after the restart")
        async with asyncio.timeout(60):
            delivery = await first
        assert body_of(delivery) == {"n": 1}
        assert await delivery.ack()
        await deliveries.aclose()  # type: ignore[attr-defined]
    finally:
        await transport.close()
