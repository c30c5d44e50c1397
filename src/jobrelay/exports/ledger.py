"""The sample ledger: the export app's own table, and every statement that touches it.

The table is the application's, not jobrelay's: its own ``MetaData``, created (when
missing) by ``App.create_tables`` and by ``jobrelay seed``, never by jobrelay's migrations.
A database migrated before the table left the core migrations already has it, with exactly
this shape, and keeps working.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any
from weakref import WeakSet

from sqlalchemy import (
    BigInteger,
    Column,
    Date,
    Index,
    Integer,
    MetaData,
    Numeric,
    Row,
    String,
    Table,
    Text,
    delete,
    func,
    insert,
    select,
)
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

import jobrelay

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

_INSERT_BATCH = 5000
_ensured: WeakSet[Any] = WeakSet()  # sync engines whose database is known to have the table


async def ensure_table(engine: AsyncEngine) -> None:
    """Create ``ledger_entries`` if it is missing; after the first call, free."""
    if engine.sync_engine in _ensured:
        return
    app = jobrelay.App()
    app.tables(metadata)
    await app.create_tables(engine)
    _ensured.add(engine.sync_engine)


async def count(conn: AsyncConnection, account_id: str, period: str) -> int:
    n = await conn.scalar(
        select(func.count())
        .select_from(ledger_entries)
        .where(ledger_entries.c.account_id == account_id, ledger_entries.c.period == period)
    )
    return int(n or 0)


async def stream(
    conn: AsyncConnection, account_id: str, period: str, batch: int = 1000
) -> AsyncIterator[Row[Any, Any, Any, Any, Any, Any]]:
    """Rows of one account and month, in id order, through a server-side cursor."""
    query = (
        select(
            ledger_entries.c.id,
            ledger_entries.c.booked_on,
            ledger_entries.c.description,
            ledger_entries.c.counterparty,
            ledger_entries.c.amount,
            ledger_entries.c.currency,
        )
        .where(ledger_entries.c.account_id == account_id, ledger_entries.c.period == period)
        .order_by(ledger_entries.c.id)
        .execution_options(yield_per=batch)
    )
    result = await conn.stream(query)
    async for row in result:
        yield row


async def replace(engine: AsyncEngine, account_id: str, rows: Sequence[dict[str, Any]]) -> None:
    """One account's ledger becomes ``rows``, in one transaction."""
    await ensure_table(engine)
    async with engine.begin() as conn:
        await conn.execute(delete(ledger_entries).where(ledger_entries.c.account_id == account_id))
        for start in range(0, len(rows), _INSERT_BATCH):
            await conn.execute(insert(ledger_entries), list(rows[start : start + _INSERT_BATCH]))


def read_failed(exc: DBAPIError | OSError) -> jobrelay.Retry:
    lines = str(getattr(exc, "orig", exc)).strip().splitlines()
    return jobrelay.Retry(f"ledger read failed: {lines[0] if lines else type(exc).__name__}")
