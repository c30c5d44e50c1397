"""One process's SQLite writers take turns in an asyncio lock (``engine.begin_write``).

SQLite has one writer at a time; a ``BEGIN IMMEDIATE`` that finds the lock taken waits in
SQLite's busy handler, which sleeps 1, 2, 5 … 100 ms between looks, and in one ``jobrelay
up`` (claims, completions, settles, relay, API, each on its own pooled connection) those
sleeps were most of the time per job. Here the busy timeout is 0, so a writer that met the
lock held by another connection of this process would fail at once: it must queue instead.
"""

from __future__ import annotations

import asyncio
import sqlite3
from typing import Any

import pytest
from sqlalchemy import Column, Integer, event, text

from jobrelay.errors import StoreDataError, StoreError
from jobrelay.storage import local_queue
from jobrelay.storage.drivers.sqlite_conn import Execute, SqliteHot, Statement, in_transaction
from jobrelay.storage.engine import create_engine, write_lock, write_tx


async def test_writers_of_one_process_queue_instead_of_meeting_the_sqlite_lock(
    sqlite_url: str,
) -> None:
    """While one write transaction is open, a second (the store's and the local
    transport's alike) waits for it and then commits. Old code: the second's ``BEGIN
    IMMEDIATE`` met the lock and, with no busy timeout, failed ("database is locked")."""
    engine = create_engine(sqlite_url)

    @event.listens_for(engine.sync_engine, "connect")
    def _no_busy_wait(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.execute("PRAGMA busy_timeout=0")

    async def store_write() -> None:
        async with write_tx(engine, "database") as conn:
            await conn.execute(text("UPDATE jobs SET attempt = attempt WHERE 0"))

    async def queue_write() -> None:
        async with local_queue.writing(engine) as conn:
            await conn.execute(text("UPDATE local_messages SET queue = queue WHERE 0"))

    try:
        async with write_tx(engine, "database") as first:
            others = [asyncio.create_task(store_write()), asyncio.create_task(queue_write())]
            # Hold the lock while the others start: each statement yields to the loop, and
            # on the old code they would have failed meanwhile.
            for _ in range(200):
                if all(task.done() for task in others):
                    break
                await first.execute(text("SELECT 1"))
            assert not any(task.done() for task in others)
        await asyncio.gather(*others)  # raises the old code's "database is locked"
    finally:
        await engine.dispose()


async def test_a_failed_transaction_on_the_held_connection_leaves_nothing_behind(
    sqlite_url: str,
) -> None:
    """A worker's batch transaction on its held ``sqlite3`` connection (``drivers.sqlite_conn``) is
    all or nothing, like the engine's: a row the database refuses (here an event of no kind:
    ``NOT NULL``) rolls back what the transaction wrote before it, surfaces as a
    ``StoreDataError`` (the batcher then sends each request alone), and the connection is
    left ready for the next batch."""
    engine = create_engine(sqlite_url)
    hot = SqliteHot(engine)
    pause = (
        "INSERT INTO queue_pauses (queue, paused, changed_at, changed_by, reason) "
        "VALUES ('q', 1, '2026-01-01 00:00:00.000000', 'test', 'why')"
    )

    def refused(conn: sqlite3.Connection) -> None:
        conn.execute(pause)
        conn.execute(
            "INSERT INTO job_events (job_id, at, kind, detail) "
            "VALUES ('no-such-job', '2026-01-01 00:00:00.000000', NULL, '{}')"
        )

    def count(conn: sqlite3.Connection) -> int:
        return int(conn.execute("SELECT count(*) FROM queue_pauses").fetchone()[0])

    try:
        async with hot.held():
            assert hot.active
            with pytest.raises(StoreDataError, match="NOT NULL"):
                await hot.transaction(refused, "database")
            assert await hot.transaction(count, "database") == 0
            await hot.transaction(lambda conn: conn.execute(pause), "database")
            assert await hot.transaction(count, "database") == 1
        assert not hot.active
        with pytest.raises(StoreError, match="closed"):
            await hot.transaction(count, "database")
    finally:
        await engine.dispose()


async def test_a_transaction_queued_as_the_held_connection_is_let_go_of_runs_elsewhere(
    sqlite_url: str,
) -> None:
    """A write queued for the process's lock while the held connection's last holder lets
    go of it (a worker stopping, as ``jobrelay up``'s relay publishes) runs through
    SQLAlchemy, and the connection is closed only once no transaction runs on it. Old code:
    the queued write had taken the connection before the lock, the close did not wait for
    the lock, and the write met a closed connection's shut-down thread (``RuntimeError``)."""
    engine = create_engine(sqlite_url)
    hot = SqliteHot(engine)
    holding = hot.held()
    await holding.__aenter__()
    assert hot.active

    def work(run: Execute) -> int:
        return len(run(Statement(text("SELECT 1 AS one").columns(Column("one", Integer()))), {}))

    try:
        async with write_lock(engine):
            queued = asyncio.create_task(in_transaction(engine, hot, work, "test"))
            letting_go = asyncio.create_task(holding.__aexit__(None, None, None))
            for _ in range(50):  # both are waiting for the lock now
                await asyncio.sleep(0)
            assert not queued.done() and not letting_go.done()
        assert await queued == 1
        await letting_go
        assert not hot.active
    finally:
        await engine.dispose()
