"""The RabbitMQ transport (aio-pika), and the declaration of jobrelay's topology.

What each choice protects against:

- Publishing uses a channel with publisher confirms AND ``on_return_raises=True`` and
  publishes ``mandatory``: the broker sends ``basic.return`` before the confirm for a message
  no queue took, so a confirm alone does not prove routing (aio-pika's default ignores it).
- aiormq matches a ``basic.return`` to its publish by ``message_id``; two publishes in flight
  with the same id can swap results and report an unroutable message as confirmed. Publishes
  sharing a message id therefore go out one at a time.
- Several comma-separated URLs are the nodes of one cluster (``rabbit_nodes.py``): the
  connection fails over between them. Every queue is a quorum queue whose initial group is
  ``topology.quorum_size`` nodes (RabbitMQ takes fewer when the cluster is smaller), so it
  keeps working while a minority of its members is down.
- Queues are quorum queues that dead-letter ``at-least-once`` (which needs ``x-overflow:
  reject-publish``): an expired retry or a rejected message stays in its queue until the
  target queue confirms it, instead of being dropped when the target is missing.
- The connection is robust (it reconnects and restores consumers), so a delivery received
  on a channel that has since closed must not be acked on its successor: its delivery tag
  means nothing there and the broker has already requeued the message. Such an ack or
  reject is a logged no-op that returns False. True means only that the frame was written
  on the delivery's own, still open, channel: AMQP does not answer ``basic.ack``.
- Each ``consume()`` has its own channel. Closing the iterator cancels the consumer and
  returns what was prefetched but not handed out. Deliveries already handed out stay
  settleable, so a draining worker can still ack them; the channel closes after the last
  one, or ``settle_grace_seconds`` later (``JOBRELAY_DRAIN_SECONDS`` in a process), or at
  ``close()``, and the broker requeues whatever is still unsettled then.

No aio-pika or aiormq type or exception leaves this module; they become ``jobrelay.errors``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import weakref
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

import aio_pika
import aiormq
from aio_pika.abc import (
    AbstractChannel,
    AbstractConnection,
    AbstractExchange,
    AbstractIncomingMessage,
    AbstractRobustChannel,
    AbstractRobustConnection,
)

from jobrelay.errors import PublishError, TransportError
from jobrelay.transport.base import Delivery, OutgoingMessage
from jobrelay.transport.rabbit_nodes import (
    FailoverConnection,
    connect_first,
    safe_url,
    split_broker_urls,
)
from jobrelay.transport.topology import (
    DEAD_LETTER_EXCHANGE,
    DEFAULT_QUEUE,
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

_RECONNECT_INTERVAL = 2.0  # seconds between attempts while the broker is down
# Connecting, declaring and queue reads: independent of the (often tighter) confirm timeout.
_BROKER_TIMEOUT = 10.0
# Library failures meaning "the broker, or our link to it, failed".
_AMQP_ERRORS = (aiormq.exceptions.AMQPError, aiormq.exceptions.ChannelInvalidStateError, OSError)
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


async def _declare(channel: AbstractChannel, topology: Topology) -> None:
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


def _declare_error(exc: BaseException) -> TransportError:
    if isinstance(exc, aiormq.exceptions.ChannelPreconditionFailed):
        return TransportError(
            "topology mismatch: a jobrelay queue exists with other arguments (another delivery "
            f"limit, or declared by an older version); delete it or align the settings: {exc}"
        )
    return TransportError(f"declaring the topology failed: {_short(exc)}")


async def declare_topology(url: str, topology: Topology) -> None:
    """Declare exchanges, queues and bindings; safe to run again with the same settings."""
    connection = await connect_first(split_broker_urls(url), aio_pika.Connection, _opened)
    try:
        async with connection.channel(publisher_confirms=False) as channel:
            await _declare(channel, topology)
    except _AMQP_ERRORS as exc:
        raise _declare_error(exc) from exc
    finally:
        with contextlib.suppress(*_AMQP_ERRORS):
            await connection.close()


@dataclass(eq=False)
class _Consumer:
    """The state of one ``consume()`` call and its channel."""

    channel: AbstractChannel
    inbox: asyncio.Queue[AbstractIncomingMessage | None] = field(default_factory=asyncio.Queue)
    unsettled: int = 0  # handed out, neither acked nor rejected yet
    stopping: bool = False
    deadline: asyncio.TimerHandle | None = None
    closer: asyncio.Task[None] | None = None

    async def on_message(self, message: AbstractIncomingMessage) -> None:
        if self.stopping:  # raced the basic.cancel: give it straight back
            await _quietly(message.nack(requeue=True))
        else:
            self.inbox.put_nowait(message)

    def stop(self, grace: float) -> None:
        """Close the channel once nothing is unsettled, or after ``grace`` seconds at most."""
        self.stopping = True
        if self.unsettled == 0:
            self.close_soon()
        elif self.deadline is None:
            self.deadline = asyncio.get_running_loop().call_later(grace, self.close_soon)

    def settled(self) -> None:
        self.unsettled -= 1
        if self.stopping and self.unsettled == 0:
            self.close_soon()

    def close_soon(self) -> None:
        """Close the channel: the broker requeues whatever is still unsettled on it."""
        if self.deadline is not None:
            self.deadline.cancel()
        if self.closer is None:
            if self.unsettled:
                log.warning(
                    "consumer closed with %d unsettled deliveries; the broker requeues them",
                    self.unsettled,
                    extra={"event": "unsettled_requeued", "count": self.unsettled},
                )
            self.closer = asyncio.create_task(_quietly(self.channel.close()))


class _RabbitDelivery:
    def __init__(self, message: AbstractIncomingMessage, consumer: _Consumer) -> None:
        self._message = message
        self._consumer = consumer
        self._headers: dict[str, object] = dict(message.headers or {})
        self._settled = False

    @property
    def body(self) -> bytes:
        return self._message.body

    @property
    def headers(self) -> Mapping[str, object]:
        return self._headers

    @property
    def redelivered(self) -> bool:
        return bool(self._message.redelivered)

    @property
    def delivery_count(self) -> int:
        # Quorum queues count returns (nack, channel or connection closed) in this header.
        count = self._headers.get("x-delivery-count", 0)
        return count if isinstance(count, int) else 0

    async def ack(self) -> bool:
        return await self._settle("ack")

    async def reject(self) -> bool:
        return await self._settle("reject")

    async def release(self) -> None:
        await self._settle("release")

    async def _settle(self, action: str) -> bool:
        """True once the frame is written on this delivery's open channel (no broker reply)."""
        if self._settled:
            log.warning("delivery already settled", extra={"event": "settle_ignored"})
            return False
        self._settled = True
        try:
            if _stale(self._message):
                raise aiormq.exceptions.ChannelInvalidStateError("channel closed")
            if action == "ack":
                await self._message.ack()
            elif action == "release":
                await self._message.nack(requeue=True)
            else:
                await self._message.reject(requeue=False)
        except _AMQP_ERRORS as exc:
            log.warning(
                "%s ignored: the channel this delivery came on is gone and the broker has "
                "requeued it (%s)",
                action,
                _short(exc),
                extra={"event": "settle_ignored", "action": action},
            )
            return False
        finally:
            self._consumer.settled()
        return True


