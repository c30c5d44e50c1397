"""CLI for operators: ``job replay``, ``job cancel``, ``jobs replay``, ``reconcile`` and
``quarantine purge``.

Its Typer app is mounted on the ``jobrelay`` command by ``cli.main``. Each action
is audited in the job's timeline with ``--actor`` (by default ``cli:<user>@<host>``). The
commands read and write the database only; the relay publishes what they put in the outbox.

No ``from __future__ import annotations`` here: typer reads these annotations at run time.
"""

import json
from typing import TYPE_CHECKING, Annotated, Optional

import typer

from jobrelay.cli.common import fail, known_job_id, run, with_settings
from jobrelay.cli.inspection import job_app, jobs_app
from jobrelay.cli.retention import fail_missing
from jobrelay.settings import Settings

if TYPE_CHECKING:  # imported where they run, so `jobrelay --help` stays light
    from jobrelay.admin.quarantine_purge import PurgeReport
    from jobrelay.library.operator import BulkReplay
    from jobrelay.maintenance.findings import Report
    from jobrelay.storage.admin import ActionOutcome

app = typer.Typer()  # top-level commands, mounted by cli.main

Actor = Annotated[
    Optional[str],  # noqa: UP045 (typer needs it)
    typer.Option(help="Who is acting, for the timeline. Default: cli:<user>@<host>."),
]


async def _act(
    settings: Settings, action: str, job_id: str, actor: str, reason: str
) -> "ActionOutcome":
    from jobrelay.library.operator import Operator
    from jobrelay.runtime.wiring import open_runtime

    async with open_runtime(settings, connect_transport=False) as rt:
        operator = Operator(rt)
        if action == "replay":
            return await operator.replay(job_id, actor=actor, reason=reason)
        return await operator.cancel(job_id, actor=actor, reason=reason)


@job_app.command("replay")
@with_settings
def job_replay_cmd(
    settings: Settings,
    job_id: Annotated[str, typer.Argument()],
    reason: Annotated[
        str, typer.Option(help="Why; kept in the timeline.")
    ] = "replayed by an operator",
    actor: Actor = None,
) -> None:
    """Send a quarantined job back to queued, with a fresh attempt budget."""
    from jobrelay.library.operator import cli_actor, refusal

    job_id = known_job_id(job_id)
    outcome = run(_act(settings, "replay", job_id, actor or cli_actor(), reason))
    if outcome.state is None:
        raise fail_missing(settings, job_id, refusal("replay", outcome))
    if not outcome.done:
        raise fail(refusal("replay", outcome))
    typer.echo(
        f"replayed {job_id}: quarantined -> queued, {settings.max_attempts} more attempt(s); "
        "its message is in the outbox for the relay to send"
    )


@job_app.command("cancel")
@with_settings
def job_cancel_cmd(
    settings: Settings,
    job_id: Annotated[str, typer.Argument()],
    reason: Annotated[str, typer.Option(help="Why; kept in the timeline (required).")],
    actor: Actor = None,
) -> None:
    """Cancel a job that has not finished; a running one is stopped by its worker first."""
    from jobrelay.library.operator import cli_actor, refusal

    if not reason.strip():
        raise fail("--reason must not be empty", 2)
    job_id = known_job_id(job_id)
    outcome = run(_act(settings, "cancel", job_id, actor or cli_actor(), reason))
    if outcome.state is None:
        raise fail_missing(settings, job_id, refusal("cancel", outcome))
    if not outcome.done:
        raise fail(refusal("cancel", outcome))
    assert outcome.previous_state is not None
    if outcome.requested:
        typer.echo(
            f"cancel of running job {job_id} requested: its worker stops it and it ends cancelled"
        )
        return
    typer.echo(f"cancelled {job_id} (was {outcome.previous_state.value})")


async def _bulk(
    settings: Settings,
    actor: str,
    reason: str | None,
    job_type: str | None,
    dry_run: bool,
    limit: int,
) -> "BulkReplay":
    from jobrelay.library.operator import Operator
    from jobrelay.runtime.wiring import open_runtime

    async with open_runtime(settings, connect_transport=False) as rt:
        return await Operator(rt).bulk_replay(
            actor=actor, reason_filter=reason, job_type=job_type, dry_run=dry_run, limit=limit
        )


