"""The sample ledger that report.export reads and ``jobrelay seed`` writes."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any

from sqlalchemy import (
    Row,
    delete,
    func,
    insert,
    select,
)
from sqlalchemy.exc import DBAPIError

from jobrelay.errors import StoreError
from jobrelay.storage.base import StoreBase
from jobrelay.storage.engine import READ_ONLY_OPTION, first_line
from jobrelay.storage.tables import (
    ledger_entries,
)


class LedgerStore(StoreBase):
    async def ledger_count(self, account_id: str, period: str) -> int:
        async with self.reading() as conn:
            n = await conn.scalar(
                select(func.count())
                .select_from(ledger_entries)
                .where(ledger_entries.c.account_id == account_id, ledger_entries.c.period == period)
            )
        return int(n or 0)

    async def stream_ledger(
        self, account_id: str, period: str, batch: int = 1000
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
        try:
            async with self.engine.connect() as conn:
                await conn.execution_options(**{READ_ONLY_OPTION: True})
                async with conn.begin():
                    result = await conn.stream(query)
                    async for row in result:
                        yield row
        except (DBAPIError, OSError) as exc:
            raise StoreError(f"ledger read failed: {first_line(exc)}") from exc

    async def replace_ledger(self, account_id: str, rows: Sequence[dict[str, Any]]) -> None:
        async with self.writing() as conn:
            await conn.execute(
                delete(ledger_entries).where(ledger_entries.c.account_id == account_id)
            )
            for start in range(0, len(rows), 5000):
                await conn.execute(insert(ledger_entries), list(rows[start : start + 5000]))
