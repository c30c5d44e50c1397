"""The sample ledger: the export app's own table, and every statement that touches it.

The table is the application's, not jobrelay's: its own ``MetaData``, created (when
missing) by ``App.create_tables`` and by ``jobrelay seed``, never by jobrelay's migrations.
A database migrated before the table left the core migrations already has it, with exactly
this shape, and keeps working.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import logging
import sqlite3
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from decimal import Decimal
from typing import Any
from weakref import WeakKeyDictionary

import asyncpg
from sqlalchemy import (
    BigInteger,
    Boolean,
    Column,
    ColumnElement,
    Date,
    Dialect,
    Index,
    Integer,
    MetaData,
    Numeric,
    Select,
    String,
    Table,
    Text,
    and_,
    bindparam,
    case,
    cast,
    column,
    delete,
    event,
    func,
    insert,
    literal,
    or_,
    select,
    text,
)
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

import jobrelay
from jobrelay.exports import defang
from jobrelay.storage.capabilities import capabilities_of

log = logging.getLogger(__name__)

metadata = MetaData(naming_convention={"pk": "pk_%(table_name)s"})

ledger_entries = Table(
    "ledger_entries",
    metadata,
    # BIGINT on PostgreSQL; INTEGER on SQLite, where only that spelling autoincrements.
    Column(
        "id",
        BigInteger().with_variant(Integer, "sqlite"),
        primary_key=True,
        autoincrement=True,
    ),
    Column("account_id", String(64), nullable=False),
    Column("booked_on", Date, nullable=False),
    Column("period", String(7), nullable=False),  # "YYYY-MM", indexed for the export scan
    Column("description", Text, nullable=False),
    Column("counterparty", Text, nullable=False),
    Column("amount", Numeric(14, 2), nullable=False),
    Column("currency", String(3), nullable=False),
)
Index(
    "ix_ledger_account_period",
    ledger_entries.c.account_id,
    ledger_entries.c.period,
    ledger_entries.c.id,
)

# PostgreSQL only: whether every text cell of the row passes the defang's fast test (its first
# character strictly between ``defang.FAST_LOW`` and ``FAST_HIGH``, no separator in it), so
# the export copies the row's cells as they are. Computed when the row is written, once, not
# for every cell of every export: testing each cell inside ``COPY`` doubled the database's
# time per row (issue 41). A stored generated column, so no writer can leave it stale. Not
# in the table's columns: SQLite, whose export defangs in Python, has no such column.


def _plain_cell(name: str) -> str:
    # chr(), not the characters: the statement is logged, and tabs and line breaks in it
    # would not read.
    first = f"ascii({name}) > {defang.FAST_LOW} AND ascii({name}) < {defang.FAST_HIGH}"
    return " AND ".join([first, *(f"strpos({name}, chr({ord(c)})) = 0" for c in defang.SEPARATORS)])


_PLAIN_RULE = " AND ".join(
    _plain_cell(name) for name in ("description", "counterparty", "currency")
)
# The column is named for its rule: a table whose column was made under another fast test (the
# rule's characters changed since) has no column of this name, so the export does not trust
# the old one, and the warning below names the statement that adds the new one.
PLAIN_COLUMN = f"cells_plain_{hashlib.sha256(_PLAIN_RULE.encode()).hexdigest()[:8]}"
ADD_PLAIN_COLUMN = (
    f"ALTER TABLE ledger_entries ADD COLUMN {PLAIN_COLUMN} boolean"
    f" GENERATED ALWAYS AS ({_PLAIN_RULE}) STORED"
)


def with_plain_column(table: Table) -> None:
    """Have ``table`` (a ``ledger_entries``) made with ``PLAIN_COLUMN`` on PostgreSQL."""

    def add(_target: Table, connection: Connection, **_kw: Any) -> None:
        if capabilities_of(connection).copies:  # the column serves the COPY path only
            connection.execute(text(ADD_PLAIN_COLUMN))

    event.listen(table, "after_create", add)


with_plain_column(ledger_entries)

_INSERT_BATCH = 5000
# Sync engines whose database is known to have the table, and whether it has ``PLAIN_COLUMN``.
_ensured: WeakKeyDictionary[Any, bool] = WeakKeyDictionary()


async def ensure_table(engine: AsyncEngine) -> None:
    """Create ``ledger_entries`` if it is missing; after the first call, free.

    A PostgreSQL table created before ``PLAIN_COLUMN`` existed keeps working without it (the
    export then tests every cell, at about half the speed); a warning names the statement
    that adds it, which rewrites the table and so is the operator's call, not an export's.
    """
    if engine.sync_engine in _ensured:
        return
    app = jobrelay.App()
    app.tables(metadata)
    await app.create_tables(engine)
    plain = False
    if capabilities_of(engine).copies:
        async with engine.connect() as conn:
            present, utf8 = (await conn.execute(_HAS_PLAIN)).one()
        # ``ascii()`` is the first character's code point only in UTF8: in another encoding
        # the fast test would not be Python's.
        plain = bool(present and utf8)
        if present and not utf8:
            log.warning(
                "the database is not UTF8: the export tests every cell for the defang",
                extra={"event": "ledger_plain_column_unused"},
            )
        elif not present:
            log.warning(
                "ledger_entries has no %s column: the export tests every cell for the "
                "defang; add it with: %s (then restart the workers)",
                PLAIN_COLUMN,
                ADD_PLAIN_COLUMN,
                extra={"event": "ledger_plain_column_missing"},
            )
    _ensured[engine.sync_engine] = plain


_HAS_PLAIN = text(
    "SELECT EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = 'ledger_entries'::regclass"
    f" AND attname = '{PLAIN_COLUMN}' AND NOT attisdropped),"
    " current_setting('server_encoding') = 'UTF8'"
)


async def counts_by_account(engine: AsyncEngine) -> dict[str, int]:
    """How many rows each account's ledger holds (the table is created when missing)."""
    await ensure_table(engine)
    query = select(ledger_entries.c.account_id, func.count()).group_by(ledger_entries.c.account_id)
    async with engine.connect() as conn:
        rows = (await conn.execute(query)).all()
    return {str(account): int(n) for account, n in rows}


