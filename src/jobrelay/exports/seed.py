"""Deterministic sample ledgers for ``report.export``: the same rows on every machine.

Accounts ``acme``, ``globex`` and ``initech``, every month of 2019-2021. A few descriptions
are deliberately hostile (formula-like cells) so every export shows the defanging at work.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from datetime import date
from decimal import Decimal
from typing import Any

from sqlalchemy.ext.asyncio import AsyncEngine

import jobrelay
from jobrelay.exports import ledger

ACCOUNTS = ("acme", "globex", "initech")
YEARS = (2019, 2020, 2021)
DEFAULT_ROWS_PER_MONTH = 300

_DESCRIPTIONS = (
    "Invoice payment",
    "Office supplies",
    "Cloud hosting",
    "Consulting fee",
    "Travel reimbursement",
    "Card settlement",
    "Payroll transfer",
    "Refund",
)
_HOSTILE = ('=HYPERLINK("http://example.invalid","click")', "+1-555-0100", "@SUM(A1:A9)", "-2+3")
_COUNTERPARTIES = ("Northwind", "Contoso", "Fabrikam", "Tailspin", "Wingtip", "Litware")


def periods() -> list[str]:
    return [f"{y}-{m:02d}" for y in YEARS for m in range(1, 13)]


def ledger_rows(account_id: str, rows_per_month: int) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for period in periods():
        rng = random.Random(f"{account_id}/{period}")
        year, month = (int(p) for p in period.split("-"))
        for i in range(rows_per_month):
            hostile = i % 97 == 13
            description = rng.choice(_HOSTILE) if hostile else rng.choice(_DESCRIPTIONS)
            cents = rng.randint(-250_000, 500_000)
            rows.append(
                {
                    "account_id": account_id,
                    "booked_on": date(year, month, rng.randint(1, 28)),
                    "period": period,
                    "description": f"{description}" if hostile else f"{description} #{i + 1}",
                    "counterparty": rng.choice(_COUNTERPARTIES),
                    "amount": Decimal(cents) / 100,
                    "currency": "EUR",
                }
            )
    return rows


async def seed(engine: AsyncEngine, rows_per_month: int = DEFAULT_ROWS_PER_MONTH) -> dict[str, int]:
    """Replace each account's ledger with the deterministic sample (creating the table when
    it is missing); idempotent."""
    counts: dict[str, int] = {}
    for account in ACCOUNTS:
        rows = ledger_rows(account, rows_per_month)
        await ledger.replace(engine, account, rows)
        counts[account] = len(rows)
    return counts


class SeedRefused(ValueError):
    """The ledgers hold another sample (or other rows): replacing them needs ``--replace``."""


@dataclass(frozen=True)
class Seeded:
    counts: dict[str, int]  # rows per account, as they are now
    rows_per_month: int | None  # None: the ledgers hold rows that are not a sample
    changed: bool


def sample_size(counts: dict[str, int]) -> int | None:
    """The rows per month of the sample the ledgers hold (0: empty), or None for other rows."""
    months = len(periods())
    sizes = {counts.get(account, 0) for account in ACCOUNTS}
    if len(sizes) != 1 or set(counts) - set(ACCOUNTS):
        return None
    (size,) = sizes
    return size // months if size % months == 0 else None


async def seed_database(
    database_url: str, rows_per_month: int | None = None, *, replace: bool = False
) -> Seeded:
    """``seed`` on a database of its own engine (``jobrelay seed``, ``jobrelay demo``).

    Seeding is idempotent: ledgers that already hold the sample asked for (or any sample,
    when no size is asked for) are kept as they are. Ledgers of another size, or rows that
    are not the sample, are replaced only with ``replace``: ``jobrelay seed`` after
    ``make demo`` must not silently swap the demo's 2,000 rows a month for 300.
    """
    engine = jobrelay.create_engine(database_url)
    try:
        held = await ledger.counts_by_account(engine)
        size = sample_size(held)
        wanted = rows_per_month if rows_per_month is not None else (size or DEFAULT_ROWS_PER_MONTH)
        if not replace and size and size == wanted:
            return Seeded(held, size, changed=False)
        if not replace and size != 0:
            what = f"{size} rows per month" if size is not None else "rows that are not the sample"
            raise SeedRefused(
                f"the ledgers already hold {sum(held.values())} rows ({what}); "
                f"`jobrelay seed --rows-per-month {wanted} --replace` replaces them"
            )
        return Seeded(await seed(engine, wanted), wanted, changed=True)
    finally:
        await engine.dispose()


# Cells a big month carries besides the plain ones: every kind of formula disguise the
# defanging knows, and the CSV's hard cases (quotes, commas, line breaks, non-ASCII).
MONTH_HOSTILE = (
    '=HYPERLINK("http://example.invalid","click")',
    "+1-555-0100",
    "@SUM(A1:A9)",
    "-2+3",
    "  =1+1",
    "\t=1+1",
    "\u00a0=cmd|' /C calc'!A0",
    "\u200b@SUM(A1)",
    "\ufeff+1",
    "\uff1d1+1",
    'Say "hello", then leave',
    "Line one\nline two",
    "Carriage\rreturn",
    "Crlf\r\ninside",
    "Zürich café \u2013 東京 🚀",
    ',"\r"\n',
)


async def seed_month(engine: AsyncEngine, account_id: str, period: str, rows: int) -> int:
    """Replace one account-month with ``rows`` generated rows, in one set-based statement
    (``generate_series`` on PostgreSQL, a recursive CTE on SQLite): the same rows on every
    machine, every 97th description hostile, some amounts negative or near the column's
    limit. For reproducing export figures at size (``jobrelay seed --rows``)."""
    await ledger.ensure_table(engine)
    return await ledger.fill_month(
        engine,
        account_id,
        period,
        rows,
        hostile=MONTH_HOSTILE,
        plain=_DESCRIPTIONS,
        counterparties=_COUNTERPARTIES,
    )


async def seed_month_database(database_url: str, account_id: str, period: str, rows: int) -> int:
    """``seed_month`` on a database of its own engine (``jobrelay seed --rows``)."""
    engine = jobrelay.create_engine(database_url)
    try:
        return await seed_month(engine, account_id, period, rows)
    finally:
        await engine.dispose()
