"""The shipped app, as ``jobrelay.exports.shipped:app``: what runs when no ``--app`` is given.

Defined only through the public API: ``report.export`` is an ``@app.job``; its route
(``POST /v1/exports``), its table (``ledger_entries``) and its commands (``jobrelay seed``,
``jobrelay demo``) are the app's, handed to jobrelay with ``app.http_router``, ``app.tables``
and ``@app.command``. ``notify.email`` is a core effect (it needs the effects ledger, which
the public API does not hand out), included with ``App.include`` and created by the export
through ``ctx.follow_up``.
"""

from __future__ import annotations

import asyncio
import sys
from typing import TYPE_CHECKING

from sqlalchemy.exc import DBAPIError

from jobrelay import App, Settings
from jobrelay.effects.notify_email import NOTIFY_EMAIL, NotifyEmail
from jobrelay.exports import ledger
from jobrelay.exports.report_export import (
    ACCOUNT_PATTERN,
    PERIOD_PATTERN,
    TYPE,
    ExportParams,
    download_name,
    run_export,
)

if TYPE_CHECKING:
    from fastapi import APIRouter


def _router() -> APIRouter:
    from jobrelay.exports.http import export_router  # FastAPI only where HTTP is served

    return export_router(report_export)


app = App()
# Fair by account: one account's burst of exports is admitted in turns with another's first
# export, not ahead of it (``docs/how-to/limits.md``).
report_export = app.job(
    TYPE,
    params=ExportParams,
    result_filename=download_name,
    fair_by=lambda p: p.account_id,
)(run_export)
app.include(NotifyEmail, type=NOTIFY_EMAIL)
app.http_router(_router)
app.tables(ledger.metadata)


@app.command("seed")
def seed_command(
    settings: Settings,
    *,
    rows_per_month: int | None,
    replace: bool = False,
    account: str | None = None,
    period: str | None = None,
    rows: int | None = None,
) -> int:
    """The sample ledgers (kept when already there, unless ``replace``); or, with
    ``account``, ``period`` and ``rows``, one account-month of ``rows`` generated rows (for
    measuring exports at size)."""
    from jobrelay.exports.seed import SeedRefused, seed_database, seed_month_database

    one_month = (account, period, rows)
    if any(v is not None for v in one_month):
        problem = _month_problem(account, period, rows)
        if problem:
            print(f"jobrelay: error: {problem}", file=sys.stderr)
            return 2
    try:
        if account is not None and period is not None and rows is not None:
            n = asyncio.run(seed_month_database(settings.database_url, account, period, rows))
            print(f"{account} {period}: {n} ledger rows")
            return 0
        seeded = asyncio.run(seed_database(settings.database_url, rows_per_month, replace=replace))
    except SeedRefused as exc:
        print(f"jobrelay: error: {exc}", file=sys.stderr)
        return 2
    except (DBAPIError, OSError) as exc:
        lines = str(getattr(exc, "orig", exc)).strip().splitlines()
        print(f"jobrelay: error: seeding failed: {lines[0] if lines else exc!r}", file=sys.stderr)
        return 2
    if not seeded.changed:
        print(
            f"already seeded with {seeded.rows_per_month} rows per month "
            f"({', '.join(seeded.counts)}); nothing changed"
        )
    for name, count in seeded.counts.items():
        print(f"{name}: {count} ledger rows")
    return 0


def _month_problem(account: str | None, period: str | None, rows: int | None) -> str | None:
    if account is None or period is None or rows is None:
        return "--account, --period and --rows go together"
    if not ACCOUNT_PATTERN.fullmatch(account):
        return f"--account {account!r}: expected {ACCOUNT_PATTERN.pattern}"
    if not PERIOD_PATTERN.fullmatch(period):
        return f"--period {period!r}: expected YYYY-MM (1900-01 to 2999-12)"
    return None


@app.command("demo")
def demo_command(settings: Settings) -> int:
    from jobrelay.exports.demo import demo_main

    return demo_main(settings)