async def count(conn: AsyncConnection, account_id: str, period: str) -> int:
    n = await conn.scalar(
        select(func.count())
        .select_from(ledger_entries)
        .where(ledger_entries.c.account_id == account_id, ledger_entries.c.period == period)
    )
    return int(n or 0)


def _defanged(col: ColumnElement[Any]) -> ColumnElement[Any]:
    """``defang.defang`` in SQL: the regex (``defang.PG_PATTERN``) runs only for cells
    whose first character could matter (``defang.FAST_LOW``, ``FAST_HIGH``), the
    replacement after separators only for cells that hold one."""
    first = func.ascii(col)
    risky = or_(first <= defang.FAST_LOW, first >= defang.FAST_HIGH)
    # Whether the cell holds a separator, by a substring search per separator: every cell
    # pays this test, and four ``strpos`` cost less than one regular expression (measured on
    # 3,000,000 cells: 290 ms against 465 ms of the database's time; issue 41).
    separated = or_(*(func.strpos(col, sep) > 0 for sep in defang.SEPARATORS))
    inner = case(
        (
            separated,
            func.regexp_replace(
                col, defang.SEPARATED_PATTERN, defang.SEPARATED_REPLACEMENT, "g", type_=Text
            ),
        ),
        else_=col,
    )
    return case(
        (and_(risky, col.regexp_match(defang.PG_PATTERN)), literal("'") + inner), else_=inner
    )


def defanged_sql(value: str) -> Select[Any]:
    """One text through the SQL defanging (the tests hold it equal to ``defang.defang``)."""
    return select(_defanged(literal(value, Text)))


def _month(*cells: ColumnElement[Any]) -> Select[Any]:
    return (
        select(*cells)
        .where(
            ledger_entries.c.account_id == bindparam("account_id", type_=String),
            ledger_entries.c.period == bindparam("period", type_=String),
        )
        .order_by(ledger_entries.c.id)
    )


class _Positional:
    """A month's statement compiled once, as the driver takes it (SQL with ``$1``/``?``
    placeholders): compiled per export it was 17 % of a worker's samples in the export
    drain (py-spy, issue 41, item 4), more than the ``COPY`` it sends."""

    def __init__(self, stmt: Select[Any], dialect: Dialect) -> None:
        self.compiled = stmt.compile(dialect=dialect)
        self.sql = str(self.compiled)

    def args(self, **values: Any) -> list[Any]:
        params = self.compiled.construct_params(values)
        return [params[name] for name in self.compiled.positiontup or ()]


