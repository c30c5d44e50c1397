"""The RabbitMQ transport on a real 3-node cluster: queues replicated on every node, and a
connection that follows the cluster when the node it is connected to stops.

One throwaway cluster (``jobrelay.chaos.rabbit_cluster``) serves the module; it is stopped
and removed however the tests end.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator

import pytest

from jobrelay.chaos.rabbit_cluster import RabbitCluster, available
from jobrelay.errors import PublishError
from jobrelay.transport.base import OutgoingMessage
from jobrelay.transport.rabbitmq import RabbitTransport
from jobrelay.transport.topology import QUARANTINE_QUEUE, WORK_QUEUE, Topology

from ..conftest import _unavailable
from .ops_fixtures import eventually
from .transport_fixtures import Pump, body_of

pytestmark = [pytest.mark.long, pytest.mark.rabbitmq, pytest.mark.slow]
TOPOLOGY = Topology(retry_delays=(1,), delivery_limit=3)


@pytest.fixture(scope="module")
def cluster() -> Iterator[RabbitCluster]:
    if reason := available():
        _unavailable("a RabbitMQ cluster", reason)
    made = RabbitCluster(3, base_port=0)
    try:
        made.start()
        yield made
    finally:
        made.stop()


@pytest.fixture
async def transport(cluster: RabbitCluster) -> AsyncIterator[RabbitTransport]:
    for node in cluster.nodes:  # a test may have stopped one
        if not cluster.is_up(node.index):
            await asyncio.to_thread(cluster.start_node, node.index)
    made = RabbitTransport(cluster.broker_url(), TOPOLOGY, settle_grace_seconds=1.0)
    await made.connect()
    try:
        yield made
    finally:
        await made.close()


def _numbered(n: int) -> OutgoingMessage:
    return OutgoingMessage("work", json.dumps({"n": n}).encode(), message_id=f"m{n}")


def _connected_port(transport: RabbitTransport) -> int:
    connection = transport._connection  # the node in use is not public; tests need it
    assert connection is not None
    port = connection.url.port
    assert port is not None
    return port


def test_broker_declare_shows_every_queue_on_three_nodes_with_a_leader(
    cluster: RabbitCluster,
) -> None:
    cluster.add_vhost("declared")  # the CLI's default topology, apart from the other tests'
    env = {k: v for k, v in os.environ.items() if not k.startswith("JOBRELAY_")}
    env |= {
        "JOBRELAY_BROKER_URL": ",".join(url + "declared" for url in cluster.urls),
        "JOBRELAY_BROKER_MANAGEMENT_URL": ",".join(cluster.management_urls()),
    }
    done = subprocess.run(
        [sys.executable, "-m", "jobrelay", "broker", "declare"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    rows = {line.split()[0]: line for line in done.stdout.splitlines()[2:]}
    assert set(rows) >= {WORK_QUEUE, QUARANTINE_QUEUE, "jobrelay.retry.5s"}
    names = [node.name for node in cluster.nodes]
    for row in rows.values():
        _queue, leader, *members = row.replace(",", "").split()
        assert leader in names, row
        assert sorted(m.rstrip("*") for m in members) == sorted(names), row
        assert all(m.endswith("*") for m in members), row  # all online
    assert cluster.leader_of(WORK_QUEUE, vhost="declared") in {1, 2, 3}


async def test_a_stopped_node_moves_the_connection_and_nothing_is_lost(
    cluster: RabbitCluster, transport: RabbitTransport
) -> None:
    pump = Pump(transport, prefetch=5)
    sent: set[int] = set()
    for n in range(20):
        await transport.publish(_numbered(n))
        sent.add(n)
    seen: set[int] = set()
    for _ in range(10):
        delivery = await pump.get()
        seen.add(body_of(delivery)["n"])
        assert await delivery.ack()
    held = await pump.get()  # taken, not settled, when its node goes away
    before = _connected_port(transport)
    index = next(node.index for node in cluster.nodes if node.port == before)
    await asyncio.to_thread(cluster.stop_node, index)

    # The settle of a delivery from the lost connection is refused, and it comes back.
    assert await held.ack() is False
    # Publishing resumes on another node. A publish during the switch may fail: "unknown"
    # (no confirm) or nacked while the queue elects a new leader. The relay publishes such a
    # row again; nothing is silently lost.
    for n in range(20, 30):
        async with asyncio.timeout(60):
            while True:
                try:
                    await transport.publish(_numbered(n))
                    break
                except PublishError:
                    await asyncio.sleep(0.2)  # the reconnection or election is under way
        sent.add(n)
    assert _connected_port(transport) != before
    async with asyncio.timeout(60):
        while not sent <= seen:
            delivery = await pump.get(timeout=30)
            seen.add(body_of(delivery)["n"])
            await delivery.ack()
    assert seen == sent
    await pump.stop()


async def test_at_least_once_dead_lettering_keeps_a_message_while_its_target_is_missing(
    cluster: RabbitCluster, transport: RabbitTransport
) -> None:
    """A rejected delivery whose quarantine queue does not exist stays in the work queue
    (at-most-once dead-lettering would drop it) and reaches the quarantine queue once it is
    declared again. The cluster's dead-letter worker retries every 5 s (RabbitMQ's default is
    180 s, which is why the same test on the machine's broker is opt-in:
    ``JOBRELAY_SLOW_BROKER_TESTS=1`` in test_transport_contract.py)."""
    import aio_pika

    from jobrelay.transport.rabbitmq import declare_topology

    connection = await aio_pika.connect(cluster.urls[0])
    async with connection:
        channel = await connection.channel()
        await channel.queue_delete(QUARANTINE_QUEUE)
    await transport.publish(_numbered(1))
    pump = Pump(transport, prefetch=1)
    delivery = await pump.get()
    assert await delivery.reject()  # at-most-once would drop it right here
    await pump.stop()
    await declare_topology(cluster.broker_url(), TOPOLOGY)

    async def arrived() -> bool:
        return await transport.quarantine_depth() == 1

    await eventually(arrived, timeout=60, what="the rejected message in the quarantine queue")
