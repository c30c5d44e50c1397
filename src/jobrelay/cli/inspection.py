"""``jobrelay job show`` and ``jobrelay jobs list``: reading jobs (the operator actions on
them, ``cli/operator.py``, join the same two groups)."""

from typing import Annotated, Optional

import typer

from jobrelay.cli.common import fail, known_job_id, run, with_settings
from jobrelay.settings import Settings

job_app = typer.Typer(help="One job.", no_args_is_help=True)
jobs_app = typer.Typer(help="Many jobs.", no_args_is_help=True)


@job_app.command("show")
@with_settings
def job_show_cmd(
    settings: Settings,
    job_id: Annotated[str, typer.Argument()],
    as_json: Annotated[bool, typer.Option("--json", help="The explanation as JSON.")] = False,
    traceback: Annotated[
        bool,
        typer.Option(
            "--traceback",
            help="Also print the traceback of the job's last failure (scrubbed, at most 8 KiB).",
        ),
    ] = False,
) -> None:
    """State, facts, attempts and timeline of one job, and where to look next."""
    from jobrelay.admin.explain import show_job
    from jobrelay.cli.retention import fail_missing

    job_id = known_job_id(job_id)
    if not run(show_job(settings, job_id, as_json=as_json, traceback=traceback)):
        raise fail_missing(settings, job_id, f"no job {job_id}")


@jobs_app.command("list")
@with_settings
def jobs_list_cmd(
    settings: Settings,
    state: Annotated[Optional[str], typer.Option(help="Only jobs in this state.")] = None,  # noqa: UP045
    limit: Annotated[int, typer.Option(min=1, max=10_000)] = 50,
    reason: Annotated[
        Optional[str],  # noqa: UP045
        typer.Option(help="Only jobs whose quarantine reason or last error contains this."),
    ] = None,
    job_type: Annotated[
        Optional[str],  # noqa: UP045
        typer.Option("--type", help="Only jobs of this type."),
    ] = None,
    queue: Annotated[Optional[str], typer.Option(help="Only jobs of this queue.")] = None,  # noqa: UP045
    account: Annotated[Optional[str], typer.Option(help="Only jobs of this account.")] = None,  # noqa: UP045
) -> None:
    """Recent jobs, newest first."""
    from jobrelay.admin.job_list import list_jobs
    from jobrelay.domain.queues import QUEUE_NAME
    from jobrelay.domain.states import JobState

    try:
        wanted = JobState(state) if state else None
    except ValueError:
        choices = ", ".join(s.value for s in JobState)
        raise fail(f"--state must be one of {choices}", 2) from None
    if queue is not None and not QUEUE_NAME.fullmatch(queue):
        raise fail(f"--queue: {queue!r} is no queue name (it matches {QUEUE_NAME.pattern})", 2)
    run(
        list_jobs(
            settings,
            wanted,
            limit,
            reason=reason,
            job_type=job_type,
            queue=queue,
            account=account,
        )
    )
