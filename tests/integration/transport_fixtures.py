"""Helpers for the transport contract suite, and the consumer run in subprocesses.

``Backend`` hides which transport a test runs against (local on SQLite or PostgreSQL, or
RabbitMQ in a fresh vhost) and cleans up after it. ``Pump`` drains a ``consume()``
iterator into a queue in the background, so a test can wait for a delivery with a timeout
without cancelling the iterator (cancelling a pending ``anext`` ends an async generator for
good).

Run as ``python -m tests.integration.transport_fixtures MODE KIND URL [PATH ...]`` this
module is a consumer process: ``hold`` takes one delivery and sleeps until killed; ``drain``
records every message number it receives in a file, then acks, until SIGTERM.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from jobrelay.storage.engine import create_engine
from jobrelay.transport.base import Delivery, OutgoingMessage, Transport
from jobrelay.transport.local import LocalTransport
from jobrelay.transport.rabbitmq import RabbitTransport, declare_topology
from jobrelay.transport.topology import Topology

# The default queue and one named queue, "images", each with tiers 1 s and 3 s.
TOPOLOGY = Topology(retry_delays=(1, 3), delivery_limit=2, queues=("images",))
# Short, so what a stopped consumer left unsettled comes back quickly (local: visibility
# timeout; RabbitMQ: the grace before a stopped consumer's channel closes).
LOCAL_VISIBILITY = 1.0
LOCAL_POLL = 0.05
# The draining consumer processes keep the default's order of magnitude: they are live, and a
# live consumer descheduled for seconds must keep what it holds.
DRAIN_VISIBILITY = 30.0


def message(body: Any, destination: str = "work", **headers: str) -> OutgoingMessage:
    return OutgoingMessage(destination=destination, body=json.dumps(body).encode(), headers=headers)


def body_of(delivery: Delivery) -> Any:
    return json.loads(delivery.body)


class Backend:
    """Makes transports of one kind and closes them all when the test ends."""

    def __init__(self, kind: str, url: str) -> None:
        self.kind = kind
        self.url = url
        self.is_rabbit = kind == "rabbitmq"
        self._engine = None if self.is_rabbit else create_engine(url)
        self._transports: list[Transport] = []
        self._pumps: list[Pump] = []

    def transport(
        self,
        *,
        visibility_seconds: float = LOCAL_VISIBILITY,
        poll_seconds: float = LOCAL_POLL,
        topology: Topology = TOPOLOGY,
        confirm_timeout: float = 10.0,
        settle_grace_seconds: float = LOCAL_VISIBILITY,
        clock: Any = None,
    ) -> Transport:
        made: Transport
        if self._engine is None:
            made = RabbitTransport(
                self.url,
                topology,
                confirm_timeout=confirm_timeout,
                settle_grace_seconds=settle_grace_seconds,
            )
        else:
            made = LocalTransport(
                self._engine,
                topology,
                visibility_seconds=visibility_seconds,
                poll_seconds=poll_seconds,
                clock=clock,
            )
        self._transports.append(made)
        return made

    async def connected(self, **options: Any) -> Transport:
        made = self.transport(**options)
        await made.connect()
        return made

    def pump(self, transport: Transport, prefetch: int = 10, queue: str = "default") -> Pump:
        made = Pump(transport, prefetch, queue)
        self._pumps.append(made)
        return made

    async def declare(self) -> None:
        """What ``jobrelay broker declare`` does (the local queue is declared by migration)."""
        if self.is_rabbit:
            await declare_topology(self.url, TOPOLOGY)
        else:
            await (await self.connected()).close()

    async def aclose(self) -> None:
        """Stop consumers, then transports, then the engine, so no connection is stranded."""
        for pump in self._pumps:
            await pump.stop()
        for made in self._transports:
            await made.close()
        if self._engine is not None:
            await self._engine.dispose()


@contextlib.asynccontextmanager
async def unreachable(kind: str, tmp_path: Path) -> AsyncIterator[Transport]:
    """A transport of ``kind`` whose broker is not there (or, for SQLite, not migrated)."""
    if kind == "rabbitmq":
        yield RabbitTransport("amqp://guest:guest@127.0.0.1:1/", TOPOLOGY)
        return
    if kind == "local-postgres":
        engine = create_engine("postgresql://postgres@127.0.0.1:1/nothing")
    else:  # a database that was never migrated has no queue table
        engine = create_engine(f"sqlite:///{tmp_path / 'unmigrated.db'}")
    try:
        yield LocalTransport(engine, TOPOLOGY)
    finally:
        await engine.dispose()


class NoDelivery(AssertionError):
    pass


class Pump:
    """Pulls deliveries from ``consume(prefetch, queue)`` into a queue, in a background task."""

    def __init__(self, transport: Transport, prefetch: int = 10, queue: str = "default") -> None:
        self.iterator = transport.consume(prefetch, queue=queue)
        self.deliveries: asyncio.Queue[Delivery] = asyncio.Queue()
        self.task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        async for delivery in self.iterator:
            self.deliveries.put_nowait(delivery)

    async def get(self, timeout: float = 10.0) -> Delivery:
        getting = asyncio.ensure_future(self.deliveries.get())
        done, _ = await asyncio.wait(
            {getting, self.task}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
        )
        if getting in done:
            return getting.result()
        getting.cancel()
        if self.task.done():
            self.task.result()  # re-raise what ended the iterator
            raise AssertionError("the delivery iterator ended")
        raise NoDelivery(f"no delivery within {timeout}s")

    async def expect_none(self, within: float) -> None:
        """Fail if anything is delivered within ``within`` seconds."""
        try:
            delivery = await self.get(timeout=within)
        except NoDelivery:
            return
        raise AssertionError(f"unexpected delivery: {delivery.body!r}")

    async def stop(self) -> None:
        """Close the iterator, as a worker does when it stops consuming."""
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)
        await close_iterator(self.iterator)


async def close_iterator(iterator: AsyncIterator[Delivery]) -> None:
    aclose = getattr(iterator, "aclose", None)
    if aclose is not None:
        await aclose()


async def wait_until(predicate: Any, timeout: float = 10.0, interval: float = 0.1) -> None:
    """Poll an async predicate until it holds; fail after ``timeout`` seconds."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not await predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"condition not met within {timeout}s")
        await asyncio.sleep(interval)


