"""The connections an enqueue runs on, each checked once for every ``enqueue*`` verb: the
caller's ``AsyncConnection``, its SQLAlchemy ``Connection``, or the DB-API connection a
framework holds (psycopg 3, sqlite3), inside a transaction that is never committed here."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from sqlalchemy import Connection, Engine
from sqlalchemy.ext.asyncio import AsyncConnection

from jobrelay.errors import ConfigError
from jobrelay.library.definition_checks import RAW_KINDS, schema_missing_hint, wrong_connection
from jobrelay.storage.drivers.dbapi import (
    DBAPIConnection,
    connection_identity,
    dbapi_dialect,
    dialect_of,
    require_atomic,
    run_dbapi,
)
from jobrelay.storage.steps import Steps, run_async, run_sync

T = TypeVar("T")
# The statements to run, given the database (an engine, or a DB-API connection's identity:
# what the installation's id keys are cached by) and its dialect.
StepsFor = Callable[[Engine | str, str], Steps[T]]


async def on_async(verb: str, conn: AsyncConnection, steps_for: StepsFor[T]) -> T:
    if not isinstance(conn, AsyncConnection):
        raise ConfigError(verb, wrong_connection(conn, "AsyncConnection", "begin()"))
    with schema_missing_hint(verb):
        return await run_async(conn, steps_for(conn.sync_engine, dialect_of(conn)))


def on_sync(
    verb: str, conn: Connection | DBAPIConnection, steps_for: StepsFor[T], *, keyed: bool
) -> T:
    """``keyed``: the jobs' ids derive from keys, so the id keys are read and cached for this
    database (a DB-API connection is told apart by its identity then, not its dialect)."""
    if isinstance(conn, Connection):
        with schema_missing_hint(verb):
            return run_sync(conn, steps_for(conn.engine, dialect_of(conn)))
    dialect = dbapi_dialect(conn)
    if dialect is None:
        raise ConfigError(verb, wrong_connection(conn, "Connection", "begin()", RAW_KINDS))
    require_atomic(conn, dialect)
    with schema_missing_hint(verb):
        database = connection_identity(conn, dialect) if keyed else dialect
        return run_dbapi(conn, dialect, steps_for(database, dialect))
