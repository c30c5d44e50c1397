"""A held SQLite connection whose batch transactions each run whole in its own thread.

Through SQLAlchemy on aiosqlite every step of a transaction is a hand-off to the
connection's thread and back through the event loop: ``BEGIN IMMEDIATE``, then per
statement a cursor, the execute, the fetch, the close, then ``COMMIT``; about a dozen for a
batch of claims. The write lock is held for all of them, and the other writers of the process
(the local transport, the relay, the timeline) queue behind it. A worker on SQLite therefore
holds one plain ``sqlite3`` connection of its own (``SqliteHot.held``, opened before it says it
started) and runs each batch transaction (``transaction``: a function of the connection) in
that connection's thread in ONE hand-off, still queued in the process's write lock
(``engine.write_lock``) and begun ``IMMEDIATE``, exactly as ``engine.begin_write`` does.

The statements are the driver's own (``sqlite_statements``): the same text, compiled once for
SQLite with SQLAlchemy's bind processors (``drivers.compiled``), rows read with the column
types' own result processors. The connection is set up as the engine's are
(``engine.sqlite_session``): WAL, ``synchronous=NORMAL``, the busy timeout, foreign keys; so a
commit is as durable as before. An in-memory database has no second connection to the same
data: there the store keeps to SQLAlchemy.

Failures are told apart as ``engine.store_error`` tells SQLAlchemy's: a refusal of the data
(an integrity or data error, a value the driver cannot bind) is a ``StoreDataError``; anything
else (the file locked past the busy timeout, a disk error) a ``StoreError``.
"""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from sqlalchemy import ColumnElement
from sqlalchemy.dialects.sqlite.aiosqlite import dialect as aiosqlite_dialect
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import AsyncEngine

from jobrelay.errors import StoreBusy, StoreDataError, StoreError
from jobrelay.storage.drivers.compiled import CompiledStatement
from jobrelay.storage.engine import first_line, sqlite_busy, sqlite_session, write_lock, write_tx
from jobrelay.storage.shared import Shared

T = TypeVar("T")

DIALECT = aiosqlite_dialect()
_DATA_ERRORS = (
    sqlite3.IntegrityError,
    sqlite3.DataError,
    sqlite3.ProgrammingError,  # a value the driver cannot bind (an unsupported type)
    OverflowError,  # an integer SQLite cannot hold
    UnicodeEncodeError,  # a lone surrogate
    TypeError,
    ValueError,  # a bind processor refused the value
)


def sqlite_statement(statement: Any) -> CompiledStatement:
    """``statement`` compiled once for SQLite, bound as SQLAlchemy binds it."""
    return CompiledStatement(statement, DIALECT)


class RowReader:
    """Rows of ``columns`` as mappings by name, each value through its type's result
    processor for SQLite (times from text, JSON decoded), as SQLAlchemy would read them."""

    def __init__(self, columns: Iterable[ColumnElement[Any]]) -> None:
        self._columns = [
            (str(c.key), c.type.dialect_impl(DIALECT).result_processor(DIALECT, None))
            for c in columns
        ]

    def read(self, rows: Iterable[Sequence[Any]]) -> list[Mapping[str, Any]]:
        return [
            {
                name: value if process is None else process(value)
                for (name, process), value in zip(self._columns, row, strict=True)
            }
            for row in rows
        ]


def run(
    conn: sqlite3.Connection, statement: CompiledStatement, params: Mapping[str, Any]
) -> list[Any]:
    """One statement on the held connection (in its thread); its rows as tuples."""
    return conn.execute(statement.sql, statement.args(params)).fetchall()


class Statement:
    """A statement, its SQLite compilation for the held connection, and how its rows are
    read: by the columns it declares (``text(…).columns``), the same types on either path;
    a statement that declares none returns no rows."""

    def __init__(self, statement: Any) -> None:
        self.statement = statement
        self.hot = sqlite_statement(statement)
        columns = getattr(statement, "selected_columns", None)
        self.reader = RowReader(columns) if columns is not None else None


# A statement run inside a batch's transaction: its rows, each a mapping by column name.
Execute = Callable[[Statement, Mapping[str, Any]], list[Mapping[str, Any]]]


def on_held(conn: sqlite3.Connection) -> Execute:
    """Statements on the held connection, in its thread."""

    def execute(statement: Statement, params: Mapping[str, Any]) -> list[Mapping[str, Any]]:
        rows = run(conn, statement.hot, params)
        return statement.reader.read(rows) if statement.reader is not None else []

    return execute