class RabbitTransport:
    def __init__(
        self,
        url: str,
        topology: Topology,
        *,
        confirm_timeout: float = 10.0,
        settle_grace_seconds: float = 5.0,
    ) -> None:
        if settle_grace_seconds <= 0:
            raise ValueError("settle_grace_seconds must be positive")
        # After its iterator closes, how long a consumer's handed-out deliveries stay
        # settleable before its channel closes and the broker requeues them (the local
        # transport's counterpart is its visibility timeout). A process passes its drain
        # time, so a worker still finishing jobs after SIGTERM can ack them on this channel.
        self.settle_grace_seconds = settle_grace_seconds
        self._urls = split_broker_urls(url)
        self._topology = topology
        self._timeout = confirm_timeout
        self._connection: AbstractRobustConnection | None = None
        self._topology_channel: AbstractRobustChannel | None = None
        self._exchange: AbstractExchange | None = None
        self._publishing: AbstractChannel | None = None
        self._renewing = asyncio.Lock()
        self._consumers: set[_Consumer] = set()
        self._id_locks: weakref.WeakValueDictionary[str, asyncio.Lock] = (
            weakref.WeakValueDictionary()
        )

    # --- lifecycle ------------------------------------------------------------------------

    async def connect(self) -> None:
        """Connect (robustly) and declare the topology; calling it again only re-declares."""
        if self._connection is None or self._connection.is_closed:
            self._connection = await _opened(
                FailoverConnection(self._urls, reconnect_interval=_RECONNECT_INTERVAL),
                ",".join(self._urls),
            )
        connection = self._connection
        try:
            # A robust channel re-declares what it declared after every reconnection, so a
            # broker that lost its definitions gets them back before consumers resume.
            if self._topology_channel is None:
                self._topology_channel = await connection.channel(publisher_confirms=False)
            await _declare(self._topology_channel, self._topology)
            if self._exchange is None:
                await self._open_publisher(connection)
        except _AMQP_ERRORS as exc:
            await self.close()
            raise _declare_error(exc) from exc

    async def _open_publisher(self, connection: AbstractRobustConnection) -> None:
        channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
        self._exchange = await channel.get_exchange(EXCHANGE, ensure=False)
        self._publishing = channel

    async def _renew_publisher(self, nacked: AbstractExchange) -> None:
        """Publish on a new channel from now on, after ``nacked``'s channel got a nack.

        Seen on RabbitMQ 3.10 when a quorum queue's leader node stops: a channel that was
        restored onto another node while the old leader was shutting down keeps getting
        every publish nacked, though the queue has a new leader and a new channel's
        publishes are confirmed at once. A nack for any other reason (a full queue) loses
        nothing by a new channel either.
        """
        async with self._renewing:
            if self._exchange is not nacked or self._connection is None:
                return  # renewed by a concurrent publish, or closed
            old = self._publishing
            try:
                await self._open_publisher(self._connection)
            except _AMQP_ERRORS as exc:
                log.warning("cannot open a new publishing channel yet: %s", _short(exc))
                return
        log.info(
            "publishing on a new channel after a nack",
            extra={"event": "publisher_channel_renewed"},
        )
        if old is not None:
            await _quietly(old.close())

    async def close(self) -> None:
        """Close the connection: the broker requeues every unsettled delivery."""
        connection, self._connection = self._connection, None
        self._topology_channel = self._exchange = self._publishing = None
        for consumer in self._consumers:
            consumer.stopping = True
            consumer.inbox.put_nowait(None)
            if consumer.deadline is not None:
                consumer.deadline.cancel()
        self._consumers.clear()
        if connection is not None:
            await _quietly(connection.close())

    async def ping(self) -> None:
        """Answer from the broker itself: a passive declare of the work queue, or a connect."""
        if self._connection is not None:
            await self._message_count(work_queue())
            return
        try:
            async with asyncio.timeout(_BROKER_TIMEOUT):
                await (await connect_first(self._urls, aio_pika.Connection, _opened)).close()
        except TimeoutError as exc:
            raise TransportError("broker unreachable: no answer in time") from exc

    async def _message_count(self, queue_name: str) -> int:
        connection = self._require_connection()
        try:
            async with asyncio.timeout(_BROKER_TIMEOUT):
                async with connection.channel(publisher_confirms=False) as channel:
                    queue = await channel.declare_queue(queue_name, passive=True, robust=False)
        except _AMQP_ERRORS as exc:  # TimeoutError is an OSError
            raise TransportError(f"cannot read queue {queue_name}: {_short(exc)}") from exc
        return int(queue.declaration_result.message_count or 0)

    # --- publishing -----------------------------------------------------------------------

    async def publish(self, message: OutgoingMessage) -> None:
        if not self._topology.routes(message.destination):
            raise PublishError(f"unroutable: no queue for destination {message.destination!r}")
        exchange = self._exchange
        if exchange is None:
            raise PublishError("not connected: call connect() first")
        amqp_message = aio_pika.Message(
            message.body,
            headers=dict(message.headers),
            content_type="application/json",
            delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
            message_id=message.message_id or None,
        )
        try:
            async with asyncio.timeout(self._timeout), self._one_per_id(message.message_id):
                await exchange.publish(
                    amqp_message,
                    routing_key=message.destination,
                    mandatory=True,
                    timeout=self._timeout,
                )
        except aiormq.exceptions.PublishError as exc:  # basic.return
            raise PublishError(f"unroutable: {exc}") from exc
        except aiormq.exceptions.DeliveryError as exc:  # basic.nack
            await self._renew_publisher(exchange)
            raise PublishError(f"rejected by the broker: {exc}") from exc
        except aiormq.exceptions.ChannelNotFoundEntity as exc:  # exchange deleted
            raise PublishError(f"unroutable: {_short(exc)}") from exc
        except TimeoutError as exc:
            raise PublishError(f"no confirm within {self._timeout:g}s", unknown=True) from exc
        except _AMQP_ERRORS as exc:
            raise PublishError(f"connection lost: {_short(exc)}", unknown=True) from exc

    @contextlib.asynccontextmanager
    async def _one_per_id(self, message_id: str | None) -> AsyncIterator[None]:
        if not message_id:
            yield
            return
        # Weak values: an id's lock lives exactly as long as some publish holds or awaits it.
        lock = self._id_locks.setdefault(message_id, asyncio.Lock())
        async with lock:
            yield

    async def quarantine_depth(self) -> int:
        return await self._message_count(QUARANTINE_QUEUE)

    async def work_ready(self) -> int:
        # A passive declare counts ready messages only; every work queue of the topology.
        return sum([await self._message_count(work_queue(q)) for q in self._topology.queues])

    # --- consuming ------------------------------------------------------------------------

    async def consume(self, prefetch: int, queue: str = DEFAULT_QUEUE) -> AsyncIterator[Delivery]:
        if prefetch < 1:
            raise ValueError("prefetch must be at least 1")
        if queue not in self._topology.queues:
            raise TransportError(f"cannot consume from queue {queue!r}: not in the topology")
        connection = self._require_connection()
        name = work_queue(queue)
        try:
            # A channel (and prefetch) of its own: one queue's slow jobs never hold another's.
            channel = await connection.channel(publisher_confirms=False)
            consumer = _Consumer(channel)
            await channel.set_qos(prefetch_count=prefetch)
            declared = await channel.declare_queue(name, passive=True)
            tag = await declared.consume(consumer.on_message, no_ack=False)
        except _AMQP_ERRORS as exc:
            raise TransportError(f"cannot consume from {name}: {_short(exc)}") from exc
        self._consumers.add(consumer)
        try:
            while (message := await consumer.inbox.get()) is not None:
                if _stale(message):
                    continue  # came on a channel lost since; the broker has requeued it
                consumer.unsettled += 1
                yield _RabbitDelivery(message, consumer)
        finally:
            if consumer.unsettled and self._connection is not None:
                # Deliveries in flight stay settleable for a while (a draining worker acks
                # them); only the prefetched rest goes back now.
                await _quietly(declared.cancel(tag))
                while not consumer.inbox.empty():
                    if (left := consumer.inbox.get_nowait()) is not None:
                        await _quietly(left.nack(requeue=True))
            consumer.stop(self.settle_grace_seconds)
            if consumer.closer is not None:
                self._consumers.discard(consumer)
                await asyncio.shield(consumer.closer)

    def _require_connection(self) -> AbstractRobustConnection:
        if self._connection is None:
            raise TransportError("not connected: call connect() first")
        return self._connection


