"""One ``basic.ack`` frame for many deliveries: the acks of a consumer's channel, batched.

A worker commits the outcomes of a batch of jobs in one statement; acking each of them with
a frame of its own costs the broker 60-90 µs a message, one ``basic.ack(multiple=True)``
about 13 (issue 23). ``multiple`` acks every unsettled delivery up to its tag on the channel,
including ones still running or waiting in the prefetch, so it may only cover a contiguous
run of tags that all asked to be acked: the run from the oldest unsettled tag up. An ack
above a tag still unsettled (a straggler) goes alone. Nothing is acked that did not ask, and
every ack is sent after its own caller's commit, as before.

Delivery tags are per channel: after a robust reconnection the channel is new, its tags start
again, and the old ones mean nothing (the broker requeued those messages). The tags tracked
here are the current channel's; an ack of an older one fails as a stale channel does.
"""

from __future__ import annotations

import asyncio

import aiormq

from jobrelay.transport.rabbit_inbound import Inbound


def _channel_of(message: Inbound) -> object | None:
    try:
        return message.channel
    except aiormq.exceptions.ChannelInvalidStateError:  # aio-pika >= 10 on a closed channel
        return None


class AckBatcher:
    def __init__(self) -> None:
        self._channel: object | None = None  # the channel the tracked tags belong to
        # Every delivery received on that channel and not settled yet, in tag order.
        self._unsettled: dict[int, Inbound] = {}
        self._asked: dict[int, asyncio.Future[None]] = {}
        self._flushing: asyncio.Task[None] | None = None
        self.frames = 0  # ack frames written (tests and the bench read it)
        self.acked = 0  # deliveries those frames acked

    def received(self, message: Inbound) -> None:
        channel = _channel_of(message)
        if channel is not self._channel:
            # A new channel: what was tracked is of the old one, whose acks cannot be sent.
            self._fail(aiormq.exceptions.ChannelInvalidStateError("channel reopened"))
            self._channel = channel
            self._unsettled = {}
        self._unsettled[_tag(message)] = message

    def forget(self, message: Inbound) -> None:
        """``message`` was settled another way (rejected, released, given back)."""
        if self._unsettled.get(_tag(message)) is message:
            del self._unsettled[_tag(message)]

    async def ack(self, message: Inbound) -> None:
        """Return once a frame that acks ``message`` is written; raise as ``ack()`` does."""
        tag = _tag(message)
        if self._unsettled.get(tag) is not message or tag in self._asked:
            await message.ack()  # not tracked here (an older channel): alone
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._asked[tag] = future
        if self._flushing is None or self._flushing.done():
            self._flushing = asyncio.create_task(self._flush())
        # Shielded: a cancelled caller does not stop the frame its neighbours wait on.
        await asyncio.shield(future)

    async def _flush(self) -> None:
        await asyncio.sleep(0)  # the acks asked in this turn of the loop go together
        while self._asked:
            asked, self._asked = self._asked, {}
            run_end: int | None = None
            for tag in self._unsettled:
                if tag not in asked:
                    break
                run_end = tag
            try:
                if run_end is not None:
                    await self._unsettled[run_end].ack(multiple=True)
                    self._sent([t for t in asked if t <= run_end], asked)
                for tag in sorted(t for t in asked if run_end is None or t > run_end):
                    await self._unsettled[tag].ack()
                    self._sent([tag], asked)
            except Exception as exc:  # the channel is gone: every ack still waiting fails
                for future in asked.values():
                    if not future.done():
                        future.set_exception(exc)

    def _sent(self, tags: list[int], asked: dict[int, asyncio.Future[None]]) -> None:
        self.frames += 1
        self.acked += len(tags)
        for tag in tags:
            self._unsettled.pop(tag, None)
            if not asked[tag].done():
                asked[tag].set_result(None)

    def _fail(self, exc: Exception) -> None:
        asked, self._asked = self._asked, {}
        for future in asked.values():
            if not future.done():
                future.set_exception(exc)


def _tag(message: Inbound) -> int:
    tag = message.delivery_tag
    assert tag is not None  # consumed with manual acks: every delivery has one
    return tag


__all__ = ["AckBatcher"]