class _CopyQuery:
    """``COPY (query)`` takes no parameters: asyncpg's ``copy_from_query(sql, *args)``
    quotes them with a statement of its own first, prepared per call (``_mogrify``: a round
    trip and a prepare per export, 13 % of a drain worker's GIL samples, py-spy, issue 41).
    Here the query is compiled once with every constant inline and a marker per value; each
    export's values are quoted by the dialect's own literal rendering (SQLAlchemy's, which
    doubles quotes and escapes backslashes where the server reads them) and put in place of
    their markers."""

    _MARKER = "jobrelay-copy-value-{}-4b1f0c9e"

    def __init__(self, stmt: Select[Any], dialect: Dialect, names: Sequence[str]) -> None:
        self.names = tuple(names)
        markers = {name: self._MARKER.format(name) for name in names}
        compiled = stmt.params(markers).compile(
            dialect=dialect, compile_kwargs={"literal_binds": True}
        )
        string: Any = String()  # ``literal_processor`` is untyped in SQLAlchemy's stubs
        self._quote: Callable[[Any], str] | None = string.literal_processor(dialect)
        self._template = str(compiled)
        for name in names:
            quoted = self._literal(markers[name])
            if self._template.count(quoted) != 1:
                raise RuntimeError(f"copy query: the marker of {name!r} is not unique")

    def _literal(self, value: str) -> str:
        assert self._quote is not None
        return str(self._quote(value))

    def sql(self, **values: str) -> str:
        sql = self._template
        for name in self.names:
            sql = sql.replace(self._literal(self._MARKER.format(name)), self._literal(values[name]))
        return sql


@functools.cache
def _copy_statement(dialect: Dialect, plain_column: bool) -> _CopyQuery:
    """``copy_month``'s statement; ``plain_column``: the table has ``PLAIN_COLUMN``."""
    c = ledger_entries.c
    texts: list[ColumnElement[Any]] = [
        func.nullif(_defanged(col), "") for col in (c.description, c.counterparty, c.currency)
    ]
    if plain_column:
        plain = column(PLAIN_COLUMN, Boolean)
        texts = [
            case((plain, col), else_=cell)
            for col, cell in zip((c.description, c.counterparty, c.currency), texts, strict=True)
        ]
    stmt = _month(
        *(c.id, c.booked_on, texts[0], texts[1], c.amount, texts[2]),
        bindparam("row_end", type_=Text),
    )
    return _CopyQuery(stmt, dialect, ("account_id", "period", "row_end"))


@functools.cache
def _fetch_statement(dialect: Dialect) -> _Positional:
    c = ledger_entries.c
    texts = [func.coalesce(col, "") for col in (c.description, c.counterparty, c.currency)]
    return _Positional(_month(c.id, c.booked_on, texts[0], texts[1], c.amount, texts[2]), dialect)