_C = TypeVar("_C", bound=AbstractConnection)


async def _opened(connection: _C, url: str) -> _C:
    """Connect, closing the half-made connection on failure.

    ``aio_pika.connect*()`` leaves a failed connection object to its ``__del__``, which then
    schedules ``close()`` on whatever loop is current, or none; so we build it ourselves.
    """
    try:
        await connection.connect(timeout=_BROKER_TIMEOUT)
    except BaseException as exc:
        with contextlib.suppress(Exception):
            await connection.close()
        if isinstance(exc, _AMQP_ERRORS):
            shown = ",".join(safe_url(u) for u in url.split(","))
            raise TransportError(f"cannot connect to {shown}: {_short(exc)}") from exc
        raise
    return connection


def _stale(message: AbstractIncomingMessage) -> bool:
    """True once the channel a message came on has closed (a delivery tag is per channel)."""
    try:
        return message.channel.is_closed
    except aiormq.exceptions.ChannelInvalidStateError:  # aio-pika >= 10 raises instead
        return True


async def _quietly(operation: Any) -> None:
    """Await a best-effort broker call whose failure only means the channel is gone."""
    try:
        await operation
    except _AMQP_ERRORS as exc:
        log.debug("ignored broker error during cleanup: %s", _short(exc))


def _short(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"


__all__ = [
    "RabbitTransport",
    "declare_topology",
    "retry_queue_arguments",
    "work_queue_arguments",
]
