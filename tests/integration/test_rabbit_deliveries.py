"""A RabbitMQ consumer's deliveries reach its inbox as the channel's reader reads them.

aiormq runs a consumer's callback in a task of its own for each delivery and tracks that task
in three future stores; for a callback that only queues the delivery that was 10-12 % of a
worker's CPU in the no-op drain (issue 41). ``rabbit_deliveries._deliver_in_place`` takes
them in place instead, through aiormq's own ``_get_frame`` and ``_read_content``: this test
also holds those internals to what the wrapper expects (the lock file pins aiormq).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Coroutine
from typing import Any

import pytest

from jobrelay.transport.rabbitmq import RabbitTransport
from tests.integration.transport_fixtures import Backend, body_of, message

pytestmark = [pytest.mark.rabbitmq, pytest.mark.timeout(60)]

COUNT = 20


@pytest.fixture
async def backend(amqp_url: str) -> AsyncIterator[Backend]:
    made = Backend("rabbitmq", amqp_url)
    yield made
    await made.aclose()


async def test_deliveries_reach_the_inbox_without_a_task_each(backend: Backend) -> None:
    loop = asyncio.get_running_loop()
    callbacks: list[str] = []
    factory = loop.get_task_factory()

    def counting(loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, Any], **kw: Any) -> Any:
        if getattr(coro, "__qualname__", "") == "Consumer.on_delivered":
            callbacks.append(coro.__qualname__)
        if factory is not None:
            return factory(loop, coro, **kw)
        return asyncio.Task(coro, loop=loop, **kw)

    publisher = await backend.connected()
    for n in range(COUNT):
        await publisher.publish(message({"n": n}))
    consumer = await backend.connected()
    assert isinstance(consumer, RabbitTransport)
    loop.set_task_factory(counting)
    try:
        pump = backend.pump(consumer, prefetch=COUNT)
        deliveries = [await pump.get() for _ in range(COUNT)]
    finally:
        loop.set_task_factory(factory)
    assert [body_of(d)["n"] for d in deliveries] == list(range(COUNT))
    assert callbacks == []  # no delivery went through aiormq's task per callback
    assert await asyncio.gather(*(d.ack() for d in deliveries)) == [True] * COUNT
    await pump.stop()
    successor = backend.pump(await backend.connected())
    await successor.expect_none(0.5)  # every one was taken once and settled for good
