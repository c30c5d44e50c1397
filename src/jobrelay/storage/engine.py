"""Engines and migrations: the only place that knows the URL schemes and driver quirks.

SQLite needs three things to be a safe shared queue for several processes: WAL (readers do
not block the writer), a busy timeout (writers wait instead of failing), and ``BEGIN
IMMEDIATE`` (a transaction takes the write lock up front, so two claimers cannot both read
the same row and then deadlock upgrading their locks).
"""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import weakref
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit, urlunsplit

from sqlalchemy import event, text
from sqlalchemy.engine import URL, ExceptionContext, make_url
from sqlalchemy.exc import DataError, DBAPIError, IntegrityError, StatementError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine
from sqlalchemy.pool import StaticPool

from jobrelay.errors import ConfigError, StoreBusy, StoreDataError, StoreError

if TYPE_CHECKING:
    from alembic.config import Config

MIGRATIONS_DIR = Path(__file__).parent / "migrations"
# The newest migration's revision: what the code expects the database to be at. Bump it
# with every new migration (tests/integration/test_migrations.py checks it is the head).
SCHEMA_HEAD = "0024"
VERSION_TABLE = "alembic_version"
# Execution option marking a connection that only reads (SQLite then begins DEFERRED).
READ_ONLY_OPTION = "jobrelay_read_only"


def async_url(database_url: str) -> URL:
    """Map the user-facing URL (``postgresql://``, ``sqlite:///``) to its async driver."""
    from jobrelay.settings import check_database_url

    check_database_url(database_url)  # the library's callers do not pass through Settings
    url = sqlalchemy_url(database_url)
    if url.drivername in ("postgresql", "postgresql+asyncpg"):
        return url.set(drivername="postgresql+asyncpg")
    if url.drivername in ("sqlite", "sqlite+aiosqlite"):
        return url.set(drivername="sqlite+aiosqlite")
    raise ConfigError("JOBRELAY_DATABASE_URL", f"unsupported scheme {url.drivername!r}")


def sqlalchemy_url(database_url: str) -> URL:
    """The URL as SQLAlchemy reads it. Several PostgreSQL hosts in libpq's form
    (``postgresql://u@h1:5432,h2:5432/db``, a primary and its standbys) become SQLAlchemy's
    (``?host=h1:5432&host=h2:5432``), which its asyncpg and psycopg dialects pass on: each
    connection tries them in turn. With several hosts, only a host that takes writes is kept
    (``target_session_attrs=read-write``) unless the URL asks otherwise: a standby answers
    read-only, and jobrelay writes on every connection."""
    parts = urlsplit(database_url)
    userinfo, at, hosts = parts.netloc.rpartition("@")
    if "," not in hosts:
        return make_url(database_url)
    url = make_url(urlunsplit(parts._replace(netloc=f"{userinfo}@" if at else "")))
    query = dict(url.query)
    query["host"] = tuple(hosts.split(","))
    query.setdefault("target_session_attrs", "read-write")
    return url.set(query=query)


def libpq_dsn(url: URL) -> str:
    """``url`` as libpq's DSN, for a session outside SQLAlchemy's pools (asyncpg's own: the
    held connections, ``LISTEN``, the leader's lock): several hosts back in the netloc
    (``h1:5432,h2:5432``), which asyncpg reads, the other parameters kept."""
    plain = url.set(drivername="postgresql")
    hosts = plain.query.get("host")
    if not isinstance(hosts, tuple):
        return plain.render_as_string(hide_password=False)
    rest = {k: v for k, v in plain.query.items() if k != "host"}
    one = plain.set(host="HOSTS", port=None, query=rest).render_as_string(hide_password=False)
    return one.replace("@HOSTS", "@" + ",".join(hosts), 1)


