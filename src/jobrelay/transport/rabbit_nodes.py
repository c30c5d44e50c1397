"""The nodes of one RabbitMQ cluster: which URL to connect to, and failing over between them.

``JOBRELAY_BROKER_URL`` may name several nodes, comma-separated. A process connects to a
node that answers (starting at a random one, so processes spread over the cluster) and, when
its connection drops, to the next one, round robin, so a
stopped node costs a reconnection, not an outage. What is safe across the switch is the
transport's business (``rabbitmq.py``): a delivery that came on the lost connection is never
acked on the new one, the broker has requeued it, and a publish without a confirm is
"unknown" for the relay to retry. The quorum queues themselves live on a majority of the
nodes, so whichever node we reach serves them.

aio-pika's ``RobustConnection`` reconnects to one URL only. ``FailoverConnection`` keeps its
restore machinery (channels, QoS, consumers and declarations come back by themselves) and
changes only which URL each connection attempt uses; the override is the one attempt method
of that class, and the cluster tests fail if a new aio-pika changes it.
"""

from __future__ import annotations

import contextlib
import logging
import random
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar
from urllib.parse import urlsplit

import aio_pika
import aiormq
from aio_pika.abc import AbstractConnection
from aio_pika.exceptions import CONNECTION_EXCEPTIONS
from yarl import URL

from jobrelay.errors import TransportError

log = logging.getLogger("jobrelay.transport.rabbitmq")

_ATTEMPT = "_RobustConnection__connect_transport"  # aio-pika's one connection attempt


def split_broker_urls(value: str) -> list[str]:
    """The node URLs of a comma-separated ``JOBRELAY_BROKER_URL``; ValueError when one is bad.

    All nodes must share the scheme, credentials and virtual host: they are one broker.
    """
    urls = [part.strip() for part in value.split(",") if part.strip()]
    if not urls:
        raise ValueError("expected 'local' or amqp://user:pass@host:5672/vhost[,amqp://…]")
    shared: set[tuple[str, str, str]] = set()
    for url in urls:
        parts = urlsplit(url)
        if parts.scheme not in {"amqp", "amqps"} or not parts.hostname:
            raise ValueError(f"expected 'local' or amqp://user:pass@host:5672/vhost, got {url!r}")
        shared.add((parts.scheme, parts.username or "", parts.path.strip("/")))
    if len(shared) > 1:
        raise ValueError("the nodes of one broker must share scheme, user and virtual host")
    return urls


def safe_url(url: str) -> str:
    return str(URL(url).with_password("***")) if URL(url).password else url


class FailoverConnection(aio_pika.RobustConnection):
    """A robust connection that moves to the next node of the cluster on every new attempt."""

    def __init__(self, urls: list[str], **kwargs: Any) -> None:
        if not urls:
            raise ValueError("at least one broker URL is required")
        super().__init__(URL(urls[0]), **kwargs)
        self._node_urls = [URL(u) for u in urls]
        # Each process starts at a random node, so many processes spread their connections
        # (and the channel work that comes with them) over the cluster.
        self._next_node = random.randrange(len(urls))

    @property
    def node_url(self) -> str:
        """The node this connection is (or was last) connected to, password hidden."""
        return safe_url(str(self.url))

    async def _RobustConnection__connect_transport(self) -> None:
        # One attempt tries every node once, starting after the node we last used: after a
        # connection loss the node that dropped us is tried last.
        attempt: Callable[[aio_pika.RobustConnection], Awaitable[None]] = getattr(
            aio_pika.RobustConnection, _ATTEMPT
        )
        last: BaseException | None = None
        for _ in range(len(self._node_urls)):
            self.url = self._node_urls[self._next_node]
            self._next_node = (self._next_node + 1) % len(self._node_urls)
            try:
                await attempt(self)
            except CONNECTION_EXCEPTIONS as exc:
                last = exc
                if len(self._node_urls) > 1:
                    log.warning(
                        "broker node %s unreachable, trying the next one: %s",
                        self.node_url,
                        exc,
                        extra={"event": "broker_node_unreachable", "node": self.node_url},
                    )
                continue
            if len(self._node_urls) > 1:
                log.info(
                    "connected to broker node %s",
                    self.node_url,
                    extra={"event": "broker_node_connected", "node": self.node_url},
                )
            return
        assert last is not None
        raise last


# Connecting, declaring and queue reads: independent of the (often tighter) confirm timeout.
BROKER_TIMEOUT = 10.0
# Library failures meaning "the broker, or our link to it, failed".
AMQP_ERRORS = (aiormq.exceptions.AMQPError, aiormq.exceptions.ChannelInvalidStateError, OSError)

_C = TypeVar("_C", bound=AbstractConnection)


async def opened(connection: _C, url: str) -> _C:
    """Connect, closing the half-made connection on failure.

    ``aio_pika.connect*()`` leaves a failed connection object to its ``__del__``, which then
    schedules ``close()`` on whatever loop is current, or none; so we build it ourselves.
    """
    try:
        await connection.connect(timeout=BROKER_TIMEOUT)
    except BaseException as exc:
        with contextlib.suppress(Exception):
            await connection.close()
        if isinstance(exc, AMQP_ERRORS):
            shown = ",".join(safe_url(u) for u in url.split(","))
            raise TransportError(f"cannot connect to {shown}: {short(exc)}") from exc
        raise
    return connection


async def connect_first(urls: list[str]) -> aio_pika.Connection:
    """A plain (not robust) connection to the first node that answers, for one-shot work."""
    errors: list[str] = []
    for url in urls:
        try:
            return await opened(aio_pika.Connection(URL(url)), url)
        except TransportError as exc:
            errors.append(str(exc))
    raise TransportError("; ".join(errors))


def short(exc: BaseException) -> str:
    """An exception in one line: its type and the first line of its message."""
    lines = str(exc).strip().splitlines()
    if "Connection.OpenOk" in str(exc) and "Connection.Close" in str(exc):
        # aiormq's report of a refused connection.open: the vhost does not exist, or this
        # user has no permissions on it (RabbitMQ answers NOT_ALLOWED to both).
        return "the broker refused the vhost: it does not exist or this user may not use it"
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"


if not hasattr(aio_pika.RobustConnection, _ATTEMPT):  # pragma: no cover - version guard
    raise ImportError(
        "this aio-pika has no RobustConnection connection-attempt method to fail over with"
    )