@jobs_app.command("replay")
@with_settings
def jobs_replay_cmd(
    settings: Settings,
    reason: Annotated[
        Optional[str],  # noqa: UP045
        typer.Option(help="Quarantined jobs whose reason contains this (any case)."),
    ] = None,
    job_type: Annotated[
        Optional[str],  # noqa: UP045
        typer.Option("--type", help="Quarantined jobs of this type."),
    ] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="List, change nothing.")] = False,
    limit: Annotated[int, typer.Option(min=1, max=100_000)] = 1000,
    actor: Actor = None,
) -> None:
    """Replay many quarantined jobs at once, selected by reason and/or type."""
    from jobrelay.library.operator import cli_actor, refusal

    if not reason and not job_type:
        raise fail(
            "give --reason and/or --type (replaying every quarantined job is not offered)", 2
        )
    result = run(_bulk(settings, actor or cli_actor(), reason, job_type, dry_run, limit))
    for job in result.matched:
        mark = (
            "would replay" if dry_run else ("replayed" if job.id in result.replayed else "skipped")
        )
        typer.echo(f"{mark}  {job.id}  {job.type}  {job.quarantine_reason or job.last_error or ''}")
    for outcome in result.skipped:
        typer.echo(f"skipped: {refusal('replay', outcome)}", err=True)
    if dry_run:
        typer.echo(f"{len(result.matched)} job(s) would be replayed (dry run, nothing changed)")
    else:
        typer.echo(f"{len(result.replayed)} of {len(result.matched)} job(s) replayed")


async def _reconcile(settings: Settings, dry_run: bool, scan: bool) -> "Report":
    from jobrelay.library.operator import cli_actor
    from jobrelay.maintenance.reconcile import Reconciler
    from jobrelay.runtime.wiring import open_runtime

    async with open_runtime(settings, connect_transport=False) as rt:
        return await Reconciler(rt, actor=f"reconcile:{cli_actor()}").run_once(
            dry_run=dry_run, scan_quarantine=scan
        )


@app.command("reconcile")
@with_settings
def reconcile_cmd(
    settings: Settings,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Find and report, repair nothing.")
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="The report as JSON.")] = False,
    scan_quarantine: Annotated[
        bool,
        typer.Option(help="Read the quarantine queue (returns each message to it at once)."),
    ] = True,
) -> None:
    """Find jobs stuck between hand-offs; repair expired leases, overdue retries, lost messages."""
    from jobrelay.observe import logs

    logs.configure("reconcile", "ERROR")  # the findings are printed below, not logged twice
    report = run(_reconcile(settings, dry_run, scan_quarantine))
    if as_json:
        typer.echo(json.dumps(report.as_dict(), indent=2))
        return
    counts = ", ".join(f"{n} {kind}" for kind, n in report.counts().items())
    scanned = (
        f"{report.quarantine_scanned} quarantine message(s) read"
        if report.quarantine_scanned is not None
        else "quarantine queue not read"
    )
    label = "reconcile (dry run)" if dry_run else "reconcile"
    typer.echo(f"{label}: {counts}; {report.repaired} repaired; {scanned}")
    for finding in report.findings:
        typer.echo(f"{finding.kind:<20} {finding.job_id or '-':<36}  {finding.detail}")


quarantine_app = typer.Typer(help="The quarantine queue.", no_args_is_help=True)
app.add_typer(quarantine_app, name="quarantine")


async def _purge(settings: Settings, limit: int, dry_run: bool) -> "PurgeReport":
    from jobrelay.admin.quarantine_purge import purge_quarantine
    from jobrelay.runtime.wiring import open_runtime

    async with open_runtime(settings, connect_transport=False) as rt:
        return await purge_quarantine(rt, limit=limit, dry_run=dry_run)


@quarantine_app.command("purge")
@with_settings
def quarantine_purge_cmd(
    settings: Settings,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="List what would be removed, remove nothing.")
    ] = False,
    limit: Annotated[
        int, typer.Option(min=1, max=100_000, help="Read at most this many messages.")
    ] = 10_000,
    as_json: Annotated[bool, typer.Option("--json", help="The report as JSON.")] = False,
) -> None:
    """Remove the stale copies of replayed, cancelled or pruned jobs from the quarantine queue.

    Copies of jobs still quarantined, and messages naming no known job, are kept."""
    report = run(_purge(settings, limit, dry_run))
    if as_json:
        typer.echo(json.dumps(report.as_dict(), indent=2))
        return
    verb = "would remove" if dry_run else "removed"
    for purged in report.removed:
        typer.echo(f"{verb}  {purged.job_id}  {purged.state:<12} {purged.reason or 'unknown'}")
    typer.echo(
        f"quarantine purge{' (dry run)' if dry_run else ''}: {report.scanned} message(s) read, "
        f"{len(report.removed)} {verb}, {report.kept_quarantined} kept (job quarantined), "
        f"{report.kept_unknown} kept (no known job)"
    )
