"""Known traps of outbox relays, each pinned by a test on the real PostgreSQL and RabbitMQ.

- A lower outbox id that commits after a higher one must still be published (no id
  watermark: SKIP LOCKED gives no global order).
- A binding deleted behind our back makes publishes unroutable: the rows stay unpublished,
  with the error, until the binding is back, and are then published.
- A publisher-confirm timeout is an unknown outcome, never a drop: the row stays unpublished
  with the error and is published again after the back-off. The broker may then hold two
  copies, and the worker produces the result once and acks the extra copy as a duplicate.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import AsyncIterator
from pathlib import Path

import aio_pika
import pytest
from sqlalchemy import insert, select

from jobrelay.domain.queues import WORK_ROUTING_KEY
from jobrelay.domain.states import JobState
from jobrelay.relay.publisher import Relay
from jobrelay.runtime.wiring import Runtime, open_runtime, utc_now
from jobrelay.storage.tables import jobs, outbox
from jobrelay.transport.rabbitmq import RabbitTransport
from jobrelay.transport.topology import EXCHANGE, WORK_QUEUE
from jobrelay.worker.consumer import Worker

from .pipeline import settings_for
from .transport_fixtures import rabbitmqctl, wait_until

pytestmark = [pytest.mark.postgres, pytest.mark.rabbitmq]


@pytest.fixture
async def rt(pg_url: str, amqp_url: str, tmp_path: Path) -> AsyncIterator[Runtime]:
    async with open_runtime(settings_for(pg_url, amqp_url, tmp_path / "exports")) as runtime:
        yield runtime


def _job_row(job_id: str) -> dict[str, object]:
    now = utc_now()
    return {
        "id": job_id,
        "type": "report.export",
        "account_id": "acme",
        "params": {"accountId": "acme", "period": "2020-05"},
        "request_hash": "x",
        "state": JobState.QUEUED.value,
        "attempt": 0,
        "max_attempts": 3,
        "created_at": now,
        "updated_at": now,
    }


def _outbox_row(job_id: str) -> dict[str, object]:
    body = '{"jobId":"' + job_id + '","type":"report.export","version":1}'
    return {
        "job_id": job_id,
        "destination": "work",
        "body": body,
        "headers": {},
        "created_at": utc_now(),
    }


async def _published(rt: Runtime) -> dict[str, bool]:
    async with rt.engine.connect() as conn:
        rows = (await conn.execute(select(outbox.c.job_id, outbox.c.published_at))).all()
    return {r.job_id: r.published_at is not None for r in rows}


async def test_late_committing_lower_id_is_still_published(rt: Runtime) -> None:
    early, late = "00000000-0000-0000-0000-00000000000a", "00000000-0000-0000-0000-00000000000b"
    relay = Relay(rt)
    async with rt.engine.connect() as slow:
        slow_tx = await slow.begin()
        await slow.execute(insert(jobs).values(_job_row(early)))
        await slow.execute(insert(outbox).values(_outbox_row(early)))  # takes the lower id
        async with rt.engine.begin() as fast:
            await fast.execute(insert(jobs).values(_job_row(late)))
            await fast.execute(insert(outbox).values(_outbox_row(late)))
        assert await relay.relay_once() == 1  # only the committed, higher id is visible
        assert await _published(rt) == {late: True}
        await slow_tx.commit()
    assert await relay.relay_once() == 1  # found by per-row state, not by "id > last"
    assert await _published(rt) == {early: True, late: True}
    async with rt.engine.connect() as conn:
        ids = (await conn.execute(select(outbox.c.id, outbox.c.job_id))).all()
    assert {r.job_id: r.id for r in ids}[early] < {r.job_id: r.id for r in ids}[late]


async def test_deleted_binding_keeps_rows_unpublished_until_restored(
    rt: Runtime, amqp_url: str
) -> None:
    connection = await aio_pika.connect(amqp_url)
    try:
        channel = await connection.channel()
        queue = await channel.declare_queue(WORK_QUEUE, passive=True)
        await queue.unbind(EXCHANGE, WORK_ROUTING_KEY)
        job_id = "00000000-0000-0000-0000-00000000000c"
        async with rt.engine.begin() as conn:
            await conn.execute(insert(jobs).values(_job_row(job_id)))
            await conn.execute(insert(outbox).values(_outbox_row(job_id)))
        relay = Relay(rt)
        assert await relay.relay_once() == 1
        assert relay.failed == 1 and await _published(rt) == {job_id: False}
        job = await rt.store.get_job(job_id)
        assert job is not None and "unroutable" in (job.last_publish_error or "")
        await queue.bind(EXCHANGE, WORK_ROUTING_KEY)
        async with rt.engine.begin() as conn:  # skip the back-off instead of waiting it out
            await conn.execute(outbox.update().values(claimed_until=None))
        assert await relay.relay_once() == 1
        assert await _published(rt) == {job_id: True}
        assert (await rt.store.get_job(job_id)).published  # type: ignore[union-attr]
    finally:
        await connection.close()


async def _work_queue_messages(amqp_url: str) -> int:
    """Ready plus unacked messages in the work queue, as the broker counts them."""
    vhost = amqp_url.rsplit("/", 1)[1]
    args = ("list_queues", "-p", vhost, "name", "messages", "--formatter", "json")
    out = await rabbitmqctl(*args)
    return int({q["name"]: q["messages"] for q in json.loads(out)}[WORK_QUEUE])


async def test_confirm_timeout_is_unknown_and_republished_never_dropped(
    rt: Runtime, amqp_url: str
) -> None:
    job_id = "00000000-0000-0000-0000-00000000000d"
    async with rt.engine.begin() as conn:
        await conn.execute(insert(jobs).values(_job_row(job_id)))
        await conn.execute(insert(outbox).values(_outbox_row(job_id)))

    # No confirm in time: the broker may or may not have the message, so it is not marked.
    # 0.1 ms lets aiormq send the publish (a microsecond runs out before it is sent) and is
    # far shorter than a quorum queue's confirm, so the broker most likely keeps this copy.
    hasty = RabbitTransport(amqp_url, rt.topology, confirm_timeout=1e-4)
    await hasty.connect()
    try:
        relay = Relay(dataclasses.replace(rt, transport=hasty))
        assert await relay.relay_once() == 1
    finally:
        await hasty.close()
    assert (relay.published, relay.failed) == (0, 1)
    assert await _published(rt) == {job_id: False}
    job = await rt.store.get_job(job_id)
    assert job is not None and not job.published
    assert (job.last_publish_error or "").startswith("publish_unknown: no confirm")
    assert "published" not in [e.kind for e in await rt.store.events(job_id)]

    # After the back-off (skipped here), a relay with a working transport sends it again.
    async with rt.engine.begin() as conn:
        await conn.execute(outbox.update().values(claimed_until=None))
    relay = Relay(rt)
    assert await relay.relay_once() == 1
    assert (relay.published, relay.failed) == (1, 0)
    assert await _published(rt) == {job_id: True}
    job = await rt.store.get_job(job_id)
    assert job is not None and job.published and job.last_publish_error is None

    # The timed-out publish may have reached the queue too: one or two copies now. Either
    # way the result is produced once, any extra copy is acked as a duplicate, and the
    # work queue ends empty (nothing ready, nothing unacked).
    async def kinds() -> list[str]:
        return [e.kind for e in await rt.store.events(job_id)]

    async def settled() -> bool:
        job = await rt.store.get_job(job_id)
        seen = await kinds()
        return (
            job is not None
            and job.state is JobState.SUCCEEDED
            and seen.count("ack_sent") == 1 + seen.count("duplicate_acked")
            and await _work_queue_messages(amqp_url) == 0
        )

    # One delivery at a time, so a second copy finds the job finished (a concurrent one would
    # be deferred behind the live lease instead, and need a relay for its re-check).
    one_at_a_time = rt.settings.model_copy(update={"prefetch": 1})
    stop = asyncio.Event()
    worker = asyncio.create_task(Worker(dataclasses.replace(rt, settings=one_at_a_time)).run(stop))
    try:
        await wait_until(settled, timeout=30, interval=0.1)
    finally:
        stop.set()
        await asyncio.wait_for(worker, 15)
    seen = await kinds()
    assert seen.count("result_saved") == 1 and seen.count("claimed") == 1, seen
    assert seen.count("published") == 1, seen
    assert seen.count("duplicate_acked") <= 1 and "deferred" not in seen, seen
    job = await rt.store.get_job(job_id)
    assert job is not None and job.state is JobState.SUCCEEDED and job.attempt == 1
    assert job.result_key is not None
