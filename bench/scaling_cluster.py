"""The scaling table's cluster column: the cluster module, the broker URL, free ports.

``jobrelay.chaos.rabbit_cluster`` (a throwaway N-node RabbitMQ cluster on loopback) is
imported if this checkout has it; without it ``RabbitCluster`` is None and the cluster column
is skipped.
"""

from __future__ import annotations

import socket
from typing import Any

import httpx
from bench_env import BenchFailure

from jobrelay.errors import TransportError
from jobrelay.transport.rabbitmq import RabbitTransport
from jobrelay.transport.topology import Topology

try:  # the cluster column needs it; a checkout without it skips that column
    from jobrelay.chaos.rabbit_cluster import ClusterError, RabbitCluster
except ImportError:  # pragma: no cover - depends on the checkout
    RabbitCluster = None  # type: ignore[assignment,misc]
    ClusterError = BenchFailure  # type: ignore[assignment,misc]


def unavailable() -> str | None:
    """Why no cluster can be started here (rabbitmq-server missing, not root…); None if it can."""
    if RabbitCluster is None:
        return "jobrelay.chaos.rabbit_cluster is not in this checkout"
    from jobrelay.chaos.rabbit_cluster import available

    return available()


async def cluster_broker_url(cluster: Any) -> str:
    """Every node's URL, comma-separated (each process connects to one of them, starting at
    a random node, and fails over to the next), after checking that the cluster answers."""
    every = str(cluster.broker_url())
    transport = RabbitTransport(every, Topology(retry_delays=(5, 30), delivery_limit=5))
    try:
        await transport.ping()
    except TransportError as exc:
        raise BenchFailure(f"the cluster does not answer: {exc}") from None
    return every


def queue_members(cluster: Any, queue: str) -> str:
    """Leader and members of a quorum queue, from node 1's management API."""
    url = str(cluster.management_urls()[0]).replace("guest:guest@", "")
    try:
        answer = httpx.get(f"{url}/api/queues/%2F/{queue}", auth=("guest", "guest"), timeout=5)
        answer.raise_for_status()
        info = answer.json()
    except (httpx.HTTPError, ValueError) as exc:
        return f"? ({exc})"
    return f"{len(info.get('members', []))} nodes (leader {info.get('leader')})"


def free_base_port(nodes: int) -> int:
    """A base port whose node ports (AMQP, +10000 management, +20000 distribution) are all
    free: not the cluster module's default, which a neighbour's run may be using."""
    for base in range(5701, 6000, 10):
        ports = [base + i + offset for i in range(nodes) for offset in (0, 10000, 20000)]
        if all(port_free(port) for port in ports):
            return base
    raise BenchFailure("no free ports for a RabbitMQ cluster between 5701 and 6000")


def port_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


__all__ = [
    "ClusterError",
    "RabbitCluster",
    "cluster_broker_url",
    "free_base_port",
    "port_free",
    "queue_members",
    "unavailable",
]
