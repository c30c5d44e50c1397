"""A RabbitMQ delivery as the worker reads it, straight from aiormq's frame.

Its own module: the consumer (``rabbit_deliveries``) hands it out and the ack batcher
(``rabbit_acks``) settles it, and neither imports the other's home for it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import aiormq
from aiormq.abc import DeliveredMessage


class Inbound:
    """A delivery as the worker reads it: aiormq's own frame fields, read once.

    aio-pika's ``IncomingMessage`` decoded every property of every delivery (timestamps,
    expiration, fourteen fields through a guarded ``__setattr__``) and its consumer wrapper
    ran the callback in a task of its own on top of aiormq's: 14 µs a delivery of a worker's
    ~200 µs per no-op job (measured, issue 41). What is read here is what the worker reads."""

    __slots__ = ("_channel", "body", "delivery_tag", "headers", "message_id", "redelivered")

    def __init__(self, message: DeliveredMessage) -> None:
        properties = message.header.properties
        self._channel = message.channel
        self.body: bytes = message.body
        self.headers: Mapping[str, Any] = properties.headers or {}
        self.message_id: str | None = properties.message_id
        # A tag of 0 with ``multiple`` would ack the whole channel: every basic.deliver has one.
        assert message.delivery_tag, "a delivery without a tag"
        self.delivery_tag: int = message.delivery_tag
        self.redelivered = bool(message.redelivered)

    @property
    def channel(self) -> aiormq.abc.AbstractChannel:
        """The channel it came on; raises once that channel has closed (its tag is void)."""
        if self._channel.is_closed:
            raise aiormq.exceptions.ChannelInvalidStateError("channel closed")
        return self._channel

    async def ack(self, *, multiple: bool = False) -> None:
        await self.channel.basic_ack(self.delivery_tag, multiple=multiple)

    async def nack(self, *, requeue: bool = True) -> None:
        await self.channel.basic_nack(self.delivery_tag, requeue=requeue)

    async def reject(self, *, requeue: bool = False) -> None:
        await self.channel.basic_reject(self.delivery_tag, requeue=requeue)


__all__ = ["Inbound"]