# --- the subprocess consumer ----------------------------------------------------------------


async def _subprocess_main(mode: str, kind: str, url: str, paths: list[str]) -> None:
    backend = Backend(kind, url)
    visibility = LOCAL_VISIBILITY if mode == "hold" else DRAIN_VISIBILITY
    transport = await backend.connected(visibility_seconds=visibility)
    try:
        if mode == "hold":
            async for delivery in transport.consume(1):
                print("HELD", delivery.body.decode(), flush=True)
                await asyncio.Event().wait()  # until SIGKILL
        else:
            await _drain(transport, Path(paths[0]))
    finally:
        await backend.aclose()


async def _drain(transport: Transport, record: Path) -> None:
    async def consume() -> None:
        iterator = transport.consume(5)
        try:
            async for delivery in iterator:
                with record.open("a") as out:
                    out.write(f"{body_of(delivery)['n']}\n")
                await asyncio.sleep(0.005)  # some work, so the consumers interleave
                await delivery.ack()
        finally:
            await close_iterator(iterator)

    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    task = asyncio.create_task(consume())
    print("READY", flush=True)
    await asyncio.wait({task, asyncio.create_task(stop.wait())}, return_when="FIRST_COMPLETED")
    if task.done():
        task.result()  # a consumer error fails the run
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


if __name__ == "__main__":
    asyncio.run(_subprocess_main(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]))


async def rabbitmqctl(*args: str) -> str:
    """``rabbitmqctl -q ARGS`` off the event loop; its stdout (fails the test on an error)."""
    done = await asyncio.to_thread(
        subprocess.run,
        ["rabbitmqctl", "-q", *args],
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    )
    return done.stdout
