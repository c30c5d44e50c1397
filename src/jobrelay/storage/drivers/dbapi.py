"""Enqueue's steps on a DB-API connection a framework already holds (Django's
``connection.connection``: psycopg 3 or sqlite3), inside the transaction it has open.

Why not wrap the connection in a SQLAlchemy ``Engine`` (``creator=``): the engine's first
connect initializes the dialect on it and then calls ``rollback()``, and returning it to a
pool resets it, which would throw away the caller's order. So each statement of the steps
(the same SQLAlchemy constructs the ``Connection`` path runs: no SQL is written twice) is
compiled for the dialect of that driver, its parameters go through the column types' bind
processors, and it runs on a cursor of the caller's connection. Nothing here begins,
commits, rolls back or closes that connection. A driver's error is raised as SQLAlchemy's
``DBAPIError`` (``.orig`` the driver's), as on the ``Connection`` path.
"""

from __future__ import annotations

import sqlite3
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar, cast

from sqlalchemy import Connection as SAConnection
from sqlalchemy import Executable
from sqlalchemy.dialects.postgresql import psycopg as pg_psycopg
from sqlalchemy.dialects.sqlite import pysqlite
from sqlalchemy.engine import Dialect
from sqlalchemy.exc import DBAPIError, NoResultFound
from sqlalchemy.ext.asyncio import AsyncConnection
from sqlalchemy.sql import ClauseElement
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.types import TypeDecorator

from jobrelay.errors import ConfigError
from jobrelay.storage.steps import Steps

T = TypeVar("T")
# psycopg.Connection or sqlite3.Connection (psycopg is optional: checked at run time).
DBAPIConnection = Any
_DIALECTS: dict[str, Dialect] = {}


def _dialect(name: str) -> Dialect:
    if name not in _DIALECTS:
        made: Dialect = pg_psycopg.dialect() if name == "postgresql" else pysqlite.dialect()  # type: ignore[no-untyped-call]
        _DIALECTS[name] = made
    return _DIALECTS[name]


def dbapi_dialect(conn: object) -> str | None:
    """``postgresql`` for a psycopg 3 connection, ``sqlite`` for a sqlite3 one, else None."""
    if isinstance(conn, sqlite3.Connection):
        return "sqlite"
    psycopg = sys.modules.get("psycopg")  # imported already if conn is one of its connections
    if psycopg is not None and isinstance(conn, psycopg.Connection):
        return "postgresql"
    return None


def dialect_of(conn: SAConnection | AsyncConnection) -> str:
    """``dbapi_dialect`` for a SQLAlchemy connection: the name ``new_job_steps`` takes, passed
    down from the caller's connection and never compared above storage."""
    return conn.dialect.name


def connection_identity(conn: Any, dialect: str) -> str:
    """A name for the database behind ``conn`` (the id keys are cached per database): the
    DSN without its password on PostgreSQL; on SQLite the main file (one PRAGMA)."""
    if dialect == "postgresql":
        return f"postgresql:{conn.info.dsn}"
    rows = conn.execute("PRAGMA database_list").fetchall()
    main = next((r[2] for r in rows if r[1] == "main"), "")
    return f"sqlite:{main or id(conn)}"  # in-memory: this connection alone


def require_atomic(conn: Any, dialect: str) -> None:
    """SQLite writes a job as four statements: in autocommit mode (``isolation_level=None``
    and no transaction open, Django outside ``atomic()``) they would commit one by one."""
    if dialect == "sqlite" and conn.isolation_level is None and not conn.in_transaction:
        raise ConfigError(
            "enqueue_sync",
            "this sqlite3 connection has no transaction open (autocommit): call enqueue_sync"
            " inside your transaction (Django: `with transaction.atomic():`)",
        )


@dataclass(frozen=True)
class _Row:
    """One row: by position or by column name (``row.inserted``), as a SQLAlchemy ``Row``."""

    keys: tuple[str, ...]
    values: tuple[Any, ...]

    def __getattr__(self, name: str) -> Any:
        try:
            return self.values[self.keys.index(name)]
        except ValueError:
            raise AttributeError(name) from None

    def __getitem__(self, index: int) -> Any:
        return self.values[index]


