"""The shipped app, as ``jobrelay.exports.app:app``: what runs when no ``--app`` is given.

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

import typer
from sqlalchemy.exc import DBAPIError

from jobrelay import App, Settings
from jobrelay.effects.notify_email import NOTIFY_EMAIL, NotifyEmail
from jobrelay.exports import ledger
from jobrelay.exports.http import router
from jobrelay.exports.report_export import TYPE, ExportParams, download_name, run_export

app = App()
report_export = app.job(TYPE, params=ExportParams, result_filename=download_name)(run_export)
app.include(NotifyEmail, type=NOTIFY_EMAIL)
app.http_router(router)
app.tables(ledger.metadata)


@app.command("seed")
def seed_command(settings: Settings, *, rows_per_month: int) -> int:
    from jobrelay.exports.seed import seed_database

    try:
        counts = asyncio.run(seed_database(settings.database_url, rows_per_month))
    except (DBAPIError, OSError) as exc:
        lines = str(getattr(exc, "orig", exc)).strip().splitlines()
        print(f"jobrelay: error: seeding failed: {lines[0] if lines else exc!r}", file=sys.stderr)
        return 2
    for account, n in counts.items():
        typer.echo(f"{account}: {n} ledger rows")
    return 0


@app.command("demo")
def demo_command(settings: Settings) -> int:
    from jobrelay.exports.demo import demo_main

    return demo_main(settings)
