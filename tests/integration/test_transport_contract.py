"""One transport contract, held against the local transport (SQLite, PostgreSQL) and RabbitMQ.

The worker and relay are written against ``jobrelay.transport.base`` only; these tests are
what makes "the embedded default has the same delivery semantics" true. Each RabbitMQ test
gets a fresh vhost and each database test a fresh database, so nothing leaks between them.
Waiting is always "poll until, with a deadline"; the only fixed waits are the windows in
which nothing may be delivered.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sqlite3
import sys
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import aio_pika
import pytest
from sqlalchemy import event, text

from jobrelay.errors import PublishError, TransportError
from jobrelay.settings import Settings
from jobrelay.storage import local_queue
from jobrelay.storage.drivers.sqlite_conn import SqliteHot
from jobrelay.transport.base import OutgoingMessage, Transport
from jobrelay.transport.local import LocalTransport
from jobrelay.transport.rabbitmq import retry_queue_arguments, work_queue_arguments
from jobrelay.transport.topology import (
    DEAD_LETTER_EXCHANGE,
    EXCHANGE,
    QUARANTINE_QUEUE,
    WORK_QUEUE,
    Topology,
    retry_queue,
)
from tests.integration.transport_fixtures import (
    LOCAL_VISIBILITY,
    TOPOLOGY,
    Backend,
    body_of,
    close_iterator,
    message,
    rabbitmqctl,
    unreachable,
    wait_until,
)

REPO = Path(__file__).resolve().parents[2]
BACKENDS = [
    pytest.param("local-sqlite", id="local-sqlite"),
    pytest.param("local-postgres", id="local-postgres", marks=pytest.mark.postgres),
    pytest.param("rabbitmq", id="rabbitmq", marks=pytest.mark.rabbitmq),
]
_URL_FIXTURE = {"local-sqlite": "sqlite_url", "local-postgres": "pg_url", "rabbitmq": "amqp_url"}


@pytest.fixture(params=BACKENDS)
def backend_url(request: pytest.FixtureRequest) -> tuple[str, str]:
    return request.param, str(request.getfixturevalue(_URL_FIXTURE[request.param]))


@pytest.fixture
async def backend(backend_url: tuple[str, str]) -> AsyncIterator[Backend]:
    made = Backend(*backend_url)
    yield made
    await made.aclose()


async def depth_is(transport: Transport, expected: int, timeout: float = 10.0) -> None:
    async def reached() -> bool:
        return await transport.quarantine_depth() == expected

    await wait_until(reached, timeout)


# --- the contract, on every backend ---------------------------------------------------------


async def test_ack_settles_for_good_and_unknown_destinations_deliver_nothing(
    backend: Backend,
) -> None:
    transport = await backend.connected()
    for destination in ("nope", "retry.7s", "retry.0s", "quarantine", ""):
        with pytest.raises(PublishError, match="unroutable") as raised:
            await transport.publish(message({"n": 0}, destination=destination))
        assert raised.value.unknown is False, destination
    await transport.publish(message({"n": 1}, traceparent="00-abc-01", jobId="j-1"))
    pump = backend.pump(transport)
    delivery = await pump.get()
    assert body_of(delivery) == {"n": 1}  # and nothing of the unroutable ones
    assert {"traceparent": "00-abc-01", "jobId": "j-1"}.items() <= delivery.headers.items()
    assert (delivery.redelivered, delivery.delivery_count) == (False, 0)
    assert await delivery.ack() is True  # handed to the broker on the delivery's channel
    assert await delivery.reject() is False  # already settled: nothing sent, not quarantined
    await pump.expect_none(0.3)
    await pump.stop()
    await transport.close()  # an unsettled message would come back now
    again = await backend.connected()
    await backend.pump(again).expect_none(0.3)
    assert await again.quarantine_depth() == 0


async def test_reject_quarantines_and_never_redelivers(backend: Backend) -> None:
    transport = await backend.connected()
    await transport.publish(message({"n": 1}))
    pump = backend.pump(transport)
    rejected = await pump.get()
    assert await rejected.reject() is True
    await depth_is(transport, 1)
    assert await rejected.ack() is False  # already settled
    await pump.expect_none(0.3)
    await pump.stop()
    await transport.close()
    again = await backend.connected()
    await backend.pump(again).expect_none(0.3)
    assert await again.quarantine_depth() == 1


async def test_release_gives_the_message_back_at_once_and_counts_it(backend: Backend) -> None:
    # Long visibility / grace: if the message comes back, it is the release at work.
    transport = await backend.connected(visibility_seconds=30, settle_grace_seconds=30)
    await transport.publish(message({"n": 1}))
    pump = backend.pump(transport)
    first = await pump.get()
    assert not first.redelivered
    await first.release()
    again = await pump.get(timeout=5)
    assert body_of(again) == {"n": 1}
    assert again.redelivered and again.delivery_count >= 1
    assert await again.ack() is True
    await pump.expect_none(0.3)
    await pump.stop()
    assert await transport.quarantine_depth() == 0


async def test_unsettled_delivery_returns_when_its_consumer_stops(backend: Backend) -> None:
    publisher = await backend.connected()
    for n, how in enumerate(["iterator closed", "transport closed under a live iterator"]):
        await publisher.publish(message({"n": n}))
        consumer = await backend.connected()
        pump = backend.pump(consumer)
        taken = await pump.get()
        assert body_of(taken) == {"n": n} and not taken.redelivered, how
        if n == 0:
            await pump.stop()  # the transport lives on: back after the grace / visibility
        else:
            await consumer.close()  # back at once
        successor = backend.pump(await backend.connected())
        delivery = await successor.get()
        assert body_of(delivery) == {"n": n}, how
        assert delivery.redelivered and delivery.delivery_count >= 1, how
        # Too late: a logged no-op that must not touch the new delivery, and says so.
        late = taken.ack() if n == 0 else taken.reject()
        assert await late is False, how
        assert await delivery.ack() is True, how
        await successor.stop()
        await pump.stop()
        await consumer.close()
    await backend.pump(publisher).expect_none(0.3)
    assert await publisher.quarantine_depth() == 0  # the late reject quarantined nothing


async def test_a_settle_after_the_channel_or_claim_is_gone_is_false_and_comes_back(
    backend: Backend, caplog: pytest.LogCaptureFixture
) -> None:
    # The transport closes under two handed-out deliveries (RabbitMQ: the connection and the
    # consuming channel close, and the broker requeues; local: the claims are given back).
    # Settling them afterwards must say it did not count, and they come back unsettled.
    publisher = await backend.connected()
    for n in range(2):
        await publisher.publish(message({"n": n}))
    consumer = await backend.connected(visibility_seconds=30, settle_grace_seconds=30)
    pump = backend.pump(consumer)
    first, second = await pump.get(), await pump.get()
    await consumer.close()
    with caplog.at_level(logging.WARNING, "jobrelay.transport"):
        assert await first.ack() is False
        assert await second.reject() is False
    ignored = [r for r in caplog.records if getattr(r, "event", None) == "settle_ignored"]
    assert len(ignored) == 2, [r.getMessage() for r in caplog.records]
    successor = backend.pump(await backend.connected())
    again = [await successor.get(), await successor.get()]
    assert sorted(body_of(d)["n"] for d in again) == [0, 1]
    assert all(d.redelivered and d.delivery_count == 1 for d in again)
    assert [await d.ack() for d in again] == [True, True]
    await successor.expect_none(0.3)
    assert await publisher.quarantine_depth() == 0  # the reject that did not count


async def test_closing_the_iterator_keeps_handed_out_deliveries_settleable(
    backend: Backend,
) -> None:
    # A draining worker stops consuming first, then acks what it is still working on; what
    # was prefetched but never handed out goes to other consumers at once (local: long
    # visibility, so this is not the timeout at work).
    transport = await backend.connected(visibility_seconds=30, settle_grace_seconds=30)
    for n in range(3):
        await transport.publish(message({"n": n}))
    iterator = transport.consume(3)
    first = await asyncio.wait_for(anext(iterator), 10)
    await close_iterator(iterator)
    other = backend.pump(await backend.connected(visibility_seconds=30, settle_grace_seconds=30))
    rest = {body_of(await other.get(timeout=5))["n"] for _ in range(2)}
    assert rest == {0, 1, 2} - {body_of(first)["n"]}
    assert await first.ack() is True  # the iterator is closed, but its channel or claim lives
    await transport.close()  # had the ack not counted, the message would come back now
    await other.expect_none(0.3)


async def test_what_a_closed_iterator_never_handed_out_goes_back_uncounted(
    backend: Backend,
) -> None:
    # A worker leaving a paused queue (or stopping) returns what it prefetched and never
    # started. Counted, a message held by consumers that keep leaving was dead-lettered by
    # the delivery limit (2 here) though nobody ever saw it (issue 21, item 4).
    transport = await backend.connected(visibility_seconds=30, settle_grace_seconds=30)
    await transport.publish(message({"n": 0}))
    for n in range(1, TOPOLOGY.delivery_limit + 3):
        await transport.publish(message({"n": n}))
        iterator = transport.consume(2)
        taken = await asyncio.wait_for(anext(iterator), 10)
        assert taken.delivery_count == 0 and not taken.redelivered, body_of(taken)
        await wait_until(lambda: _zero(transport.work_ready()))  # the other one is prefetched
        await close_iterator(iterator)  # ... and given back, never handed out
        assert await taken.ack() is True
    last = backend.pump(transport)
    rest = await last.get()
    assert rest.delivery_count == 0 and not rest.redelivered, body_of(rest)
    assert await rest.ack() is True
    await last.expect_none(0.3)
    assert await transport.quarantine_depth() == 0


async def test_keep_in_flight_keeps_handed_out_deliveries_past_the_grace(
    backend: Backend,
) -> None:
    # A paused queue's long jobs are still running after its consumer left: without a
    # deadline, their deliveries are neither requeued nor handed to another consumer.
    transport = await backend.connected()  # grace / visibility of LOCAL_VISIBILITY (1 s)
    await transport.publish(message({"n": 1}))
    iterator = transport.consume(1, keep_in_flight=True)
    held = await asyncio.wait_for(anext(iterator), 10)
    await close_iterator(iterator)
    other = backend.pump(await backend.connected())
    await other.expect_none(2.5)  # past the grace and the visibility timeout
    assert await held.ack() is True
    await transport.close()
    await other.expect_none(0.3)


async def _zero(count: Any) -> bool:
    return bool(await count == 0)


async def test_retry_tier_comes_back_after_its_delay(backend: Backend) -> None:
    transport = await backend.connected()
    pump = backend.pump(transport)
    started = asyncio.get_running_loop().time()
    await transport.publish(message({"n": 1}, destination="retry.1s", jobId="j-1"))
    await pump.expect_none(0.5)
    delivery = await pump.get(timeout=5)
    assert asyncio.get_running_loop().time() - started >= 0.9
    assert body_of(delivery) == {"n": 1} and delivery.headers["jobId"] == "j-1"
    assert (delivery.redelivered, delivery.delivery_count) == (False, 0)
    await delivery.ack()


async def test_a_named_queue_is_consumed_only_by_its_own_consumers(backend: Backend) -> None:
    transport = await backend.connected()
    default = backend.pump(transport)
    images = backend.pump(transport, queue="images")
    await transport.publish(message({"n": 1}, destination="work.images"))
    await transport.publish(message({"n": 2}))
    delivery = await images.get()
    assert body_of(delivery) == {"n": 1}
    assert body_of(await default.get()) == {"n": 2}
    await images.expect_none(0.3)
    await default.expect_none(0.1)
    await delivery.ack()
    assert await transport.work_ready() == 0


async def test_a_named_queues_retry_tier_comes_back_to_that_queue(backend: Backend) -> None:
    transport = await backend.connected()
    default = backend.pump(transport)
    images = backend.pump(transport, queue="images")
    started = asyncio.get_running_loop().time()
    await transport.publish(message({"n": 1}, destination="retry.images.1s", jobId="j-1"))
    delivery = await images.get(timeout=5)
    assert asyncio.get_running_loop().time() - started >= 0.9
    assert body_of(delivery) == {"n": 1} and delivery.headers["jobId"] == "j-1"
    assert (delivery.redelivered, delivery.delivery_count) == (False, 0)
    await default.expect_none(0.3)  # the default queue never saw it
    await delivery.ack()


async def test_destinations_of_undeclared_queues_and_tiers_are_unroutable(
    backend: Backend,
) -> None:
    transport = await backend.connected()
    for destination in (
        "work.videos",
        "retry.videos.1s",
        "retry.images.7s",
        "work.default",
        "retry.default.1s",
        "work.Images",
        "work.images.x",
    ):
        with pytest.raises(PublishError, match="unroutable"):
            await transport.publish(message({"n": 0}, destination=destination))
    with pytest.raises(TransportError):
        await backend.pump(transport, queue="videos").get(timeout=5)


async def test_prefetch_bounds_unsettled_deliveries(backend: Backend) -> None:
    transport = await backend.connected()
    for n in range(5):
        await transport.publish(message({"n": n}))
    pump = backend.pump(transport, prefetch=2)
    first, second = await pump.get(), await pump.get()
    await pump.expect_none(0.5)  # three more wait, but two are unsettled
    await first.ack()
    third = await pump.get(timeout=5)
    await pump.expect_none(0.3)
    await second.ack()
    await third.ack()
    rest = [await pump.get(timeout=5), await pump.get(timeout=5)]
    for delivery in rest:
        await delivery.ack()
    seen = sorted(body_of(d)["n"] for d in (first, second, third, *rest))
    assert seen == list(range(5))


async def test_delivery_limit_sends_a_crash_looping_message_to_quarantine(
    backend: Backend,
) -> None:
    publisher = await backend.connected()
    await publisher.publish(message({"n": 1}))
    for count in range(TOPOLOGY.delivery_limit + 1):  # the consumer dies each time
        consumer = await backend.connected()
        pump = backend.pump(consumer, prefetch=1)
        delivery = await pump.get()
        assert delivery.delivery_count == count and delivery.redelivered == (count > 0)
        await pump.stop()
        await consumer.close()
    await backend.pump(await backend.connected()).expect_none(0.5)
    await depth_is(publisher, 1)


async def test_the_default_delivery_limit_outlasts_deaths_beside_messages_never_started(
    backend: Backend,
) -> None:
    """Each consumer death (a worker killed, a connection cut) counts once towards the
    delivery limit for EVERY message the consumer held, started or waiting in its window.
    Seven deaths with ten messages held and none started: under the default limit every one
    of them is still delivered (at the old default, 5, all ten were dead-lettered)."""
    limit = Settings.model_fields["delivery_limit"].default
    topology = Topology(retry_delays=(1, 3), delivery_limit=limit, queues=("images",))
    publisher = await backend.connected(topology=topology)
    for n in range(10):
        await publisher.publish(message({"n": n}))
    for _ in range(7):
        consumer = await backend.connected(topology=topology)
        pump = backend.pump(consumer, prefetch=10)
        for _ in range(10):
            await pump.get()  # held, never settled
        await pump.stop()
        await consumer.close()
    pump = backend.pump(await backend.connected(topology=topology), prefetch=10)
    seen = []
    for _ in range(10):
        delivery = await pump.get()
        assert delivery.delivery_count == 7
        seen.append(body_of(delivery)["n"])
        await delivery.ack()
    assert sorted(seen) == list(range(10))


async def test_concurrent_publishes_are_all_confirmed_and_delivered(backend: Backend) -> None:
    transport = await backend.connected()
    await asyncio.gather(
        *(
            transport.publish(OutgoingMessage("work", json.dumps({"n": n}).encode(), {}, f"m{n}"))
            for n in range(50)
        )
    )
    pump = backend.pump(transport, prefetch=50)
    seen = []
    for _ in range(50):
        delivery = await pump.get()
        seen.append(body_of(delivery)["n"])
        await delivery.ack()
    assert sorted(seen) == list(range(50))


async def test_a_live_consumer_keeps_a_long_running_delivery(backend: Backend) -> None:
    worker = await backend.connected(visibility_seconds=0.3)
    await worker.publish(message({"n": 1}))
    delivery = await backend.pump(worker).get()
    other = backend.pump(await backend.connected(visibility_seconds=0.3))
    await other.expect_none(1.2)  # four local visibility timeouts, renewed meanwhile
    await delivery.ack()
    await worker.close()
    await other.expect_none(0.3)


async def test_connect_and_declare_are_idempotent(backend: Backend) -> None:
    await backend.declare()
    await backend.declare()
    transport = backend.transport()
    await transport.connect()
    await transport.connect()
    await transport.ping()  # reachable and declared
    await transport.publish(message({"n": 1}))
    delivery = await backend.pump(await backend.connected()).get()
    assert body_of(delivery) == {"n": 1}
    await delivery.ack()


@pytest.mark.parametrize("kind", [p.values[0] for p in BACKENDS])
async def test_unreachable_broker_raises_transport_error(kind: str, tmp_path: Path) -> None:
    async with unreachable(kind, tmp_path) as transport:
        with pytest.raises(TransportError):
            await transport.ping()
        with pytest.raises(TransportError):
            await transport.connect()


async def test_a_killed_consumer_process_loses_nothing(backend: Backend, tmp_path: Path) -> None:
    transport = await backend.connected()
    await transport.publish(message({"n": 7}))
    holder = await _spawn(tmp_path / "holder.err", "hold", backend.kind, backend.url)
    try:
        line = await asyncio.wait_for(holder.stdout.readline(), 30)  # type: ignore[union-attr]
        assert line.decode().strip() == 'HELD {"n": 7}', (tmp_path / "holder.err").read_text()
        pump = backend.pump(transport)
        await pump.expect_none(0.3)  # held by a live process
    finally:
        holder.kill()
        await holder.wait()
    delivery = await pump.get(timeout=10)
    assert body_of(delivery) == {"n": 7} and delivery.redelivered
    await delivery.ack()


# --- the local transport only ---------------------------------------------------------------


@pytest.fixture
async def local(database_url: str) -> AsyncIterator[Backend]:
    made = Backend(
        "local-sqlite" if database_url.startswith("sqlite") else "local-postgres", database_url
    )
    yield made
    await made.aclose()


async def test_local_publish_wakes_an_idle_consumer_in_the_same_process(local: Backend) -> None:
    transport = await local.connected(poll_seconds=5.0)
    pump = local.pump(transport)
    await pump.expect_none(0.3)  # idle: its next poll is seconds away
    await (await local.connected()).publish(message({"n": 1}))
    assert body_of(await pump.get(timeout=1.0)) == {"n": 1}


async def test_local_settle_after_a_lost_claim_is_a_no_op(local: Backend) -> None:
    # The second consumer's clock is an hour ahead, so the first one's claim looks expired.
    slow = await local.connected(visibility_seconds=30)
    await slow.publish(message({"n": 1}))
    stale = await local.pump(slow).get()
    later = lambda: datetime.now(UTC) + timedelta(hours=1)  # noqa: E731
    fresh = await local.pump(await local.connected(visibility_seconds=30, clock=later)).get()
    assert fresh.redelivered and fresh.delivery_count == 1
    assert await stale.ack() is False  # lost the row: must not delete the new holder's message
    assert await stale.reject() is False  # already settled (and lost anyway)
    assert await fresh.reject() is True
    assert await slow.quarantine_depth() == 1


async def test_local_settles_asked_together_commit_together_each_fenced_alone(
    local: Backend,
) -> None:
    """Issue 23 item 6: acks and rejects asked for in one loop turn are one write
    transaction (one commit), and each is still fenced on its own claim: a lost one is
    refused, its neighbours are taken. Old code: a transaction (a commit) per settle."""
    transport = await local.connected(visibility_seconds=30)
    assert isinstance(transport, LocalTransport)
    for n in range(6):
        await transport.publish(message({"n": n}))
    pump = local.pump(transport)
    deliveries = [await pump.get() for _ in range(6)]
    later = lambda: datetime.now(UTC) + timedelta(hours=1)  # noqa: E731
    thief = await local.connected(visibility_seconds=30, clock=later)
    stolen = await local.pump(thief, prefetch=1).get()  # one of the six, taken over
    commits = 0  # of transactions that settled something (the consumers also claim)
    settles: list[int] = []  # the queue driver's settle transactions, by size

    def mark(conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        settling = statement.startswith("DELETE FROM local_messages")
        if settling or "dead_lettered_at" in statement:
            conn.info["settled"] = True

    def count(conn: Any) -> None:
        nonlocal commits
        commits += bool(conn.info.pop("settled", False))

    queue = transport._queue
    settle = queue.settle

    async def counted(consumer: str, asked: Any, now: datetime) -> list[bool]:
        settles.append(len(asked))
        return await settle(consumer, asked, now)

    engine = transport._engine.sync_engine
    event.listen(engine, "before_cursor_execute", mark)
    event.listen(engine, "commit", count)
    queue.settle = counted  # type: ignore[method-assign]
    try:
        taken = await asyncio.gather(
            *(d.reject() if i == 0 else d.ack() for i, d in enumerate(deliveries))
        )
    finally:
        del queue.settle
        event.remove(engine, "before_cursor_execute", mark)
        event.remove(engine, "commit", count)
    lost = [body_of(d) == body_of(stolen) for d in deliveries]
    assert taken == [not was_lost for was_lost in lost]
    assert settles == [6]
    # Through SQLAlchemy (PostgreSQL) its commit is seen; SQLite's consumers hold a
    # connection of their own, whose one transaction per settle call is the driver's.
    assert commits == (1 if local.kind == "local-postgres" else 0)
    assert await stolen.ack() is True


async def test_local_claims_and_settles_on_sqlite_run_on_the_consumers_own_connection(
    local: Backend,
) -> None:
    """Issue 41 item 7: on SQLite the local transport's publishes, claims and settles run on
    a connection its consumers hold, each transaction one hand-off to its thread, not through
    SQLAlchemy (a dozen); PostgreSQL keeps the portable statements. Old code: SQLAlchemy's."""
    transport = await local.connected(visibility_seconds=30)
    assert isinstance(transport, LocalTransport)
    await transport.publish(message({"n": 0}))
    pump = local.pump(transport)
    deliveries = [await pump.get()]  # a consumer runs: its connection is held from here
    seen: list[str] = []

    def note(_conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        if "local_messages" in statement:
            seen.append(statement.split()[0])

    engine = transport._engine.sync_engine
    event.listen(engine, "before_cursor_execute", note)
    try:
        for n in range(1, 3):
            await transport.publish(message({"n": n}))
        deliveries += [await pump.get() for _ in range(2)]
        assert await deliveries[0].reject() is True
        assert all([await d.ack() for d in deliveries[1:]])
        await pump.stop()
    finally:
        event.remove(engine, "before_cursor_execute", note)
    assert await transport.quarantine_depth() == 1 and await transport.work_ready() == 0
    if local.kind == "local-sqlite":
        assert seen == [], seen  # none through SQLAlchemy
    else:
        assert {"INSERT", "SELECT", "UPDATE", "DELETE"} <= set(seen), seen


async def test_local_prefetch_slot_is_free_at_the_outcome_commit_its_claim_kept_to_the_ack(
    local: Backend,
) -> None:
    """Issue 41 item 7: a delivery whose job's outcome committed no longer fills the
    consumer's window (the next row is claimed while its ack is written), and its row stays
    claimed, renewed, until that ack. Old code: the window was freed only by the ack."""
    transport = await local.connected(visibility_seconds=30)
    for n in range(2):
        await transport.publish(message({"n": n}))
    pump = local.pump(transport, prefetch=1)
    first = await pump.get()
    await pump.expect_none(0.3)  # a window of one, full
    first.outcome_committed()
    second = await pump.get()
    assert body_of(second) != body_of(first)
    assert await first.ack() is True  # still its claim's: deleted under it
    assert await second.ack() is True
    assert await transport.work_ready() == 0


async def test_local_committed_delivery_left_by_its_closed_consumer_comes_back_unrenewed(
    local: Backend,
) -> None:
    """A delivery whose outcome committed (out of the window, its ack to come) is treated as
    any delivery handed out when its consumer closes without ``keep_in_flight``: no longer
    renewed, so unacked it comes back after the visibility timeout. Old code: it stayed
    renewed by the transport for as long as the transport lived."""
    transport = await local.connected(visibility_seconds=1)
    await transport.publish(message({"n": 1}))
    pump = local.pump(transport, prefetch=1)
    delivery = await pump.get()
    delivery.outcome_committed()
    await pump.stop()  # the consumer leaves; the ack never comes
    other = local.pump(await local.connected(visibility_seconds=30))
    again = await other.get(timeout=15)
    assert body_of(again) == body_of(delivery) and again.redelivered
    assert await delivery.ack() is False  # its claim was lost to the redelivery
    assert await again.ack() is True


async def test_local_consumer_whose_held_connection_cannot_open_goes_on_through_sqlalchemy(
    local: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The held SQLite connection is a speed-up: one that cannot be opened leaves the
    consumer on SQLAlchemy, with a warning, instead of failing it. Old code: the error came
    out of ``consume()`` and ended the worker."""

    def refuse(_self: Any) -> None:
        raise sqlite3.OperationalError("unable to open database file")

    monkeypatch.setattr(SqliteHot, "_connect", refuse)
    transport = await local.connected()
    await transport.publish(message({"n": 1}))
    delivery = await local.pump(transport).get()
    assert await delivery.ack() is True
    assert await transport.work_ready() == 0


async def test_a_claim_in_flight_as_the_transport_closes_gives_its_rows_back(
    local: Backend,
) -> None:
    # close() gives back what it holds while the consumer's next claim is still on its way;
    # that claim can take the very rows just given back. They must be given back again, not
    # left invisible until the visibility timeout (CI saw a successor get nothing for 10 s).
    consumer = await local.connected(visibility_seconds=30, settle_grace_seconds=30)
    assert isinstance(consumer, LocalTransport)
    for n in range(2):
        await consumer.publish(message({"n": n}))
    pump = local.pump(consumer)
    await pump.get(), await pump.get()
    entered, proceed = asyncio.Event(), asyncio.Event()
    claim = consumer._claim

    async def late_claim(stream: Any) -> bool:
        entered.set()
        await proceed.wait()
        return await claim(stream)

    consumer._claim = late_claim  # type: ignore[method-assign]
    await asyncio.wait_for(entered.wait(), 10)
    await consumer.close()  # gives back both handed-out rows
    proceed.set()  # ... and only now the claim runs, and takes them again
    await asyncio.wait_for(pump.task, 10)
    successor = local.pump(await local.connected())
    again = [await successor.get(timeout=5), await successor.get(timeout=5)]
    assert sorted(body_of(d)["n"] for d in again) == [0, 1]


@pytest.mark.slow
@pytest.mark.long
async def test_local_consumer_processes_share_the_queue_exactly_once(
    local: Backend, tmp_path: Path
) -> None:
    # A live consumer that is descheduled for a while (a loaded CI machine, a GC pause) keeps
    # its claims: its renewals are late, not missing, and the visibility timeout is what
    # tells the two apart. One consumer is frozen here for three times the 1 s timeout the
    # other tests use; under that timeout its rows were taken over and done twice.
    records = [tmp_path / f"consumer-{i}.txt" for i in range(3)]
    workers = [
        await _spawn(tmp_path / f"consumer-{i}.err", "drain", local.kind, local.url, str(r))
        for i, r in enumerate(records)
    ]
    try:
        for worker in workers:
            assert (await asyncio.wait_for(worker.stdout.readline(), 30)).strip() == b"READY"  # type: ignore[union-attr]
        publisher = await local.connected()

        async def publish_all() -> None:
            for n in range(200):
                await publisher.publish(message({"n": n}))

        # Published while a consumer is being frozen, so there is work on both sides of it.
        publishing = asyncio.create_task(publish_all())
        engine = local._engine  # the rows themselves: all gone means all acked
        assert engine is not None

        async def started() -> bool:
            return any(r.exists() and r.read_text() for r in records)

        await wait_until(started, timeout=30)
        frozen = next(w for w, r in zip(workers, records, strict=True) if r.exists())

        async def held_by_frozen() -> int:
            # A consumer's id is "host:pid:random" (LocalTransport).
            async with local_queue.reading(engine) as conn:
                held = await conn.scalar(
                    text("SELECT count(*) FROM local_messages WHERE consumer LIKE :me"),
                    {"me": f"%:{frozen.pid}:%"},
                )
            return int(held or 0)

        async def frozen_holding_rows() -> bool:
            # Frozen at a moment it holds claimed rows, or let go and tried again.
            os.kill(frozen.pid, signal.SIGSTOP)
            if await held_by_frozen():
                return True
            os.kill(frozen.pid, signal.SIGCONT)
            return False

        try:
            await wait_until(frozen_holding_rows, timeout=30, interval=0.01)
            await asyncio.sleep(3 * LOCAL_VISIBILITY)  # the freeze itself, not a wait for it
        finally:
            os.kill(frozen.pid, signal.SIGCONT)
        await publishing

        async def drained() -> bool:
            async with local_queue.reading(engine) as conn:
                return await local_queue.count_queue(conn, local_queue.WORK) == 0

        await wait_until(drained, timeout=60, interval=0.2)
    finally:
        for worker in workers:
            os.kill(worker.pid, signal.SIGCONT)  # a failure mid-freeze leaves none stopped
            worker.terminate()
        codes = [await asyncio.wait_for(w.wait(), 30) for w in workers]
    assert codes == [0, 0, 0], [(tmp_path / f"consumer-{i}.err").read_text() for i in range(3)]
    per_consumer = [r.read_text().split() if r.exists() else [] for r in records]
    numbers = sorted(int(n) for seen in per_consumer for n in seen)
    assert numbers == list(range(200))  # none missing, none twice
    assert sum(1 for seen in per_consumer if seen) >= 2  # they really ran side by side


# --- RabbitMQ only ----------------------------------------------------------------------------


@pytest.fixture
async def rabbit(amqp_url: str) -> AsyncIterator[Backend]:
    made = Backend("rabbitmq", amqp_url)
    yield made
    await made.aclose()


def _vhost(backend: Backend) -> str:
    return backend.url.rsplit("/", 1)[1]


async def _delete_queue(backend: Backend, name: str) -> None:
    connection = await aio_pika.connect(backend.url)
    async with connection:
        channel = await connection.channel()
        await channel.queue_delete(name)


@pytest.mark.rabbitmq
async def test_rabbit_topology_is_declared_as_specified_and_checked(rabbit: Backend) -> None:
    await rabbit.declare()
    listed = json.loads(
        await rabbitmqctl(
            "list_queues",
            "-p",
            _vhost(rabbit),
            "name",
            "arguments",
            "type",
            "durable",
            "--formatter",
            "json",
        )
    )
    queues = {q["name"]: q for q in listed}
    assert set(queues) == {
        WORK_QUEUE,
        retry_queue(1),
        retry_queue(3),
        "jobrelay.work.images",
        "jobrelay.retry.images.1s",
        "jobrelay.retry.images.3s",
        QUARANTINE_QUEUE,
    }
    assert set(queues) == set(TOPOLOGY.names())
    assert all(q["type"] == "quorum" and q["durable"] for q in listed)
    args = {name: {a[0]: a[2] for a in q["arguments"]} for name, q in queues.items()}
    assert args[WORK_QUEUE] == work_queue_arguments(TOPOLOGY)
    assert args[WORK_QUEUE]["x-dead-letter-strategy"] == "at-least-once"
    assert args[WORK_QUEUE]["x-delivery-limit"] == TOPOLOGY.delivery_limit
    assert args[retry_queue(3)] == retry_queue_arguments(3)
    assert args[retry_queue(3)]["x-message-ttl"] == 3000
    assert args["jobrelay.work.images"] == work_queue_arguments(TOPOLOGY)
    assert args["jobrelay.retry.images.3s"] == retry_queue_arguments(3, "images")
    assert args["jobrelay.retry.images.3s"]["x-dead-letter-routing-key"] == "work.images"
    assert args[retry_queue(3)]["x-dead-letter-routing-key"] == "work"
    bindings = json.loads(
        await rabbitmqctl(
            "list_bindings",
            "-p",
            _vhost(rabbit),
            "source_name",
            "destination_name",
            "routing_key",
            "--formatter",
            "json",
        )
    )
    routes = {(b["source_name"], b["routing_key"], b["destination_name"]) for b in bindings}
    assert {
        (EXCHANGE, "work", WORK_QUEUE),
        (EXCHANGE, "retry.1s", retry_queue(1)),
        (EXCHANGE, "retry.3s", retry_queue(3)),
        (EXCHANGE, "work.images", "jobrelay.work.images"),
        (EXCHANGE, "retry.images.1s", "jobrelay.retry.images.1s"),
        (DEAD_LETTER_EXCHANGE, "quarantine", QUARANTINE_QUEUE),
    } <= routes
    # Queue arguments cannot change in place: a new delivery limit must be a clear error.
    changed = rabbit.transport(topology=Topology(retry_delays=(1, 3), delivery_limit=5))
    # It names the limit the queue has and the setting that keeps it (an upgrade from 5).
    kept = f"exists with delivery limit {TOPOLOGY.delivery_limit}, not JOBRELAY_DELIVERY_LIMIT"
    with pytest.raises(TransportError, match="topology mismatch") as refused:
        await changed.connect()
    assert kept in str(refused.value)
    assert f"JOBRELAY_DELIVERY_LIMIT={TOPOLOGY.delivery_limit} to keep" in str(refused.value)


@pytest.mark.rabbitmq
async def test_rabbit_queues_declared_before_the_group_size_setting_are_kept(
    rabbit: Backend,
) -> None:
    """An upgrade: the work queue exists without ``x-quorum-initial-group-size`` (as earlier
    versions declared it), holding a message. Declaring keeps it, message and all."""
    import aio_pika

    connection = await aio_pika.connect(rabbit.url)
    async with connection:
        channel = await connection.channel()
        old = {k: v for k, v in work_queue_arguments(TOPOLOGY).items() if "group" not in k}
        await channel.declare_queue(WORK_QUEUE, durable=True, arguments=old)
        await channel.default_exchange.publish(
            aio_pika.Message(b'{"n": 1}'), routing_key=WORK_QUEUE
        )
    await rabbit.declare()  # no topology mismatch
    transport = await rabbit.connected()
    delivery = await rabbit.pump(transport).get()
    assert body_of(delivery) == {"n": 1}
    assert await delivery.ack()


@pytest.mark.rabbitmq
async def test_rabbit_publish_failures_say_whether_the_outcome_is_known(rabbit: Backend) -> None:
    # No confirm in time: the broker may or may not have the message.
    hasty = await rabbit.connected(confirm_timeout=1e-6)
    with pytest.raises(PublishError) as raised:
        await hasty.publish(message({"n": 0}))
    assert raised.value.unknown is True

    # basic.nack (a queue at its length limit with x-overflow=reject-publish).
    transport = await rabbit.connected()
    await rabbitmqctl(
        "set_policy", "-p", _vhost(rabbit), "--apply-to", "queues", "tiny",
        "^jobrelay\\.work$", '{"max-length": 1}',
    )  # fmt: skip

    async def nacked() -> bool:
        try:
            await transport.publish(message({"n": 1}))
        except PublishError as exc:
            assert exc.unknown is False and "rejected" in str(exc)
            return True
        return False

    await wait_until(nacked, timeout=10, interval=0.2)

    # basic.return: the work queue vanished behind our back; only `mandatory` can tell.
    await _delete_queue(rabbit, WORK_QUEUE)
    with pytest.raises(PublishError, match="unroutable") as raised:
        await transport.publish(message({"n": 2}))
    assert raised.value.unknown is False
    # aiormq matches returns by message id: several in flight with one id must all fail.
    same_id = [OutgoingMessage("work", b"{}", {}, "same-id") for _ in range(4)]
    results = await asyncio.gather(*(transport.publish(m) for m in same_id), return_exceptions=True)
    assert all(isinstance(r, PublishError) for r in results), results


@pytest.mark.rabbitmq
async def test_rabbit_delivery_from_before_a_reconnect_is_not_settled_on_its_successor(
    rabbit: Backend, caplog: pytest.LogCaptureFixture
) -> None:
    transport = await rabbit.connected()
    await transport.publish(message({"n": 1}))
    pump = rabbit.pump(transport)
    old = await pump.get()
    await rabbitmqctl("close_all_connections", "-p", _vhost(rabbit), "test")
    again = await pump.get(timeout=30)  # the robust connection restored the consumer
    assert body_of(again) == {"n": 1} and again.redelivered and again.delivery_count == 1
    with caplog.at_level(logging.WARNING, "jobrelay.transport.rabbitmq"):
        # Its delivery tag is 1 on the new channel too: must not be sent, and says so.
        assert await old.ack() is False
    ours = [r for r in caplog.records if r.name == "jobrelay.transport.rabbitmq"]
    assert any("ack ignored" in r.getMessage() for r in ours)
    await pump.stop()
    await transport.close()  # `again` is still unsettled, so it comes back
    last = await rabbit.pump(await rabbit.connected()).get()
    assert body_of(last) == {"n": 1} and last.delivery_count == 2
    await last.ack()


@pytest.mark.rabbitmq
@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.skipif(
    os.environ.get("JOBRELAY_SLOW_BROKER_TESTS") != "1",
    reason="takes ~3 minutes (the broker retries dead-lettering every 180 s); "
    "set JOBRELAY_SLOW_BROKER_TESTS=1",
)
async def test_rabbit_at_least_once_dead_lettering_keeps_a_message_with_no_target(
    rabbit: Backend,
) -> None:
    transport = await rabbit.connected()
    await _delete_queue(rabbit, QUARANTINE_QUEUE)
    await transport.publish(message({"n": 1}))
    pump = rabbit.pump(transport)
    await (await pump.get()).reject()  # at-most-once would drop it right here
    await rabbit.declare()
    await depth_is(transport, 1, timeout=300)


async def _spawn(stderr: Path, *args: str) -> asyncio.subprocess.Process:
    with stderr.open("w") as errors:  # the child keeps its own copy of the descriptor
        return await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "tests.integration.transport_fixtures",
            *args,
            cwd=REPO,
            stdout=asyncio.subprocess.PIPE,
            stderr=errors,
        )
