"""``jobrelay db grant ROLE``: the grants a least-privileged runtime role needs;
``jobrelay db rotate-id-secret``: a new secret for job ids, the old one kept for a while.

``db_app`` is ``jobrelay db``, mounted by ``cli.main`` (``db upgrade`` joins it from
provision). Run grant as the schema's owner, after ``jobrelay db upgrade``; then run the api,
relays and workers as ``ROLE``. See docs/security.md.

No ``from __future__ import annotations`` here: typer reads these annotations at run time.
"""

import re
from typing import Annotated

import typer

from jobrelay.cli.common import fail, run, with_settings
from jobrelay.settings import Settings

db_app = typer.Typer(help="Database schema.", no_args_is_help=True)

# A plain PostgreSQL identifier (what CREATE ROLE takes unquoted), or a quoted one's text.
_ROLE = re.compile(r"^[A-Za-z_][A-Za-z0-9_$-]{0,62}$")


@db_app.command("grant")
@with_settings
def db_grant_cmd(
    settings: Settings,
    role: Annotated[str, typer.Argument(help="An existing PostgreSQL role (NOSUPERUSER).")],
) -> None:
    """Grant ROLE what the api, relay and worker need: DML on jobrelay's and the app's tables.

    Run as the owner after `jobrelay db upgrade`; ROLE then owns nothing and may not change
    the schema."""
    from jobrelay.processes.entry_points import grant_role

    if not _ROLE.match(role):
        raise fail(f"ROLE: not a role name: {role!r}", 2)
    granted = run(grant_role(settings, role))
    typer.echo(
        f"granted SELECT, INSERT, UPDATE, DELETE on {len(granted.tables)} table(s), "
        f"USAGE, SELECT on {len(granted.sequences)} sequence(s), SELECT on alembic_version "
        f"and USAGE on schema {granted.schema} to {granted.role}"
    )
    typer.echo("tables: " + ", ".join(granted.tables))
    if granted.superuser:
        typer.echo(
            f"note: {granted.role} is a superuser, so these grants restrict nothing; "
            "use a role created with NOSUPERUSER (docs/security.md)"
        )


@db_app.command("rotate-id-secret")
@with_settings
def db_rotate_id_secret_cmd(
    settings: Settings,
    keep_previous: Annotated[
        int,
        typer.Option(
            min=0,
            max=24 * 366,
            help="Hours the old secret still finds the jobs it keyed (a retried request).",
        ),
    ] = 168,
) -> None:
    """Make a new secret for job ids; the old one still counts for --keep-previous hours.

    Running processes use the new one within a minute. A request retried after the window,
    or a second rotation inside it, no longer finds a job accepted under the old secret."""
    from datetime import timedelta

    from jobrelay.library.operator import cli_actor
    from jobrelay.runtime.wiring import open_runtime, utc_now

    if settings.id_secret is not None:
        raise fail(
            "JOBRELAY_ID_SECRET is set, so the stored secret is not in use: rotate by "
            "setting a new value there (the same in every process)",
            2,
        )

    async def rotate() -> str:
        async with open_runtime(settings, connect_transport=False) as rt:
            done = await rt.store.installation.rotate(
                utc_now(), timedelta(hours=keep_previous), cli_actor()
            )
        return done.previous_until.isoformat(timespec="seconds")

    until = run(rotate())
    typer.echo(
        f"id secret rotated: jobs accepted under the previous one are found until {until}; "
        "running processes take the new one within a minute"
    )