def create_engine(database_url: str) -> AsyncEngine:
    url = async_url(database_url)
    if url.get_backend_name() == "sqlite":
        return _sqlite_engine(url)
    # Up to 20 connections, all kept once opened: with 10 kept and 10 "overflow" ones, an API
    # under 32 concurrent requests closed and reopened connections all the time (a backend
    # fork and a handshake each; 7% of the API's CPU in a profile).
    engine = create_async_engine(url, pool_size=20, max_overflow=0)

    @event.listens_for(engine.sync_engine, "handle_error")
    def _moved(context: ExceptionContext) -> None:
        # The server is going or has gone, or is (now) a standby: every pooled connection
        # may be on it, so SQLAlchemy drops them all and the next connect finds the primary.
        if failover_error(context.original_exception):
            context.is_disconnect = True

    return engine


# SQLSTATEs of a server that is not (or no longer) the primary: a standby refusing a write
# (25006), an operator's or a failover's shutdown (57P01 admin_shutdown, 57P02
# crash_shutdown), a server still starting or in recovery (57P03 cannot_connect_now), and the
# connection exceptions (class 08).
FAILOVER_SQLSTATES = frozenset({"25006", "57P01", "57P02", "57P03"})


def failover_error(exc: BaseException | None) -> bool:
    """Whether ``exc`` (a driver's) says the connection's server is not the primary now."""
    state = sqlstate_of(exc)
    return state in FAILOVER_SQLSTATES or state.startswith("08")


def _sqlite_engine(url: URL) -> AsyncEngine:
    # The file's directory is never created here: a mistyped path must fail, not leave
    # directories behind (db upgrade's rule is in database_files.py).
    memory = url.database in (None, "", ":memory:")
    kwargs: dict[str, Any] = {"connect_args": {"timeout": 30}}
    if memory:
        kwargs["poolclass"] = StaticPool
    engine = create_async_engine(url, **kwargs)
    path = None if memory or url.query.get("uri") else Path(str(url.database)).expanduser()

    @event.listens_for(engine.sync_engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        sqlite_session(dbapi_connection, memory=memory)

    @event.listens_for(engine.sync_engine, "do_connect")
    def _before_connect(*_args: Any) -> None:
        # A newcomer's first connection before `jobrelay db upgrade` (the application's own
        # table, an enqueue) on the embedded default, whose ./var does not exist yet: SQLite
        # would say only "unable to open database file" (and aiosqlite leave a thread behind
        # that prints a traceback at exit). Say what the CLI says, before trying.
        if path is not None and not path.parent.is_dir():
            raise no_database(path)

    @event.listens_for(engine.sync_engine, "begin")
    def _on_begin(conn: Any) -> None:
        # Readers (status reads, the export's row stream) must not hold the write lock.
        read_only = conn.get_execution_options().get(READ_ONLY_OPTION, False)
        conn.exec_driver_sql("BEGIN" if read_only else "BEGIN IMMEDIATE")

    return engine


def no_database(path: Path, why: str = "") -> ConfigError:
    """The one line for an SQLite database that does not exist yet (CLI and library)."""
    return ConfigError(
        "JOBRELAY_DATABASE_URL",
        f"no database at {path}{why}: run `jobrelay db upgrade` to create it, or fix the path",
    )


def sqlite_session(dbapi_connection: Any, *, memory: bool = False) -> None:
    """How every SQLite connection of jobrelay's is set up (the engine's, the driver's held
    one): WAL, a busy timeout, foreign keys, ``synchronous=NORMAL``, and BEGIN issued by us
    (pysqlite's implicit BEGIN is DEFERRED)."""
    dbapi_connection.isolation_level = None
    cursor = dbapi_connection.cursor()
    if not memory:
        cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA busy_timeout=30000")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.close()


def alembic_config(database_url: str) -> Config:
    # Alembic is imported here, not at the top: only `db upgrade` and the tests migrate, and a
    # worker should not carry Alembic and Mako in its memory for its whole life.
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    # ``%`` doubled: Alembic's config is a ConfigParser, which reads ``%`` as interpolation
    # (an escaped ``:`` of a host list, a ``%40`` in a password).
    rendered = async_url(database_url).render_as_string(False)
    config.set_main_option("sqlalchemy.url", rendered.replace("%", "%%"))
    return config


def upgrade(database_url: str, revision: str = "head") -> None:
    """Apply migrations; safe to run again (Alembic records the version)."""
    from alembic import command

    command.upgrade(alembic_config(database_url), revision)


async def upgrade_async(database_url: str, revision: str = "head") -> None:
    # Alembic's env.py runs its own event loop, so run it in a thread.
    await asyncio.to_thread(upgrade, database_url, revision)


async def check_reachable(engine: AsyncEngine) -> None:
    """Raise StoreError with a short reason when the database cannot be queried."""
    try:
        async with engine.connect() as conn:
            await conn.execute(text("SELECT 1"))
    except Exception as exc:
        raise StoreError(f"database unreachable: {_short(exc)}") from exc


def _short(exc: BaseException) -> str:
    text_ = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text_[0] if text_ else ''}"


