"""CLI for retention: ``jobrelay prune [--dry-run] [--older-than 30d]``, and the one line the
job commands print for a job that retention deleted.

Its Typer app is mounted on the ``jobrelay`` command by ``cli.main``. The
prune is the one the reconciler leader runs (``maintenance/prune.py``), repeated until nothing
older is left; ``--dry-run`` counts the same rows and changes nothing. A bad
``--older-than`` is one line on stderr and exit code 2, before the database is opened.

No ``from __future__ import annotations`` here: typer reads these annotations at run time.
"""

import json
import re
from typing import TYPE_CHECKING, Annotated, Optional

import typer

from jobrelay.cli.common import fail, run, with_settings
from jobrelay.settings import Settings

if TYPE_CHECKING:  # imported where they run, so `jobrelay --help` stays light
    from jobrelay.storage.retention import PruneCounts

app = typer.Typer()  # top-level commands, mounted by cli.main

_DURATION = re.compile(r"(\d+(?:\.\d+)?)([dhms])")
_SECONDS = {"d": 86_400, "h": 3_600, "m": 60, "s": 1}
# Exit code of a job command for a job that retention deleted (a missing one is 1).
PRUNED_EXIT = 2


def parse_days(text: str, option: str = "--older-than") -> float:
    """``30d``, ``12h``, ``15m``, ``90s`` (a number and one unit) -> days; ValueError else."""
    match = _DURATION.fullmatch(text.strip())
    if match is None:
        raise ValueError(f"{option} {text!r}: expected a number and d, h, m or s, e.g. 30d")
    days = float(match[1]) * _SECONDS[match[2]] / 86_400
    if days <= 0:
        raise ValueError(f"{option} {text!r}: must be more than nothing")
    return days


async def _prune(settings: Settings, days: float, dry_run: bool) -> "PruneCounts":
    from jobrelay.maintenance.prune import Pruner
    from jobrelay.runtime.wiring import open_runtime

    async with open_runtime(settings, connect_transport=False) as rt:
        pruner = Pruner(rt)
        total = await pruner.run_once(days=days, dry_run=dry_run)
        while total.capped and not dry_run:  # each call is bounded; on demand, drain it all
            more = await pruner.run_once(days=days)
            for table, n in more.tables().items():
                setattr(total, table, getattr(total, table) + n)
            total.results_failed += more.results_failed
            total.capped = more.capped
        return total


@app.command("prune")
@with_settings
def prune_cmd(
    settings: Settings,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Count, delete nothing.")] = False,
    older_than: Annotated[
        Optional[str],  # noqa: UP045 (typer needs it)
        typer.Option(help="Age such as 30d, 12h, 15m, 90s. Default: JOBRELAY_RETENTION_DAYS."),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="The counts as JSON.")] = False,
) -> None:
    """Delete what is older than the retention, and print the counts.

    Finished jobs (with their events, outbox rows and results), published outbox rows and
    dead-lettered local-queue rows.
    """
    from jobrelay.observe import logs

    try:
        days = settings.retention_days if older_than is None else parse_days(older_than)
    except ValueError as exc:
        raise fail(str(exc), 2) from None
    logs.configure("prune", "ERROR")  # the counts are printed below, not logged twice
    counts = run(_prune(settings, days, dry_run))
    if as_json:
        doc = {"dryRun": dry_run, "olderThanDays": days, **counts.tables()}
        typer.echo(json.dumps({**doc, "resultsFailed": counts.results_failed}, indent=2))
        return
    label = "would delete (dry run, nothing changed)" if dry_run else "deleted"
    kept = " (result objects kept: JOBRELAY_RETENTION_KEEP_RESULTS)"
    age = f"{days:g} day(s)" if older_than is None else older_than.strip()
    typer.echo(
        f"prune, older than {age}: {label}" + (kept if settings.retention_keep_results else "")
    )
    for table, n in counts.tables().items():
        typer.echo(f"{table:<16} {n}")
    if counts.results_failed:
        typer.echo(
            f"{counts.results_failed} result object(s) could not be deleted; their jobs are "
            "kept for the next prune",
            err=True,
        )
        raise typer.Exit(1)


async def _pruned_line(settings: Settings, job_id: str) -> str | None:
    from jobrelay.runtime.wiring import open_runtime
    from jobrelay.storage.retention import Retention

    async with open_runtime(settings, connect_transport=False) as rt:
        stone = await Retention(rt.store, rt.results).pruned(job_id)
    if stone is None:
        return None
    return (
        f"job {job_id} finished and was deleted by retention at "
        f"{stone.pruned_at:%Y-%m-%d %H:%M:%S} UTC"
    )


def fail_missing(settings: Settings, job_id: str, message: str) -> typer.Exit:
    """The failure for a job command that found no job: exit 2 with one line if retention
    deleted it, else ``message`` and exit 1 as before."""
    line = run(_pruned_line(settings, job_id))
    if line is not None:
        return fail(line, PRUNED_EXIT)
    return fail(message)
