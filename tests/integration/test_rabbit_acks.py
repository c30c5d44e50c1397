"""Acks batched into ``basic.ack(multiple=True)`` frames (issue 23, item 1) on RabbitMQ.

A multiple ack settles every unsettled delivery up to its tag on the channel, so the one
thing it must never do is cover a delivery that did not ask: one still running, one waiting
in the prefetch. Here a delivery in the middle is left unsettled while its neighbours are
acked in the same turn: the run before it goes as one frame, the ones after it one by one,
and when the consumer stops only that delivery comes back.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from jobrelay.transport.base import Delivery
from jobrelay.transport.rabbitmq import RabbitTransport
from tests.integration.transport_fixtures import Backend, Pump, body_of, message, wait_until

pytestmark = [pytest.mark.rabbitmq, pytest.mark.timeout(60)]


@pytest.fixture
async def backend(amqp_url: str) -> AsyncIterator[Backend]:
    made = Backend("rabbitmq", amqp_url)
    yield made
    await made.aclose()


def _acks(transport: RabbitTransport) -> tuple[int, int]:
    """(frames, deliveries acked) over the transport's live consumers."""
    consumers = transport._consumers
    return sum(c.acks.frames for c in consumers), sum(c.acks.acked for c in consumers)


async def _take(backend: Backend, count: int) -> tuple[RabbitTransport, Pump, list[Delivery]]:
    publisher = await backend.connected()
    for n in range(count):
        await publisher.publish(message({"n": n}))
    consumer = await backend.connected()
    assert isinstance(consumer, RabbitTransport)
    pump = backend.pump(consumer)
    deliveries = [await pump.get() for _ in range(count)]
    assert [body_of(d)["n"] for d in deliveries] == list(range(count))
    return consumer, pump, deliveries


async def test_the_acks_of_one_turn_go_as_one_frame(backend: Backend) -> None:
    consumer, pump, deliveries = await _take(backend, 6)
    assert await asyncio.gather(*(d.ack() for d in deliveries)) == [True] * 6
    assert _acks(consumer) == (1, 6)
    await pump.stop()
    successor = backend.pump(await backend.connected())
    await successor.expect_none(0.5)  # all six were settled for good


async def test_a_multiple_ack_never_covers_a_delivery_that_did_not_ask(backend: Backend) -> None:
    consumer, pump, deliveries = await _take(backend, 6)
    held = deliveries.pop(2)
    assert await asyncio.gather(*(d.ack() for d in deliveries)) == [True] * 5
    # 0 and 1 in one frame; 3, 4 and 5 lie above the unsettled 2, each alone.
    assert _acks(consumer) == (4, 5)
    await pump.stop()
    await consumer.close()  # the broker requeues what is unsettled: only the held one
    successor = backend.pump(await backend.connected())
    again = await successor.get()
    assert body_of(again) == {"n": 2} and again.redelivered
    assert await held.ack() is False  # its channel is gone
    assert await again.ack() is True
    await successor.expect_none(0.5)


async def test_a_reject_between_acks_is_not_covered_and_stays_rejected(backend: Backend) -> None:
    consumer, pump, deliveries = await _take(backend, 4)
    assert await deliveries[1].reject() is True
    assert await asyncio.gather(*(deliveries[i].ack() for i in (0, 2, 3))) == [True] * 3
    assert _acks(consumer) == (1, 3)  # the rejected tag is settled: 0..3 is one run
    await pump.stop()
    await consumer.close()
    watcher = await backend.connected()
    await backend.pump(watcher).expect_none(0.5)

    async def quarantined() -> bool:
        return await watcher.quarantine_depth() == 1

    await wait_until(quarantined)
