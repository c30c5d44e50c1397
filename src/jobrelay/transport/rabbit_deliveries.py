"""A consumer's deliveries on RabbitMQ: what one ``consume()`` holds (its channel, its inbox,
its unsettled count, its batched acks) and each delivery's settle on the channel it came on.

Kept apart from ``rabbitmq`` (the transport: connection, publishing, topology) because this is
the part a worker's drain lives in: a delivery is settled only on its own channel while that
channel is open (a tag means nothing on another), and the channel closes after the last
settle, or after the grace a stopped consumer is given.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import aiormq
from aio_pika.abc import AbstractRobustChannel
from aiormq.abc import DeliveredMessage
from pamqp import commands as spec
from pamqp.header import ContentHeader

from jobrelay.transport.rabbit_acks import AckBatcher
from jobrelay.transport.rabbit_inbound import Inbound
from jobrelay.transport.rabbit_nodes import AMQP_ERRORS, short

# The transport's logger: these lines were its own before the split.
log = logging.getLogger("jobrelay.transport.rabbitmq")


def _deliver_in_place(channel: aiormq.Channel, tag: str, consumer: Consumer) -> None:
    """The consumer's deliveries taken into its inbox as the channel's reader reads them.

    aiormq runs a consumer's callback in a task of its own for every delivery, and tracks that
    task in the channel's, the connection's and the client's future stores (a set entry and a
    done-callback each): in a worker's profile of the no-op drain that was 10-12 % of its CPU,
    for a callback that only puts the delivery in the inbox. Here the channel's own
    ``_on_deliver_frame`` is wrapped, for this consumer's tag only, to read the content as
    aiormq does (``_get_frame``, ``_read_content``) and hand it over at once. A stopping
    consume, and any other consumer on the channel, keep aiormq's path (``on_delivered``).
    ``tests/integration/test_rabbit_deliveries.py`` holds aiormq's internals to this."""
    own = channel._on_deliver_frame

    async def on_deliver_frame(frame: spec.Basic.Deliver) -> None:
        if frame.consumer_tag != tag or consumer.stopping:
            await own(frame)
            return
        header = await channel._get_frame()
        if not isinstance(header, ContentHeader):
            raise ValueError(f"Unexpected frame {header!r} instead of ContentHeader", header)
        consumer.delivered(await channel._read_content(frame, header))

    channel._on_deliver_frame = on_deliver_frame  # type: ignore[method-assign]