@contextlib.asynccontextmanager
async def read_only(engine: AsyncEngine) -> AsyncIterator[AsyncConnection]:
    """A read transaction that, on SQLite, begins DEFERRED and so never waits for writers."""
    async with engine.connect() as conn:
        await conn.execution_options(**{READ_ONLY_OPTION: True})
        async with conn.begin():
            yield conn


@contextlib.asynccontextmanager
async def snapshot(engine: AsyncEngine) -> AsyncIterator[AsyncConnection]:
    """A read-only transaction whose reads all see ONE state of the database, taken on entry.

    PostgreSQL: ``REPEATABLE READ READ ONLY`` (the snapshot is the first statement's, so one
    is run here: a ``COPY`` sent on the driver connection right after entry still reads it).
    SQLite: a DEFERRED transaction, whose WAL read snapshot begins with its first read, so
    one is made here too; it never waits for writers and writers never wait for it.
    """
    async with engine.connect() as conn:
        options: dict[str, Any] = {READ_ONLY_OPTION: True}
        if engine.dialect.name == "postgresql":
            options.update(isolation_level="REPEATABLE READ", postgresql_readonly=True)
        await conn.execution_options(**options)
        async with conn.begin():
            postgres = engine.dialect.name == "postgresql"
            await conn.execute(_SNAPSHOT_START_PG if postgres else _SNAPSHOT_START_SQLITE)
            yield conn


_SNAPSHOT_START_PG = text("SELECT 1")
_SNAPSHOT_START_SQLITE = text("SELECT 1 FROM sqlite_master LIMIT 1")  # reads a page


# What a statement's driver, connection or binding raises; ``store_error`` tells a refusal of
# the data (retrying cannot help) from an outage.
_DRIVER_ERRORS = (StatementError, OSError, OverflowError, UnicodeEncodeError)


# One asyncio lock per SQLite engine and event loop: the process's writers take turns here.
_WRITE_LOCKS: weakref.WeakKeyDictionary[Any, weakref.WeakKeyDictionary[Any, asyncio.Lock]] = (
    weakref.WeakKeyDictionary()
)


def write_lock(engine: AsyncEngine) -> asyncio.Lock:
    by_loop = _WRITE_LOCKS.setdefault(engine.sync_engine, weakref.WeakKeyDictionary())
    loop = asyncio.get_running_loop()
    lock = by_loop.get(loop)
    if lock is None:
        lock = by_loop[loop] = asyncio.Lock()
    return lock


@contextlib.asynccontextmanager
async def begin_write(engine: AsyncEngine) -> AsyncIterator[AsyncConnection]:
    """``engine.begin()`` for a write; on SQLite the process's writers queue for it first.

    SQLite has one writer at a time; a second ``BEGIN IMMEDIATE`` waits in SQLite's busy
    handler, which sleeps 1, 2, 5, 10 … up to 100 ms between looks at the lock. With the
    claims, completions, settles, relay and API of one ``jobrelay up`` each on its own pooled
    connection, those sleeps were most of the time per job. Queued in an asyncio lock, the
    next writer starts as soon as the last commits; other processes still meet the busy
    timeout. The transactions are the same ones, so is their durability.
    """
    if engine.dialect.name == "postgresql":
        async with engine.begin() as conn:
            yield conn
        return
    async with write_lock(engine), engine.begin() as conn:
        yield conn


@contextlib.asynccontextmanager
async def write_tx(engine: AsyncEngine, what: str) -> AsyncIterator[AsyncConnection]:
    """A write transaction whose driver errors surface as StoreError("<what> write failed")."""
    try:
        async with begin_write(engine) as conn:
            yield conn
    except _DRIVER_ERRORS as exc:
        raise store_error(f"{what} write failed", exc) from exc