class _Result:
    """What the steps read of a result: ``first``, ``all``, ``one``, ``scalar_one``."""

    def __init__(self, rows: list[_Row]) -> None:
        self._rows = rows

    def first(self) -> _Row | None:
        return self._rows[0] if self._rows else None

    def all(self) -> list[_Row]:
        return list(self._rows)

    def one(self) -> _Row:
        if len(self._rows) != 1:
            raise NoResultFound(f"expected one row, got {len(self._rows)}")
        return self._rows[0]

    def scalar_one(self) -> Any:
        return self.one()[0]


def _result_types(statement: Executable) -> dict[str, Any]:
    """The SQLAlchemy type of each column the statement returns, by name (none for text)."""
    columns: Any = getattr(statement, "selected_columns", None)
    if columns is None:
        columns = getattr(statement, "exported_columns", None) or ()
    return {c.key: c.type for c in columns}


def _execute(
    conn: Any, dialect: Dialect, statement: Executable, params: Mapping[str, Any] | None
) -> _Result:
    # ``render_postcompile``: an ``IN`` over a list becomes one bound value per item here,
    # as SQLAlchemy's own execution would expand it.
    compiled = cast(
        "SQLCompiler",
        cast("ClauseElement", statement).compile(
            dialect=dialect, compile_kwargs={"render_postcompile": True}
        ),
    )
    values = compiled.construct_params(dict(params) if params else None) or {}
    for name, bind in compiled.binds.items():
        if name in values:
            process = bind.type.dialect_impl(dialect).bind_processor(dialect)
            if process is not None:
                values[name] = process(values[name])
    sql = compiled.string
    args: Sequence[Any] | Mapping[str, Any]
    args = [values[n] for n in compiled.positiontup or ()] if dialect.positional else values
    cursor = conn.cursor()
    try:
        cursor.execute(sql, args)
        if cursor.description is None:
            return _Result([])
        keys = tuple(d[0] for d in cursor.description)
        types = _result_types(statement)
        processors = [_result_processor(types[k], dialect) if k in types else None for k in keys]
        pairs = [zip(processors, raw, strict=True) for raw in cursor.fetchall()]
        rows = [_Row(keys, tuple(v if p is None else p(v) for p, v in pair)) for pair in pairs]
        return _Result(rows)
    except (sqlite3.Error, _psycopg_error()) as exc:
        raise DBAPIError.instance(sql, args, exc, _base_error(dialect.name)) from exc
    finally:
        cursor.close()


def _result_processor(type_: Any, dialect: Dialect) -> Callable[[Any], Any] | None:
    """The column type's result processing. A framework may have converters of its own on
    the connection (Django's sqlite3 one parses DATETIME columns): a value that is no longer
    the driver's text skips the dialect's parsing but still gets a ``TypeDecorator``'s
    (``UTCDateTime`` makes it aware)."""
    impl = type_.dialect_impl(dialect)
    full = impl.result_processor(dialect, None)
    decorated = impl.process_result_value if isinstance(impl, TypeDecorator) else None
    if full is None and decorated is None:
        return None

    def process(value: Any) -> Any:
        if value is None:
            return None
        if isinstance(value, str | bytes):
            return full(value) if full is not None else value
        return decorated(value, dialect) if decorated is not None else value

    return process


def _psycopg_error() -> type[Exception]:
    psycopg = sys.modules.get("psycopg")
    return psycopg.Error if psycopg is not None else sqlite3.Error


def _base_error(dialect: str) -> type[Exception]:
    """The driver's ``Error``: SQLAlchemy maps its subclasses (``IntegrityError`` …) by name."""
    return _psycopg_error() if dialect == "postgresql" else sqlite3.Error


def run_dbapi(conn: Any, dialect: str, steps: Steps[T]) -> T:
    """Run ``steps`` on a DB-API connection, inside whatever transaction it has."""
    compiled_for = _dialect(dialect)
    try:
        statement, params = next(steps)
        while True:
            statement, params = steps.send(_execute(conn, compiled_for, statement, params))
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]