@dataclass(eq=False)
class Consumer:
    """The state of one ``consume()`` call and its channel.

    Its ``basic.consume`` is made on aiormq's channel under the robust one, so a delivery is
    an ``Inbound``; aio-pika restores only the consumers made through its own queues, so this
    one is made again (same tag) each time the robust channel reopens after a reconnection."""

    channel: AbstractRobustChannel
    give_back_copy: Callable[[Inbound], Awaitable[None]]
    inbox: asyncio.Queue[Inbound | None] = field(default_factory=asyncio.Queue)
    unsettled: int = 0  # handed out, neither acked nor rejected yet
    stopping: bool = False
    deadline: asyncio.TimerHandle | None = None
    closer: asyncio.Task[None] | None = None
    acks: AckBatcher = field(default_factory=AckBatcher)
    queue: str = ""
    tag: str | None = None

    async def start(self, queue: str) -> str:
        """``basic.consume`` on ``queue``, again after every reopening of the channel."""
        self.queue = queue
        self.tag = await self._consume()
        self.channel.reopen_callbacks.add(self._reconsume)
        return self.tag

    async def _consume(self) -> str:
        underlay = await self.channel.get_underlay_channel()
        # Our own tag, so that the in-place path is in before the first delivery can come.
        tag = self.tag or f"jobrelay.{uuid.uuid4().hex}"
        if isinstance(underlay, aiormq.Channel):
            _deliver_in_place(underlay, tag, self)
        ok = await underlay.basic_consume(
            self.queue, self.on_delivered, no_ack=False, consumer_tag=tag
        )
        assert ok.consumer_tag is not None
        if self.stopping and self.tag is not None:
            # The consume() ended while this was on its way: its cancel may have reached the
            # broker first, and this consumer would outlive it.
            await quietly(underlay.basic_cancel(self.tag))
        return str(ok.consumer_tag)

    async def _reconsume(self, _channel: object) -> None:
        if not self.stopping:
            await self._consume()

    def forget_reopening(self) -> None:
        self.channel.reopen_callbacks.discard(self._reconsume)

    async def on_delivered(self, delivered: DeliveredMessage) -> None:
        """aiormq's consumer callback, in a task aiormq makes for each delivery: only while
        the consume stops (or on a channel the in-place path is not in, ``_deliver_in_place``)."""
        message = self._received(delivered)
        if self.stopping:  # raced the basic.cancel: give it straight back, uncounted
            await self.give_back(message)
        else:
            self.inbox.put_nowait(message)

    def delivered(self, delivered: DeliveredMessage) -> None:
        """A delivery of a running consume, from the channel's reader (``_deliver_in_place``)."""
        self.inbox.put_nowait(self._received(delivered))

    def _received(self, delivered: DeliveredMessage) -> Inbound:
        message = Inbound(delivered)
        self.acks.received(message)
        return message

    async def give_back(self, message: Inbound) -> None:
        try:
            await self.give_back_copy(message)
        finally:
            self.acks.forget(message)

    def stop(self, grace: float | None) -> None:
        """Close the channel once nothing is unsettled, or after ``grace`` seconds at most
        (``None``: no deadline, only the last settle or ``close()`` closes it)."""
        self.stopping = True
        if self.unsettled == 0:
            self.close_soon()
        elif self.deadline is None and grace is not None:
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
            self.closer = asyncio.create_task(quietly(self.channel.close()))


class RabbitDelivery:
    def __init__(self, message: Inbound, consumer: Consumer) -> None:
        self._message = message
        self._consumer = consumer
        self._headers: Mapping[str, object] = message.headers
        self._settled = False

    @property
    def body(self) -> bytes:
        return self._message.body

    @property
    def headers(self) -> Mapping[str, object]:
        return self._headers

    @property
    def redelivered(self) -> bool:
        return self._message.redelivered

    @property
    def delivery_count(self) -> int:
        # Quorum queues count returns (nack, channel or connection closed) in this header.
        count = self._headers.get("x-delivery-count", 0)
        return count if isinstance(count, int) else 0

    async def ack(self) -> bool:
        return await self._settle("ack")

    async def reject(self) -> bool:
        return await self._settle("reject")

    def outcome_committed(self) -> None:
        """Nothing to do: the broker counts the prefetch window, and frees it at the ack."""

    async def release(self) -> None:
        await self._settle("release")

    async def _settle(self, action: str) -> bool:
        """True once the frame is written on this delivery's open channel (no broker reply)."""
        if self._settled:
            log.warning("delivery already settled", extra={"event": "settle_ignored"})
            return False
        self._settled = True
        try:
            if stale(self._message):
                raise aiormq.exceptions.ChannelInvalidStateError("channel closed")
            if action == "ack":
                await self._consumer.acks.ack(self._message)
                return True
            try:
                if action == "release":
                    await self._message.nack(requeue=True)
                else:
                    await self._message.reject(requeue=False)
            finally:
                self._consumer.acks.forget(self._message)
        except AMQP_ERRORS as exc:
            log.warning(
                "%s ignored: the channel this delivery came on is gone and the broker has "
                "requeued it (%s)",
                action,
                short(exc),
                extra={"event": "settle_ignored", "action": action},
            )
            return False
        finally:
            self._consumer.settled()
        return True


def stale(message: Inbound) -> bool:
    """True once the channel a message came on has closed (a delivery tag is per channel)."""
    try:
        return message.channel.is_closed
    except aiormq.exceptions.ChannelInvalidStateError:  # aio-pika >= 10 raises instead
        return True


async def quietly(operation: Any) -> None:
    """Await a best-effort broker call whose failure only means the channel is gone."""
    try:
        await operation
    except AMQP_ERRORS as exc:
        log.debug("ignored broker error during cleanup: %s", short(exc))
