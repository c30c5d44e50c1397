"""CLI: ``job resend ID --reason …``, the operator's way out for a job stuck in ``queued``.

A job stays ``queued`` when its message never reaches a worker: the broker dead-lettered or
lost it, and the reconciler's next re-send is still backed off (or no relay runs one). This
writes a new work message to the outbox and a ``resent`` event with ``--actor`` and
``--reason``, in one transaction; the relay sends it. A surplus copy is harmless: the job's
state decides, so a duplicate is acked unworked. Any job not ``queued`` is refused with one
line and exit 2, changing nothing (replay is for quarantined jobs).

Registered on ``job`` (``cli.inspection.job_app``) by importing this module (``cli.main`` does). No
``from __future__ import annotations`` here: typer reads these annotations at run time.
"""

from typing import TYPE_CHECKING, Annotated, Optional

import typer

from jobrelay.cli.common import fail, known_job_id, run, with_settings
from jobrelay.cli.inspection import job_app
from jobrelay.settings import Settings

if TYPE_CHECKING:  # imported where they run, so `jobrelay --help` stays light
    from jobrelay.storage.admin import ActionOutcome


async def _resend(settings: Settings, job_id: str, actor: str, reason: str) -> "ActionOutcome":
    from jobrelay.library.operator import Operator
    from jobrelay.runtime.wiring import open_runtime

    async with open_runtime(settings, connect_transport=False) as rt:
        return await Operator(rt).resend(job_id, actor=actor, reason=reason)


@job_app.command("resend")
@with_settings
def job_resend_cmd(
    settings: Settings,
    job_id: Annotated[str, typer.Argument()],
    reason: Annotated[str, typer.Option(help="Why; kept in the timeline (required).")],
    actor: Annotated[
        Optional[str],  # noqa: UP045 (typer needs it)
        typer.Option(help="Who is acting, for the timeline. Default: cli:<user>@<host>."),
    ] = None,
) -> None:
    """Send a stuck queued job's work message again (its message was lost)."""
    from jobrelay.library.operator import cli_actor, refusal

    if not reason.strip():
        raise fail("--reason must not be empty", 2)
    job_id = known_job_id(job_id)
    outcome = run(_resend(settings, job_id, actor or cli_actor(), reason.strip()))
    if not outcome.done:
        raise fail(refusal("resend", outcome), 2)
    typer.echo(f"resent {job_id}: a new work message is in the outbox for the relay to send")
