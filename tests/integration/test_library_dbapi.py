"""``enqueue_sync`` on the DB-API connection a framework holds (psycopg 3, sqlite3): the job
commits or rolls back with the caller's own write, and jobrelay never ends the transaction."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from pydantic import BaseModel
from sqlalchemy import create_engine, func, select
from sqlalchemy.engine import make_url

import jobrelay
from jobrelay.storage.tables import installation, job_events, jobs, outbox


class Ping(BaseModel):
    n: int


app = jobrelay.App()


@app.job("tests.ping", params=Ping)
def ping(ctx: jobrelay.SyncJobContext[Ping], params: Ping) -> None:
    return None


def _raw(database_url: str) -> Any:
    url = make_url(database_url)
    if url.get_backend_name() == "sqlite":
        return sqlite3.connect(url.database or "")
    return psycopg.connect(url.set(drivername="postgresql").render_as_string(False))


@pytest.fixture
def raw(database_url: str) -> Iterator[Any]:
    conn = _raw(database_url)
    conn.execute("CREATE TABLE orders (id INTEGER PRIMARY KEY, what TEXT)")
    conn.commit()
    try:
        yield conn
    finally:
        conn.close()


def _counts(database_url: str, job_id: str) -> tuple[int, int, int, int]:
    """(orders, jobs, outbox rows, events) as another connection sees them."""
    engine = create_engine(make_url(database_url).set(drivername=_sync_driver(database_url)))
    try:
        with engine.connect() as conn:
            orders = conn.exec_driver_sql("SELECT count(*) FROM orders").scalar_one()
            found = [
                conn.execute(select(func.count()).where(t.c[c] == job_id)).scalar_one()
                for t, c in ((jobs, "id"), (outbox, "job_id"), (job_events, "job_id"))
            ]
    finally:
        engine.dispose()
    return orders, found[0], found[1], found[2]


def _sync_driver(database_url: str) -> str:
    return "sqlite" if database_url.startswith("sqlite") else "postgresql+psycopg"


def test_the_job_commits_with_the_callers_write_and_is_not_committed_by_jobrelay(
    raw: Any, database_url: str
) -> None:
    raw.execute("INSERT INTO orders (id, what) VALUES (1, 'shoes')")
    job_id = ping.enqueue_sync(raw, {"n": 1})
    # Still the caller's open transaction: nothing is visible to anyone else yet.
    assert (
        raw.in_transaction if isinstance(raw, sqlite3.Connection) else raw.info.transaction_status
    )
    assert _counts(database_url, job_id) == (0, 0, 0, 0)
    raw.commit()
    assert _counts(database_url, job_id) == (1, 1, 1, 1)


def test_a_rollback_leaves_neither_the_write_nor_the_job(raw: Any, database_url: str) -> None:
    raw.execute("INSERT INTO orders (id, what) VALUES (1, 'shoes')")
    job_id = ping.enqueue_sync(raw, {"n": 2})
    raw.rollback()
    assert _counts(database_url, job_id) == (0, 0, 0, 0)


def test_a_key_gives_the_same_job_again_and_other_params_conflict(raw: Any) -> None:
    first = ping.enqueue_sync(raw, {"n": 3}, key="order-1")
    assert ping.enqueue_sync(raw, {"n": 3}, key="order-1") == first
    with pytest.raises(jobrelay.IdempotencyConflict, match="key 'order-1'"):
        ping.enqueue_sync(raw, {"n": 4}, key="order-1")
    raw.rollback()


def test_no_schema_says_to_run_db_upgrade(tmp_path: Any) -> None:
    conn = sqlite3.connect(tmp_path / "empty.db")
    try:
        with pytest.raises(jobrelay.ConfigError, match="db upgrade"):
            ping.enqueue_sync(conn, {"n": 1})
    finally:
        conn.close()


def test_sqlite_in_autocommit_is_refused_as_its_writes_would_commit_one_by_one(
    sqlite_url: str,
) -> None:
    conn = sqlite3.connect(make_url(sqlite_url).database or "", isolation_level=None)
    try:
        with pytest.raises(jobrelay.ConfigError, match=r"transaction\.atomic\(\)"):
            ping.enqueue_sync(conn, {"n": 1})
        conn.execute("BEGIN")
        assert ping.enqueue_sync(conn, {"n": 1})
        conn.execute("ROLLBACK")
    finally:
        conn.close()


class _NotAConnection:
    pass


@pytest.mark.parametrize("wrong", [_NotAConnection(), "sqlite:///x.db"])
def test_anything_else_is_one_sentence_naming_what_to_pass(wrong: object) -> None:
    with pytest.raises(jobrelay.ConfigError) as raised:
        ping.enqueue_sync(wrong, {"n": 1})
    message = str(raised.value)
    assert "SQLAlchemy Connection" in message and "psycopg 3 or sqlite3" in message
    assert "connection.connection" in message and type(wrong).__qualname__ in message
    assert "\n" not in message


async def test_an_asyncpg_connection_is_refused_too(pg_url: str) -> None:
    import asyncpg

    conn = await asyncpg.connect(
        make_url(pg_url).set(drivername="postgresql").render_as_string(False)
    )
    try:
        with pytest.raises(jobrelay.ConfigError, match="psycopg 3 or sqlite3"):
            ping.enqueue_sync(conn, {"n": 1})
    finally:
        await conn.close()


def test_a_frameworks_own_datetime_converter_does_not_confuse_the_keys_read(
    sqlite_url: str,
) -> None:
    """Django's sqlite3 connections parse DATETIME columns themselves (``detect_types``): the
    installation row's ``previous_until``, read while a rotation window is open, still comes
    back aware, and the keyed id is the one the SQLAlchemy path derives."""
    path = make_url(sqlite_url).database or ""
    sqlite3.register_converter("datetime", lambda b: datetime.fromisoformat(b.decode()))
    engine = create_engine(sqlite_url)
    try:
        with engine.begin() as conn:
            until = datetime.now(UTC) + timedelta(hours=1)
            conn.execute(
                installation.update().values(previous_id_secret="ab" * 32, previous_until=until)
            )
        other = jobrelay.App()
        pong = other.job("tests.ping", params=Ping)(ping.fn)
        with engine.begin() as conn:
            expected = pong.enqueue_sync(conn, {"n": 9}, key="k-9")
        raw = sqlite3.connect(path, detect_types=sqlite3.PARSE_DECLTYPES)
        try:
            fresh = jobrelay.App()
            again = fresh.job("tests.ping", params=Ping)(ping.fn)
            assert again.enqueue_sync(raw, {"n": 9}, key="k-9") == expected
            raw.rollback()
        finally:
            raw.close()
    finally:
        engine.dispose()


def test_many_jobs_and_a_job_after_them_on_the_frameworks_connection(
    raw: Any, database_url: str
) -> None:
    """Issue 37: ``enqueue_many_sync`` and ``after=`` on a raw DB-API connection (a list bound
    into one statement, an ``IN`` over the dependencies' ids)."""
    ids = ping.enqueue_many_sync(raw, [{"n": i} for i in range(700)], keys=None)
    again = ping.enqueue_many_sync(raw, [{"n": 1}, {"n": 2}], keys=["k-1", "k-2"])
    assert ping.enqueue_many_sync(raw, [{"n": 1}, {"n": 2}], keys=["k-1", "k-2"]) == again
    total = ping.enqueue_sync(raw, {"n": -1}, after=ids[:3])
    raw.commit()
    for job_id in (*ids, *again):
        assert _counts(database_url, job_id)[1:] == (1, 1, 1), job_id
    # Waiting: the job and its event, no outbox row until its dependencies have ended.
    assert _counts(database_url, total)[1:] == (1, 0, 1)