@contextlib.asynccontextmanager
async def statement_tx(engine: AsyncEngine, what: str) -> AsyncIterator[AsyncConnection]:
    """``write_tx`` for ONE statement that is its own transaction.

    On PostgreSQL it is sent in autocommit mode: no ``BEGIN`` and no ``COMMIT`` round trip,
    the statement commits by itself (a data-modifying CTE is still all or nothing). SQLite
    has no round trips to save, and its hot-path writes are several statements: a normal
    ``BEGIN IMMEDIATE`` transaction there.
    """
    if engine.dialect.name != "postgresql":
        async with write_tx(engine, what) as conn:
            yield conn
        return
    try:
        async with engine.connect() as conn:
            await conn.execution_options(isolation_level="AUTOCOMMIT")
            yield conn
    except _DRIVER_ERRORS as exc:
        raise store_error(f"{what} write failed", exc) from exc


@contextlib.asynccontextmanager
async def read_tx(engine: AsyncEngine, what: str) -> AsyncIterator[AsyncConnection]:
    """``read_only`` whose driver errors surface as StoreError("<what> read failed")."""
    try:
        async with read_only(engine) as conn:
            yield conn
    except _DRIVER_ERRORS as exc:
        raise store_error(f"{what} read failed", exc) from exc


# SQLSTATE classes of a refusal of the data itself: 22 data exception (a NUL byte in text,
# a value out of range, bad JSON), 23 integrity constraint violation. Everything else (08
# connection, 40 serialization failure and deadlock, 53 resources, 57 operator intervention
# such as an admin shutdown, and what we cannot tell) is treated as an outage: wait, retry.
_DATA_SQLSTATE_CLASSES = ("22", "23")


def sqlstate_of(exc: BaseException | None) -> str:
    """The SQLSTATE a driver's exception carries ('' if none): asyncpg's and psycopg's."""
    return str(getattr(exc, "sqlstate", None) or getattr(exc, "pgcode", None) or "")


def refuses_data(sqlstate: str) -> bool:
    """Whether the server refused the values themselves (retrying cannot help)."""
    return sqlstate[:2] in _DATA_SQLSTATE_CLASSES


def store_error(message: str, exc: BaseException) -> StoreError:
    """The driver's error as a StoreError, or a StoreDataError when retrying cannot help.

    A data error is one the same write hits every time: the server refused the values
    (SQLSTATE class 22 or 23, or SQLite's integrity and data errors), or they could not even
    be bound (a ``StatementError`` that is no driver error: a value the JSON encoder refuses;
    an ``OverflowError``: an integer SQLite cannot hold; a ``UnicodeEncodeError``: a str
    with a lone surrogate, which no UTF-8 database can hold).
    """
    text_ = f"{message}: {first_line(exc)}"
    if isinstance(exc, (IntegrityError, DataError)):
        return StoreDataError(text_)
    if isinstance(exc, DBAPIError):
        if exc.connection_invalidated:
            return StoreError(text_)
        if sqlite_busy(exc.orig):
            return StoreBusy(text_)
        if refuses_data(sqlstate_of(exc.orig)):
            return StoreDataError(text_)
        return StoreError(text_)
    if isinstance(exc, (StatementError, OverflowError, UnicodeEncodeError)):
        return StoreDataError(text_)
    return StoreError(text_)


def sqlite_busy(exc: BaseException | None) -> bool:
    """SQLite answered that another connection holds the lock it needs (past the busy
    timeout): the database is there, it only cannot take this write yet."""
    code = getattr(exc, "sqlite_errorcode", None)
    return isinstance(exc, sqlite3.OperationalError) and code in (
        sqlite3.SQLITE_BUSY,
        sqlite3.SQLITE_LOCKED,
    )


def first_line(exc: BaseException) -> str:
    """The driver's own message, first line only: enough to act on, no stack of wrappers."""
    lines = str(getattr(exc, "orig", exc)).strip().splitlines()
    return lines[0] if lines else type(exc).__name__
