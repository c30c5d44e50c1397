"""CLI for work queues: ``queues list``, ``queues pause|resume``.

Its Typer app is mounted on the ``jobrelay`` command by ``cli.main``. Pause
and resume write the durable flag the workers poll (``storage.queue_pauses``), audited with
``--actor`` (by default ``cli:<user>@<host>``) and a required ``--reason``, like
``schedules pause``. Workers stop consuming a paused queue within
``JOBRELAY_QUEUE_PAUSE_POLL_SECONDS``; its messages wait in the broker.

No ``from __future__ import annotations`` here: typer reads these annotations at run time.
"""

import json
from typing import TYPE_CHECKING, Annotated, Optional

import typer

from jobrelay.cli.common import fail, run, with_settings
from jobrelay.settings import Settings

app = typer.Typer()  # mounted by cli.main

if TYPE_CHECKING:
    from jobrelay.api.queues import QueuesOut

queues_app = typer.Typer(help="Work queues: depth, pause and resume.", no_args_is_help=True)
app.add_typer(queues_app, name="queues")

Actor = Annotated[
    Optional[str],  # noqa: UP045 (typer needs it)
    typer.Option(help="Who is acting, for the audit. Default: cli:<user>@<host>."),
]
Reason = Annotated[str, typer.Option(help="Why; kept in the queue's audit (required).")]


async def _rows(settings: Settings) -> "QueuesOut":
    from jobrelay.api.queues import queue_rows  # FastAPI only for the command that needs it
    from jobrelay.runtime.wiring import open_runtime

    async with open_runtime(settings) as rt:
        return await queue_rows(rt)


def _count(value: int | None) -> str:
    return "?" if value is None else str(value)


@queues_app.command("list")
@with_settings
def queues_list_cmd(
    settings: Settings,
    as_json: Annotated[bool, typer.Option("--json", help="The queues as JSON.")] = False,
) -> None:
    """Every work queue: ready, consumers, in flight ("?": the broker cannot say), paused."""
    out = run(_rows(settings))
    if as_json:
        typer.echo(json.dumps(out.model_dump(mode="json", by_alias=True), indent=2))
        return
    typer.echo(f"{'QUEUE':<16} {'READY':>7} {'CONSUMERS':>9} {'IN FLIGHT':>9}  PAUSED")
    for q in out.queues:
        note = f"paused by {q.paused_by} ({q.paused_reason})" if q.paused else "no"
        typer.echo(
            f"{q.queue:<16} {_count(q.ready):>7} {_count(q.consumers):>9} "
            f"{_count(q.in_flight):>9}  {note}"
        )
    if out.queues_error:
        typer.echo(f"counts unknown: {out.queues_error}")


async def _set(settings: Settings, queue: str, paused: bool, actor: str, reason: str) -> bool:
    from jobrelay.library.operator import UnknownQueue, set_queue_paused
    from jobrelay.runtime.wiring import open_runtime

    async with open_runtime(settings, connect_transport=False) as rt:
        try:
            return await set_queue_paused(
                rt, queue, paused, actor=actor, reason=reason, queues=rt.topology.queues
            )
        except UnknownQueue as exc:
            raise fail(str(exc), 2) from None


def _set_paused(
    settings: Settings, queue: str, paused: bool, reason: str, actor: str | None
) -> None:
    from jobrelay.library.operator import cli_actor

    if not reason.strip():
        raise fail("--reason must not be empty", 2)
    if not run(_set(settings, queue, paused, actor or cli_actor(), reason.strip())):
        raise fail(f"queue {queue} is already {'paused' if paused else 'running'}")
    if paused:
        typer.echo(f"paused {queue}: workers stop taking its deliveries; they wait in the broker")
    else:
        typer.echo(f"resumed {queue}: workers consume it again")


@queues_app.command("pause")
@with_settings
def queues_pause_cmd(
    settings: Settings, queue: Annotated[str, typer.Argument()], reason: Reason, actor: Actor = None
) -> None:
    """Stop workers consuming a queue; work in flight finishes, the rest waits."""
    _set_paused(settings, queue, True, reason, actor)


@queues_app.command("resume")
@with_settings
def queues_resume_cmd(
    settings: Settings, queue: Annotated[str, typer.Argument()], reason: Reason, actor: Actor = None
) -> None:
    """Let workers consume a paused queue again."""
    _set_paused(settings, queue, False, reason, actor)
