"""The peers: the same durable hand-off, done with the raw client libraries and nothing else.

Each peer does the one thing a jobrelay phase cannot avoid, on the same services, with the
same payload, so ``ours / peer`` reads as "the share of the floor we reach":

- ``starlette_accept``: a bare Starlette + asyncpg endpoint (``starlette_peer.py``) doing
  the accept phase's exact transaction and token check, under the same uvicorn process
  count, driven by the same client at the same concurrency (the accept phase's peer).
- ``db_transactions``: a jobs-like row plus an outbox-like row inserted in ONE transaction
  (the accept path's unavoidable write), 8 connections, prepared statements, no HTTP.
- ``broker_publish``: persistent messages into a durable quorum queue with publisher
  confirms, mandatory and returns raised, 500 in flight (the relay's unavoidable work).
- ``broker_consume``: those messages consumed with manual acks at prefetch 200 (the floor
  under a worker, which also claims, exports, commits and records events per job).
- ``broker_consume_batched``: the drain's broker floor at jobrelay's own shape: one channel
  per worker process, the workers' prefetch, one ``ack(multiple=True)`` per half prefetch.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import aio_pika
import asyncpg
from aio_pika.abc import AbstractIncomingMessage, AbstractQueue
from bench_client import api_client, submit, wait_ready
from bench_env import BENCH_DIR, RoleProcess, free_port

PEER_QUEUE = "bench.peer"

# The scratch table pair mirrors jobs/outbox (columns and indexes), but nothing else.
_PEER_SCHEMA = (
    """CREATE TABLE peer_jobs (
        id varchar(36) PRIMARY KEY, type varchar(64) NOT NULL, account_id varchar(64) NOT NULL,
        params json NOT NULL, idempotency_key varchar(255), request_hash varchar(64) NOT NULL,
        state varchar(16) NOT NULL, attempt integer NOT NULL DEFAULT 0,
        max_attempts integer NOT NULL, created_at timestamptz NOT NULL,
        updated_at timestamptz NOT NULL)""",
    "CREATE INDEX ON peer_jobs (state, updated_at)",
    "CREATE INDEX ON peer_jobs (account_id, created_at)",
    """CREATE TABLE peer_outbox (
        id bigserial PRIMARY KEY,
        job_id varchar(36) NOT NULL REFERENCES peer_jobs (id) ON DELETE CASCADE,
        destination varchar(64) NOT NULL, body text NOT NULL, headers json NOT NULL,
        created_at timestamptz NOT NULL, published_at timestamptz,
        publish_attempts integer NOT NULL DEFAULT 0)""",
    "CREATE INDEX ON peer_outbox (job_id)",
    "CREATE INDEX ON peer_outbox (id) WHERE published_at IS NULL",
)
_INSERT_JOB = """INSERT INTO peer_jobs (id, type, account_id, params, idempotency_key,
    request_hash, state, max_attempts, created_at, updated_at)
    VALUES ($1, 'report.export', $2, $3, $4, $5, 'queued', 3, $6, $6)"""
_INSERT_OUTBOX = """INSERT INTO peer_outbox (job_id, destination, body, headers, created_at)
    VALUES ($1, 'work', $2, '{}', $3)"""


@dataclass(frozen=True)
class PeerFigure:
    name: str
    count: int
    seconds: float

    @property
    def rate(self) -> float:
        return self.count / self.seconds


async def create_peer_tables(dsn: str) -> None:
    setup = await asyncpg.connect(dsn)
    try:
        for statement in _PEER_SCHEMA:
            await setup.execute(statement)
    finally:
        await setup.close()


async def db_transactions(dsn: str, n: int, body: str, connections: int = 8) -> PeerFigure:
    """N transactions of (job row + outbox row) over ``connections`` connections."""
    conns = [await asyncpg.connect(dsn) for _ in range(connections)]
    numbers = iter(range(n))

    async def lane(conn: asyncpg.Connection) -> None:
        for i in numbers:
            job_id, now = str(uuid.uuid4()), datetime.now(UTC)
            params = json.dumps({"accountId": "acme", "period": "2020-05"})
            async with conn.transaction():
                key = f"peer-{job_id}-{i}"
                await conn.execute(_INSERT_JOB, job_id, "acme", params, key, "0" * 64, now)
                await conn.execute(_INSERT_OUTBOX, job_id, body, now)

    try:
        started = time.perf_counter()
        await asyncio.gather(*(lane(conn) for conn in conns))
        seconds = time.perf_counter() - started
    finally:
        for conn in conns:
            await conn.close()
    return PeerFigure("asyncpg job+outbox tx, 8 conns", n, seconds)


async def starlette_accept(
    dsn: str,
    token: str,
    n: int,
    concurrency: int,
    key_prefix: str,
    env: dict[str, str],
    log_dir: Path,
    processes: int = 1,
) -> PeerFigure:
    """N ``POST /v1/jobs`` of ``bench.noop`` to the bare Starlette peer, as the accept phase
    sends them to jobrelay; timed from the first POST (start-up not counted)."""
    port = free_port()
    script = str(BENCH_DIR / "starlette_peer.py")
    peer_env = env | {"STARLETTE_PEER_DSN": dsn}
    peer = RoleProcess.spawn_command(
        "starlette-peer", [script, str(port), str(processes)], peer_env, log_dir
    )
    try:
        async with api_client(port, token, concurrency) as client:
            await wait_ready(client, peer, 60.0)
            submitted = await submit(client, n, concurrency, key_prefix, "noop")
    finally:
        await peer.stop()
    label = "process" if processes == 1 else "processes"
    return PeerFigure(f"Starlette + asyncpg, {processes} {label}", n, submitted.seconds)


async def broker_publish(
    url: str, n: int, body: bytes, headers: dict[str, str], in_flight: int = 500
) -> PeerFigure:
    """N persistent, mandatory, confirmed publishes into a fresh durable quorum queue."""
    connection = await aio_pika.connect(url)
    try:
        channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
        await channel.declare_queue(PEER_QUEUE, durable=True, arguments={"x-queue-type": "quorum"})
        slots = asyncio.Semaphore(in_flight)
        counter = itertools.count()

        async def publish_one() -> None:
            async with slots:
                message = aio_pika.Message(
                    body,
                    headers=dict(headers),
                    content_type="application/json",
                    delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
                    message_id=f"peer:{next(counter)}",
                )
                await channel.default_exchange.publish(
                    message, routing_key=PEER_QUEUE, mandatory=True
                )

        started = time.perf_counter()
        await asyncio.gather(*(publish_one() for _ in range(n)))
        seconds = time.perf_counter() - started
    finally:
        await connection.close()
    return PeerFigure(f"aio-pika confirmed publish, {in_flight} in flight", n, seconds)


async def broker_consume(url: str, n: int, prefetch: int = 200) -> PeerFigure:
    """Consume and ack the N messages ``broker_publish`` left in the queue."""
    connection = await aio_pika.connect(url)
    try:
        channel = await connection.channel()
        await channel.set_qos(prefetch_count=prefetch)
        queue = await channel.get_queue(PEER_QUEUE)
        done = asyncio.Event()
        acked = 0

        async def on_message(message: AbstractIncomingMessage) -> None:
            nonlocal acked
            await message.ack()
            acked += 1
            if acked >= n:
                done.set()

        started = time.perf_counter()
        tag = await queue.consume(on_message, no_ack=False)
        await done.wait()
        seconds = time.perf_counter() - started
        await queue.cancel(tag)
        await queue.delete(if_unused=False, if_empty=False)
    finally:
        await connection.close()
    return PeerFigure(f"aio-pika consume + ack, prefetch {prefetch}", n, seconds)


async def broker_consume_batched(url: str, n: int, consumers: int, prefetch: int) -> PeerFigure:
    """The drain's broker floor: ``consumers`` channels (one per worker process), each with
    ``prefetch`` unacked, acking with ``multiple=True`` once per half prefetch (and what is
    left at the end), until the N messages ``broker_publish`` left in the queue are acked."""
    connection = await aio_pika.connect(url)
    try:
        done = asyncio.Event()
        received = 0
        every = max(1, prefetch // 2)
        tags: list[tuple[AbstractQueue, str]] = []
        # Per consumer: its newest message not acked yet and how many it covers.
        pending: list[tuple[AbstractIncomingMessage | None, int]] = [(None, 0)] * consumers

        async def flush(index: int) -> None:
            message, _ = pending[index]
            if message is not None:
                pending[index] = (None, 0)
                await message.ack(multiple=True)

        def consumer(index: int) -> Callable[[AbstractIncomingMessage], Awaitable[None]]:
            async def on_message(message: AbstractIncomingMessage) -> None:
                nonlocal received
                received += 1
                pending[index] = (message, pending[index][1] + 1)
                if pending[index][1] >= every:
                    await flush(index)
                if received >= n:  # the last one: every consumer acks what it holds
                    for other in range(consumers):
                        await flush(other)
                    done.set()

            return on_message

        queues = []
        for _ in range(consumers):
            channel = await connection.channel()
            await channel.set_qos(prefetch_count=prefetch)
            queues.append(await channel.get_queue(PEER_QUEUE))
        started = time.perf_counter()
        for queue in queues:
            tags.append((queue, await queue.consume(consumer(len(tags)), no_ack=False)))
        await done.wait()
        seconds = time.perf_counter() - started
        for queue, tag in tags:
            await queue.cancel(tag)
        await queues[0].delete(if_unused=False, if_empty=False)
    finally:
        await connection.close()
    return PeerFigure(
        f"aio-pika consume, {consumers} x prefetch {prefetch}, ack multiple", n, seconds
    )


async def queue_depths(url: str, names: list[str]) -> dict[str, int]:
    """Ready messages per queue, as the queues themselves report them (passive declare)."""
    connection = await aio_pika.connect(url)
    try:
        channel = await connection.channel()
        depths: dict[str, int] = {}
        for name in names:
            queue = await channel.declare_queue(name, passive=True)
            depths[name] = int(queue.declaration_result.message_count or 0)
        return depths
    finally:
        await connection.close()