def on_sqlalchemy(conn: Connection) -> Execute:
    """The same statements through SQLAlchemy (no connection held: no worker runs here,
    or an in-memory database)."""

    def execute(statement: Statement, params: Mapping[str, Any]) -> list[Mapping[str, Any]]:
        result = conn.execute(statement.statement, params)
        return [dict(row) for row in result.mappings()] if statement.reader is not None else []

    return execute


async def in_transaction(
    engine: AsyncEngine, hot: SqliteHot, work: Callable[[Execute], T], what: str
) -> T:
    """``work`` in one write transaction: on the held connection in one hand-off to its
    thread while someone holds it, else through SQLAlchemy (the same statements either way)."""
    if hot.active:
        try:
            return await hot.transaction(lambda held: work(on_held(held)), what)
        except HeldClosed:
            pass  # let go of while this one queued for the lock: nothing was run on it
    async with write_tx(engine, what) as own:
        return await own.run_sync(lambda sync: work(on_sqlalchemy(sync)))


class HeldClosed(StoreError):
    """The held connection was let go of before the transaction had the write lock."""


class SqliteHot:
    """The connection a worker on a SQLite file holds while it runs (none otherwise)."""

    def __init__(self, engine: AsyncEngine) -> None:
        self._engine = engine
        self._path = engine.url.database
        # The connection and the one thread it is used from, while someone holds them.
        self._shared: Shared[tuple[sqlite3.Connection, ThreadPoolExecutor]] = Shared(
            self._open, self._close
        )
        self.sent = 0  # transactions run on it (tests read it)

    @property
    def active(self) -> bool:
        return self._shared.value is not None

    def held(self) -> contextlib.AbstractAsyncContextManager[None]:
        """Open the connection (now, not in the first burst) for the block."""
        return self._shared.held()

    async def _open(self) -> tuple[sqlite3.Connection, ThreadPoolExecutor] | None:
        if self._path in (None, "", ":memory:"):
            return None  # no second connection to the same data: SQLAlchemy only
        thread = ThreadPoolExecutor(1, thread_name_prefix="jobrelay-sqlite-hot")
        try:
            conn = await asyncio.get_running_loop().run_in_executor(thread, self._connect)
        except (sqlite3.Error, OSError):
            thread.shutdown(wait=False)
            raise
        return conn, thread

    def _connect(self) -> sqlite3.Connection:
        assert self._path is not None
        conn = sqlite3.connect(self._path, timeout=30, check_same_thread=False)
        sqlite_session(conn)
        return conn

    async def transaction(self, work: Callable[[sqlite3.Connection], T], what: str) -> T:
        """``work`` in one write transaction (BEGIN IMMEDIATE … COMMIT), run whole in the
        connection's thread, queued behind the process's other writers. The connection is
        looked at once the lock is ours: its last holder may have let go meanwhile
        (``HeldClosed``, nothing run), and it is closed only under the same lock."""
        async with write_lock(self._engine):
            held = self._shared.value
            if held is None:
                raise HeldClosed(f"{what} write failed: the held SQLite connection is closed")
            conn, thread = held
            self.sent += 1
            try:
                return await asyncio.get_running_loop().run_in_executor(
                    thread, _in_transaction, conn, work
                )
            except _DATA_ERRORS as exc:
                raise StoreDataError(f"{what} write failed: {first_line(exc)}") from exc
            except (sqlite3.Error, OSError) as exc:
                error = StoreBusy if sqlite_busy(exc) else StoreError
                raise error(f"{what} write failed: {first_line(exc)}") from exc

    async def _close(self, held: tuple[sqlite3.Connection, ThreadPoolExecutor]) -> None:
        async with write_lock(self._engine):  # not under a transaction still running on it
            await _close(held)


async def _close(held: tuple[sqlite3.Connection, ThreadPoolExecutor]) -> None:
    conn, thread = held
    await asyncio.get_running_loop().run_in_executor(thread, conn.close)
    thread.shutdown(wait=False)


def _in_transaction(conn: sqlite3.Connection, work: Callable[[sqlite3.Connection], T]) -> T:
    conn.execute("BEGIN IMMEDIATE")
    try:
        result = work(conn)
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise
    return result


__all__ = [
    "DIALECT",
    "Execute",
    "HeldClosed",
    "RowReader",
    "SqliteHot",
    "Statement",
    "in_transaction",
    "on_held",
    "on_sqlalchemy",
    "run",
    "sqlite_statement",
]
