"""The RabbitMQ transport (aio-pika): publishing, consuming, settling.

Its neighbours: ``rabbit_nodes.py`` connects to the nodes of a cluster and fails over between
them; ``rabbit_declare.py`` declares the topology (quorum queues, at-least-once
dead-lettering, retry tiers); ``rabbit_management.py`` reads where each queue lives. What
each choice here protects against:

- Publishing uses a channel with publisher confirms AND ``on_return_raises=True`` and
  publishes ``mandatory``: the broker sends ``basic.return`` before the confirm for a message
  no queue took, so a confirm alone does not prove routing (aio-pika's default ignores it).
- aiormq matches a ``basic.return`` to its publish by ``message_id``; two publishes in flight
  with the same id can swap results and report an unroutable message as confirmed. Publishes
  sharing a message id therefore go out one at a time.
- The connection is robust (it reconnects and restores consumers), so a delivery received
  on a channel that has since closed must not be acked on its successor: its delivery tag
  means nothing there and the broker has already requeued the message. Such an ack or
  reject is a logged no-op that returns False. True means only that the frame was written
  on the delivery's own, still open, channel: AMQP does not answer ``basic.ack``.
- Each ``consume()`` has its own channel. Closing the iterator cancels the consumer and
  returns what was prefetched but not handed out. Deliveries already handed out stay
  settleable, so a draining worker can still ack them; the channel closes after the last
  one, or ``settle_grace_seconds`` later (``JOBRELAY_DRAIN_SECONDS`` in a process), or at
  ``close()``, and the broker requeues whatever is still unsettled then. With
  ``keep_in_flight`` (a worker leaving a paused queue) there is no such deadline: its long
  jobs are still running and must not be handed to another consumer.
- Acks are batched (issue 23): the acks asked for in one turn of the event loop go as one
  ``basic.ack(multiple=True)`` for the contiguous run of delivery tags from the oldest
  unsettled one, and the stragglers (a tag above one still unsettled) one by one. A tag still
  unsettled (running, waiting in the prefetch, being rejected) is never covered, so a multiple
  ack settles exactly the deliveries that asked for it; each ``ack()`` returns once the frame
  that covers it is written. Rejects and releases go singly, at once.
- What was prefetched and never handed out goes back uncounted: a quorum queue counts every
  ``nack(requeue=True)`` in ``x-delivery-count`` towards its delivery limit, so a message
  held by consumers that kept leaving (pauses, restarts) would be dead-lettered though no
  worker ever started it. Instead a copy (same body, headers and message id) is published
  with a confirm, and only then is the held one acked; a copy that cannot be confirmed falls
  back to the counted nack. The copy starts the broker's count afresh.

No aio-pika or aiormq type or exception leaves these modules; they become ``jobrelay.errors``.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncIterator
from typing import Any, cast

import aiormq
from aio_pika.abc import (
    AbstractChannel,
    AbstractExchange,
    AbstractQueue,
    AbstractRobustChannel,
    AbstractRobustConnection,
)

from jobrelay.domain.queues import DEFAULT_QUEUE
from jobrelay.errors import PublishError, TransportError
from jobrelay.transport.base import Delivery, OutgoingMessage, QueueStats
from jobrelay.transport.rabbit_declare import (
    declare,
    declare_error,
    declare_topology,
    retry_queue_arguments,
    work_queue_arguments,
)
from jobrelay.transport.rabbit_deliveries import Consumer, RabbitDelivery, quietly, stale
from jobrelay.transport.rabbit_inbound import Inbound
from jobrelay.transport.rabbit_nodes import (
    AMQP_ERRORS,
    BROKER_TIMEOUT,
    FailoverConnection,
    connect_first,
    opened,
    short,
    split_broker_urls,
)
from jobrelay.transport.topology import (
    EXCHANGE,
    QUARANTINE_QUEUE,
    Topology,
    work_queue,
    work_routing_key,
)

_PERSISTENT = 2  # AMQP delivery mode: written to disk by the broker

log = logging.getLogger("jobrelay.transport.rabbitmq")

_RECONNECT_INTERVAL = 2.0  # seconds between attempts while the broker is down


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
        self._consumers: set[Consumer] = set()
        # The message ids being published, each with a future done when its publish is:
        # a publish of the same id waits for it (see the module's docstring).
        self._publishing_ids: dict[str, asyncio.Future[None]] = {}

    # --- lifecycle ------------------------------------------------------------------------

    async def connect(self) -> None:
        """Connect (robustly) and declare the topology; calling it again only re-declares."""
        if self._connection is None or self._connection.is_closed:
            self._connection = await opened(
                FailoverConnection(self._urls, reconnect_interval=_RECONNECT_INTERVAL),
                ",".join(self._urls),
            )
        connection = self._connection
        try:
            # A robust channel re-declares what it declared after every reconnection, so a
            # broker that lost its definitions gets them back before consumers resume.
            if self._topology_channel is None:
                self._topology_channel = await connection.channel(publisher_confirms=False)
            await declare(self._topology_channel, self._topology)
            if self._exchange is None:
                await self._open_publisher(connection)
        except AMQP_ERRORS as exc:
            await self.close()
            raise declare_error(exc) from exc

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
            except AMQP_ERRORS as exc:
                log.warning("cannot open a new publishing channel yet: %s", short(exc))
                return
        log.info(
            "publishing on a new channel after a nack",
            extra={"event": "publisher_channel_renewed"},
        )
        if old is not None:
            await quietly(old.close())

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
            await quietly(connection.close())

    async def ping(self) -> None:
        """Answer from the broker itself: a passive declare of the work queue, or a connect."""
        if self._connection is not None:
            await self._message_count(work_queue())
            return
        try:
            async with asyncio.timeout(BROKER_TIMEOUT):
                await (await connect_first(self._urls)).close()
        except TimeoutError as exc:
            raise TransportError("broker unreachable: no answer in time") from exc

    async def _message_count(self, queue_name: str) -> int:
        return int((await self._declared(queue_name)).message_count or 0)

    async def _declared(self, queue_name: str) -> Any:
        connection = self._require_connection()
        try:
            async with asyncio.timeout(BROKER_TIMEOUT):
                async with connection.channel(publisher_confirms=False) as channel:
                    queue = await channel.declare_queue(queue_name, passive=True, robust=False)
        except AMQP_ERRORS as exc:  # TimeoutError is an OSError
            raise TransportError(f"cannot read queue {queue_name}: {short(exc)}") from exc
        return queue.declaration_result

    # --- publishing -----------------------------------------------------------------------

    async def publish(self, message: OutgoingMessage) -> None:
        if not self._topology.routes(message.destination):
            raise PublishError(f"unroutable: no queue for destination {message.destination!r}")
        if self._exchange is None:
            raise PublishError("not connected: call connect() first")
        # aiormq's own frame properties, not an aio-pika ``Message`` and ``Exchange.publish``
        # on top: the same frames, and about a tenth of the relay's CPU per row less.
        properties = aiormq.spec.Basic.Properties(
            content_type="application/json",
            delivery_mode=_PERSISTENT,
            headers=dict(message.headers),
            message_id=message.message_id or None,
        )
        message_id = message.message_id
        try:
            async with asyncio.timeout(self._timeout):
                while message_id and (earlier := self._publishing_ids.get(message_id)):
                    await asyncio.shield(earlier)
                if message_id:
                    self._publishing_ids[message_id] = asyncio.get_running_loop().create_future()
                # Read after the wait: a nack meanwhile may have renewed the channel.
                exchange, publishing = self._exchange, self._publishing
                try:
                    if exchange is None or publishing is None:
                        raise PublishError("not connected: the transport was closed")
                    if publishing.is_closed:  # fail now, as aio-pika's publish does
                        raise aiormq.exceptions.ChannelInvalidStateError("channel closed")
                    # aiormq's own channel (its abstract type does not name ``wait``).
                    channel = cast(aiormq.Channel, await publishing.get_underlay_channel())
                    # ``wait=False``: aiormq's default waits, holding the channel's lock, until
                    # the writer task has written this frame, so a window of publishes queued
                    # on the lock one by one (and Python 3.11's lock scans its waiters on
                    # every acquire). The confirm is awaited anyway, and bounded by the
                    # timeout above (no second timer of aiormq's own per publish).
                    await channel.basic_publish(
                        message.body,
                        exchange=exchange.name,
                        routing_key=message.destination,
                        properties=properties,
                        mandatory=True,
                        wait=False,
                    )
                finally:
                    if message_id:
                        self._publishing_ids.pop(message_id).set_result(None)
        except aiormq.exceptions.PublishError as exc:  # basic.return
            raise PublishError(f"unroutable: {exc}") from exc
        except aiormq.exceptions.DeliveryError as exc:  # basic.nack
            await self._renew_publisher(exchange)
            raise PublishError(f"rejected by the broker: {exc}") from exc
        except aiormq.exceptions.ChannelNotFoundEntity as exc:  # exchange deleted
            raise PublishError(f"unroutable: {short(exc)}") from exc
        except TimeoutError as exc:
            raise PublishError(f"no confirm within {self._timeout:g}s", unknown=True) from exc
        except AMQP_ERRORS as exc:
            raise PublishError(f"connection lost: {short(exc)}", unknown=True) from exc

    async def quarantine_depth(self) -> int:
        return await self._message_count(QUARANTINE_QUEUE)

    async def work_ready(self) -> int:
        # A passive declare counts ready messages only; every work queue of the topology.
        return sum([await self._message_count(work_queue(q)) for q in self._topology.queues])

    async def queue_stats(self) -> list[QueueStats]:
        """Ready messages and consumers per work queue (a passive declare); unacked messages
        need the management API, so in flight is unknown here."""
        out = []
        for name in self._topology.queues:
            result = await self._declared(work_queue(name))
            out.append(
                QueueStats(name, result.message_count or 0, result.consumer_count or 0, None)
            )
        return out

    # --- consuming ------------------------------------------------------------------------

    async def consume(
        self, prefetch: int, queue: str = DEFAULT_QUEUE, *, keep_in_flight: bool = False
    ) -> AsyncIterator[Delivery]:
        if prefetch < 1:
            raise ValueError("prefetch must be at least 1")
        if queue not in self._topology.queues:
            raise TransportError(f"cannot consume from queue {queue!r}: not in the topology")
        connection = self._require_connection()
        name = work_queue(queue)
        consumer, declared, tag = await self._open_consumer(connection, name, queue, prefetch)
        self._consumers.add(consumer)
        try:
            while (message := await consumer.inbox.get()) is not None:
                if stale(message):
                    continue  # came on a channel lost since; the broker has requeued it
                consumer.unsettled += 1
                yield RabbitDelivery(message, consumer)
        finally:
            consumer.stopping = True  # from here on a late delivery goes straight back
            consumer.forget_reopening()
            if self._connection is not None:
                # Deliveries in flight stay settleable (a draining worker acks them); only
                # the prefetched rest goes back now, before the channel can close on it.
                await quietly(declared.cancel(tag))
            while not consumer.inbox.empty():
                if (left := consumer.inbox.get_nowait()) is not None and not stale(left):
                    await consumer.give_back(left)
            consumer.stop(None if keep_in_flight else self.settle_grace_seconds)
            if consumer.closer is not None:
                self._consumers.discard(consumer)
                await asyncio.shield(consumer.closer)

    async def _give_back(self, message: Inbound, *, queue: str) -> None:
        """Return a message no one started without counting it towards the delivery limit:
        a confirmed copy first, then the ack of the held one (a crash between the two leaves
        a duplicate, which the job's state absorbs). Unconfirmed: the counted nack."""
        # AMQP field values, passed through as they came.
        headers = {k: v for k, v in message.headers.items() if k != "x-delivery-count"}
        copy = OutgoingMessage(work_routing_key(queue), message.body, headers, message.message_id)
        try:
            await self.publish(copy)
        except PublishError as exc:
            log.warning(
                "could not return a prefetched message uncounted (%s); requeued instead",
                exc,
                extra={"event": "give_back_counted"},
            )
            await quietly(message.nack(requeue=True))
            return
        await quietly(message.ack())

    async def _open_consumer(
        self, connection: AbstractRobustConnection, name: str, queue: str, prefetch: int
    ) -> tuple[Consumer, AbstractQueue, str]:
        """A consumer of ``name`` on a channel (and prefetch) of its own: one queue's slow
        jobs never hold another's. Opened while the connection is down (the broker
        restarting), it waits for the connection to come back, as the consumers already open
        do: a worker that starts, or resumes a queue, during a broker restart is not ended
        by it (chaos soak: a worker exited 1 starting as the broker stopped). A refusal of
        the broker's (the queue missing, access denied) is a ``TransportError`` at once."""
        pause = 0.1
        while True:
            channel: AbstractChannel | None = None
            try:
                channel = connection.channel(publisher_confirms=False)
                await channel
                consumer = Consumer(channel, functools.partial(self._give_back, queue=queue))
                await channel.set_qos(prefetch_count=prefetch)
                declared = await channel.declare_queue(name, passive=True)
                return consumer, declared, await consumer.start(name)
            except (*AMQP_ERRORS, RuntimeError) as exc:
                await _discard(channel)
                if connection.is_closed or isinstance(exc, aiormq.exceptions.AMQPChannelError):
                    raise TransportError(f"cannot consume from {name}: {short(exc)}") from exc
                log.warning(
                    "cannot consume from %s yet, the broker connection is down: %s",
                    name,
                    short(exc),
                    extra={"event": "consume_waiting", "queue": queue},
                )
            except BaseException:
                await _discard(channel)
                raise
            await asyncio.sleep(pause)  # the connection's close may not have been seen yet
            pause = min(pause * 2, _RECONNECT_INTERVAL)
            await connection.connected.wait()

    def _require_connection(self) -> AbstractRobustConnection:
        if self._connection is None:
            raise TransportError("not connected: call connect() first")
        return self._connection


async def _discard(channel: AbstractChannel | None) -> None:
    """A channel whose opening failed, closed if it was opened at all."""
    if channel is not None and getattr(channel, "is_initialized", False) and not channel.is_closed:
        await quietly(channel.close())


__all__ = [
    "RabbitTransport",  # and, re-exported from rabbit_declare:
    "declare_topology",
    "retry_queue_arguments",
    "work_queue_arguments",
]
