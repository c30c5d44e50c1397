"""CLI for setting a deployment up: ``db upgrade``, ``broker declare`` and ``seed``.

Its Typer apps are mounted on the ``jobrelay`` command by ``cli.main``.
No ``from __future__ import annotations`` here: typer reads these annotations at run time.
"""

from typing import Annotated, Any, Optional

import typer

from jobrelay.cli.common import app_command, run, with_settings
from jobrelay.cli.database import db_app
from jobrelay.settings import Settings

app = typer.Typer()  # top-level commands, mounted by cli.main
broker_app = typer.Typer(help="Broker topology.", no_args_is_help=True)


@db_app.command("upgrade")
@with_settings
def db_upgrade_cmd(settings: Settings) -> None:
    """Create or migrate the schema (idempotent)."""
    from jobrelay.processes.entry_points import upgrade_database

    revision = run(upgrade_database(settings))
    typer.echo(f"database schema at revision {revision}")


@broker_app.command("declare")
@with_settings
def broker_declare_cmd(settings: Settings) -> None:
    """Declare exchanges and queues (idempotent)."""
    from jobrelay.processes.entry_points import declare_broker

    typer.echo(run(declare_broker(settings)))


@app.command("seed")
@with_settings
def seed_cmd(
    settings: Settings,
    rows_per_month: Annotated[
        Optional[int],  # noqa: UP045 (typer needs it)
        typer.Option(
            min=0,
            max=1_000_000,
            help="Rows per account and month [default: what the ledgers hold, else 300].",
            show_default=False,
        ),
    ] = None,
    replace: Annotated[
        bool, typer.Option("--replace", help="Replace ledgers that hold another size.")
    ] = False,
    account: Annotated[
        Optional[str],  # noqa: UP045 (typer needs it)
        typer.Option(help="With --period and --rows: fill only this account-month."),
    ] = None,
    period: Annotated[
        Optional[str],  # noqa: UP045 (typer needs it)
        typer.Option(help="YYYY-MM, with --account and --rows."),
    ] = None,
    rows: Annotated[
        Optional[int],  # noqa: UP045 (typer needs it)
        typer.Option(min=1, max=20_000_000, help="Generated rows for that account-month."),
    ] = None,
) -> None:
    """Fill the app's sample data.

    For the export app: ledger_entries for acme, globex and initech, 2019-2021, kept when
    already there unless --replace; or, with --account/--period/--rows, one account-month of
    N generated rows.
    """
    from jobrelay.database_files import require_database

    require_database(settings.database_url)
    options: dict[str, Any] = {"rows_per_month": rows_per_month, "replace": replace}
    if (account, period, rows) != (None, None, None):
        options.update(account=account, period=period, rows=rows)  # only the app's with them
    code = app_command(settings, "seed")(settings, **options)
    if code:
        raise typer.Exit(code)