async def copy_month(
    conn: AsyncConnection,
    account_id: str,
    period: str,
    row_end: str,
    output: Callable[[bytes], Awaitable[None]],
) -> int:
    """PostgreSQL: the month as CSV from ``COPY``, chunk by chunk into ``output``; the rows
    ``COPY`` reported. Every cell is final: text defanged, and an empty text as NULL, which
    ``COPY`` writes unquoted as Python's csv writes ``""`` (``COPY`` quotes an empty string,
    to tell it from NULL); dates ISO (this transaction's ``DateStyle``); numeric(14,2) as
    ``f"{amount:.2f}"`` prints it; a row whose ``PLAIN_COLUMN`` says no cell needs the
    defang skips it (a plain cell is never empty either). Each row ends with one more cell
    holding ``row_end``, which ``csv_format`` turns into the line end. ``conn`` must be in a
    transaction that has run a statement (``ctx.snapshot()`` has), so the COPY reads the
    same snapshot.
    """
    statement = _copy_statement(conn.dialect, bool(_ensured.get(conn.engine.sync_engine)))
    sql = statement.sql(account_id=account_id, period=period, row_end=row_end)
    driver = (await conn.get_raw_connection()).driver_connection
    assert driver is not None
    try:
        await driver.execute("SET LOCAL DateStyle = 'ISO, YMD'")  # this transaction only
        status = await driver.copy_from_query(sql, output=output, format="csv")
    except asyncpg.UndefinedColumnError as exc:
        _ensured.pop(conn.engine.sync_engine, None)  # dropped since: the next try looks again
        raise read_failed(exc) from exc
    except (asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
        raise read_failed(exc) from exc
    return int(str(status).rsplit(" ", 1)[-1])


async def fetch_month(
    conn: AsyncConnection, account_id: str, period: str, batch: int
) -> AsyncIterator[list[tuple[Any, ...]]]:
    """SQLite: the month's raw rows (NULL text as ``""``), ``batch`` at a time, from the
    driver's own cursor: one hop to aiosqlite's thread per batch and no SQLAlchemy row per
    row (both cost more than the CSV). The next batch is fetched while the caller formats
    this one."""
    statement = _fetch_statement(conn.dialect)
    sql, args = statement.sql, statement.args(account_id=account_id, period=period)
    driver = (await conn.get_raw_connection()).driver_connection
    assert driver is not None
    try:
        cursor = await driver.execute(sql, args)
        ahead = asyncio.ensure_future(cursor.fetchmany(batch))
        try:
            while rows := await ahead:
                ahead = asyncio.ensure_future(cursor.fetchmany(batch))
                yield rows
        finally:
            with contextlib.suppress(BaseException):
                await ahead
            await cursor.close()
    except sqlite3.Error as exc:
        raise read_failed(exc) from exc


async def replace(engine: AsyncEngine, account_id: str, rows: Sequence[dict[str, Any]]) -> None:
    """One account's ledger becomes ``rows``, in one transaction."""
    await ensure_table(engine)
    async with engine.begin() as conn:
        await conn.execute(delete(ledger_entries).where(ledger_entries.c.account_id == account_id))
        for start in range(0, len(rows), _INSERT_BATCH):
            await conn.execute(insert(ledger_entries), list(rows[start : start + _INSERT_BATCH]))


async def fill_month(
    engine: AsyncEngine,
    account_id: str,
    period: str,
    rows: int,
    *,
    hostile: Sequence[str],
    plain: Sequence[str],
    counterparties: Sequence[str],
) -> int:
    """One account-month becomes ``rows`` generated rows, in one transaction and one
    ``INSERT … SELECT`` over a series: row ``g`` is a function of ``g`` alone."""
    year, month = (int(part) for part in period.split("-"))
    if capabilities_of(engine).generates_series:
        series: Any = (
            func.generate_series(1, rows)
            .table_valued(column("g", Integer))
            .render_derived("series")
        )
        g = series.c.g
        booked: ColumnElement[Any] = func.make_date(year, month, g % 28 + 1)
    else:
        start = select(literal(1).label("g")).cte("series", recursive=True)
        series = start.union_all(select(start.c.g + 1).where(start.c.g < rows))
        g = series.c.g
        booked = func.date(f"{period}-01", func.printf("+%d days", g % 28))
    ordinary = _pick(plain, g % len(plain)) + " #" + cast(g, String)
    amount = case(
        (g % 1000 == 7, literal(Decimal("987654321012.34"), Numeric(14, 2))),
        (g % 1000 == 8, literal(Decimal("-987654321012.34"), Numeric(14, 2))),
        else_=((g * 37) % 750001 - 250000) / literal(100.0),
    )
    generated = select(
        literal(account_id, String),
        booked,
        literal(period, String),
        case((g % 97 == 13, _pick(hostile, (g // 97) % len(hostile))), else_=ordinary),
        _pick(counterparties, g % len(counterparties)),
        amount,
        literal("EUR", String),
    ).select_from(series)
    c = ledger_entries.c
    columns = ["account_id", "booked_on", "period", "description", "counterparty", "amount"]
    async with engine.begin() as conn:
        await conn.execute(
            delete(ledger_entries).where(c.account_id == account_id, c.period == period)
        )
        await conn.execute(insert(ledger_entries).from_select([*columns, "currency"], generated))
    if capabilities_of(engine).vacuums:
        # What autovacuum would do next (it is off on some machines): the planner's
        # statistics, and a visibility map, so the export's count is an index-only scan.
        async with engine.connect() as conn:
            await conn.execution_options(isolation_level="AUTOCOMMIT")
            await conn.execute(text("VACUUM (ANALYZE) ledger_entries"))
    return rows


def _pick(values: Sequence[str], index: ColumnElement[Any]) -> ColumnElement[Any]:
    return case({i: literal(v, Text) for i, v in enumerate(values)}, value=index)


def read_failed(exc: BaseException) -> jobrelay.Retry:
    """A retry whose message the customer reads; the driver's error (raised ``from exc``)
    reaches the operators only."""
    return jobrelay.Retry("ledger read failed")
