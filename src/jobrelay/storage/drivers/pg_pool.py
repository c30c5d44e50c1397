"""The hot statements on raw asyncpg: connections held, statements prepared, the same SQL.

Through SQLAlchemy every statement pays ``engine.connect`` + AUTOCOMMIT + close, about
170-400 µs of client CPU before the server sees it (issue 23). A worker and a relay run a
few statements over and over (the batched claim, the batched completion, the events that
follow a settle, the relay's claim and mark), so on PostgreSQL they hold a small asyncpg
pool (``HotPool.held``, opened before they say they started) and run those statements on
it. asyncpg prepares each statement once per connection and keeps it (its statement cache).

Nothing is written twice: a ``CompiledStatement`` is the SQLAlchemy statement the store runs
anyway, compiled once for asyncpg, with SQLAlchemy's own bind processors, and its result rows
read by name as the SQLAlchemy path's rows are. The guards and writes in it are the
declarations of ``transitions``. So the two paths run the same text; the driver picks the
held pool when there is one (``PostgresDriver.rows``) and SQLAlchemy otherwise (a completion
with steps of its own, tests that drive the store alone). The API holds a pool of its own, the
intake (``PostgresDriver.write_new_job``): a new job's one statement, up to 20 connections.

Failures are told apart as on SQLAlchemy (``engine.store_error``): a refusal of the data
(SQLSTATE classes 22 and 23, a value asyncpg cannot encode) is a ``StoreDataError``; a lost
connection, a server shutting down, anything else, a ``StoreError`` (an outage: wait, retry).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import asyncpg
from sqlalchemy.dialects.postgresql.asyncpg import dialect as asyncpg_dialect
from sqlalchemy.engine import URL
from sqlalchemy.sql.expression import Executable

from jobrelay import fastjson
from jobrelay.errors import StoreDataError, StoreError
from jobrelay.storage.drivers.compiled import CompiledStatement
from jobrelay.storage.engine import failover_error, first_line, libpq_dsn, refuses_data
from jobrelay.storage.shared import Shared

log = logging.getLogger(__name__)

_DIALECT = asyncpg_dialect()  # type: ignore[no-untyped-call]


def pg_statement(statement: Executable) -> CompiledStatement:
    """``statement`` compiled once for asyncpg, bound as SQLAlchemy binds it."""
    return CompiledStatement(statement, _DIALECT)


# Connections a worker or relay holds: a claim, a completion, the events and the lease
# renewal may be in flight at once; the relay needs two (claim, mark).
HOT_POOL_SIZE = 4
_CLOSE_SECONDS = 5.0


# Each hot statement planned once per connection, generically: they are written for it (one
# statement for a batch of 1 and of 100, ids an index condition whatever the statistics say,
# ``pg_statements._by_id``). Left to choose, PostgreSQL kept planning some afresh at every
# call (their arrays known, the custom plan looked cheaper): auto_explain showed the batched
# claim custom-planned through the whole export drain, about a millisecond each.
_SESSION = {"plan_cache_mode": "force_generic_plan"}


async def _init_connection(conn: asyncpg.Connection) -> None:
    # JSON as the SQLAlchemy dialect reads it (asyncpg would hand back the text).
    for type_name in ("json", "jsonb"):
        await conn.set_type_codec(
            type_name, encoder=str, decoder=fastjson.loads, schema="pg_catalog", format="text"
        )


async def _keep_session(conn: asyncpg.Connection) -> None:
    """No reset when a connection goes back to the pool: asyncpg's default sends
    ``pg_advisory_unlock_all(); CLOSE ALL; UNLISTEN *; RESET ALL`` each time, a round trip
    and a transaction per hot statement. The hot statements change no session state (no
    ``SET``, no ``LISTEN``, no advisory lock, no cursor), so there is nothing to reset."""


class HotPool:
    """The asyncpg connections a worker or relay holds while it runs (none otherwise).

    Held by every role of the process that wants it (``jobrelay up`` holds it twice) and
    closed when the last one lets go.
    """

    def __init__(self, url: URL, size: int = HOT_POOL_SIZE, eager: int | None = None) -> None:
        """``size`` connections at most, ``eager`` of them (all by default) opened at once."""
        self._dsn = libpq_dsn(url)
        self._size = size
        self._eager = size if eager is None else eager
        self._shared: Shared[asyncpg.Pool] = Shared(self._open, _close)
        # Statements that failed on the pool, by exception name: what the engine's
        # ``handle_error`` event counts on the SQLAlchemy path (tests read both).
        self.failures: Counter[str] = Counter()
        self.sent = 0  # statements run on the pool

    @property
    def active(self) -> bool:
        return self._shared.value is not None

    def held(self) -> contextlib.AbstractAsyncContextManager[None]:
        """Open the pool (its connections now, not in the first burst) for the block."""
        return self._shared.held()

    async def _open(self) -> asyncpg.Pool:
        size = self._size
        try:
            return await self._create(self._eager, size)
        except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
            # The database is away right now: connect on demand, as SQLAlchemy would.
            log.warning(
                "hot connections not opened, opening them on demand: %s",
                first_line(exc),
                extra={"event": "hot_pool_deferred"},
            )
            return await self._create(0, size)

    async def _create(self, min_size: int, max_size: int) -> asyncpg.Pool:
        return await asyncpg.create_pool(
            self._dsn,
            min_size=min_size,
            max_size=max_size,
            init=_init_connection,
            reset=_keep_session,
            server_settings=_SESSION,
        )

    async def fetch(
        self, statement: CompiledStatement, params: Mapping[str, Any], what: str = "database"
    ) -> Sequence[asyncpg.Record]:
        """Run ``statement`` on a held connection, in autocommit: one round trip."""
        pool = self._shared.value
        if pool is None:
            raise StoreError(f"{what} write failed: the hot connections are closed")
        self.sent += 1
        try:
            args = statement.args(params)
            async with pool.acquire() as conn:
                rows: list[asyncpg.Record] = await conn.fetch(statement.sql, *args)
        except (
            asyncpg.PostgresError,
            asyncpg.InterfaceError,
            asyncpg.exceptions.InternalClientError,
            OSError,
        ) as exc:
            # InternalClientError: the connection was cut while a statement was still being
            # prepared (seen when its backend is terminated mid-Parse): the connection's fault.
            self.failures[type(exc).__name__] += 1
            if failover_error(exc) or isinstance(exc, _CONNECTION_GONE):
                # The server went, or is a standby now: every held connection may be on it.
                # They are replaced as they are next acquired, on the primary of then.
                await pool.expire_connections()
            raise hot_error(f"{what} write failed", exc) from exc
        except (TypeError, ValueError, OverflowError) as exc:  # a bind processor refused it
            self.failures[type(exc).__name__] += 1
            raise StoreDataError(f"{what} write failed: {first_line(exc)}") from exc
        return rows


class HotResult:
    """A statement's rows on the pool, read as the steps of ``drivers.new_job`` read a
    SQLAlchemy result (``one``, ``first``, ``scalar_one``; a row's columns by attribute)."""

    def __init__(self, rows: Sequence[asyncpg.Record]) -> None:
        self._rows = rows

    def one(self) -> _Row:
        if len(self._rows) != 1:
            raise StoreError(f"database write failed: {len(self._rows)} rows where one was due")
        return _Row(self._rows[0])

    def first(self) -> _Row | None:
        return _Row(self._rows[0]) if self._rows else None

    def scalar_one(self) -> Any:
        return self.one()[0]


class _Row:
    __slots__ = ("_record",)

    def __init__(self, record: asyncpg.Record) -> None:
        self._record = record

    def __getattr__(self, name: str) -> Any:
        try:
            return self._record[name]
        except KeyError:
            raise AttributeError(name) from None

    def __getitem__(self, index: int) -> Any:
        return self._record[index]


# The connection itself is gone (its server stopped, or cut it mid-statement).
_CONNECTION_GONE = (
    OSError,
    asyncpg.exceptions.ConnectionDoesNotExistError,
    asyncpg.exceptions.InternalClientError,
)


def hot_error(message: str, exc: BaseException) -> StoreError:
    """asyncpg's exception as ``engine.store_error`` classifies SQLAlchemy's."""
    text_ = f"{message}: {first_line(exc)}"
    if isinstance(exc, asyncpg.PostgresError):
        data = refuses_data(str(exc.sqlstate or ""))
    else:
        # asyncpg's client-side DataError (a value it cannot encode: an integer out of
        # range) is a ValueError; every other InterfaceError or OSError is the connection.
        data = isinstance(exc, ValueError)
    return StoreDataError(text_) if data else StoreError(text_)


async def _close(pool: asyncpg.Pool) -> None:
    try:
        await asyncio.wait_for(pool.close(), _CLOSE_SECONDS)
    except (TimeoutError, OSError, asyncpg.InterfaceError):
        pool.terminate()


__all__ = ["HOT_POOL_SIZE", "HotPool", "HotResult", "hot_error", "pg_statement"]
