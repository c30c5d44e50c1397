"""CLI for periodic jobs: ``schedules list``, ``schedules show``, ``schedules pause|resume``.

Its Typer app is mounted on the ``jobrelay`` command by ``cli.main``. Pause and
resume are audited on the schedule's timeline with ``--actor`` (by default
``cli:<user>@<host>``) and a required ``--reason``, like ``job cancel``. The commands read and
write the database only; the schedulers (every relay, ``up``) act on what they find there.

No ``from __future__ import annotations`` here: typer reads these annotations at run time.
"""

import json
from typing import TYPE_CHECKING, Annotated, Any, Optional

import typer

from jobrelay.cli.common import fail, run, with_settings
from jobrelay.settings import Settings

if TYPE_CHECKING:  # imported where they run, so `jobrelay --help` stays light
    from jobrelay.admin.schedules import ScheduleRow
    from jobrelay.storage.schedules import PauseOutcome

app = typer.Typer()  # mounted by cli.main

schedules_app = typer.Typer(help="Periodic jobs.", no_args_is_help=True)
app.add_typer(schedules_app, name="schedules")

Actor = Annotated[
    Optional[str],  # noqa: UP045 (typer needs it)
    typer.Option(help="Who is acting, for the timeline. Default: cli:<user>@<host>."),
]
Reason = Annotated[str, typer.Option(help="Why; kept in the schedule's timeline (required).")]


async def _rows(settings: Settings) -> "list[ScheduleRow]":
    from jobrelay.admin.schedules import ScheduleOperator
    from jobrelay.runtime.wiring import open_runtime

    async with open_runtime(settings, connect_transport=False) as rt:
        return await ScheduleOperator(rt).rows()


def _short(iso: str | None) -> str:
    return iso.replace("+00:00", "Z") if iso else "-"


@schedules_app.command("list")
@with_settings
def schedules_list_cmd(
    settings: Settings,
    as_json: Annotated[bool, typer.Option("--json", help="The schedules as JSON.")] = False,
) -> None:
    """Every schedule the schedulers run: cron, next tick, last tick, its job and state."""
    rows = [row.as_dict() for row in run(_rows(settings))]
    if as_json:
        typer.echo(json.dumps({"schedules": rows}, indent=2))
        return
    if not rows:
        typer.echo("no schedules yet (a schedule appears once a relay or `up` has run it)")
        return
    typer.echo(
        f"{'NAME':<24} {'CRON':<16} {'TZ':<14} {'NEXT TICK':<21} {'LAST TICK':<21} "
        f"{'LAST JOB':<36} {'STATE':<11} NOTE"
    )
    for r in rows:
        typer.echo(
            f"{r['name']:<24} {r['cron']:<16} {r['timezone']:<14} "
            f"{_short(r['nextTick']) if not r['paused'] else 'paused':<21} "
            f"{_short(r['lastTick']):<21} {r['lastJobId'] or '-':<36} "
            f"{_state(r):<11} {_note(r)}"
        )


def _state(r: dict[str, Any]) -> str:
    if r["lastJobId"] is None:
        return "-"
    return str(r["lastJobState"] or "pruned")


def _note(r: dict[str, Any]) -> str:
    notes = []
    if r["paused"]:
        skipped = (r["skippedWhilePaused"] or {}).get("count", 0)
        notes.append(
            f"paused by {r['pausedBy']} since {_short(r['pausedAt'])} ({r['pausedReason']}); "
            f"{skipped} tick(s) skipped so far"
        )
    last = r["lastSkipped"]
    if last:
        notes.append(
            f"last skip: {last['count']} tick(s) {_short(last['first'])}..{_short(last['last'])} "
            f"({last['reason']})"
        )
    if not r["definedByApp"]:
        notes.append("not defined by this app")
    return "; ".join(notes)


async def _show(settings: Settings, name: str) -> "tuple[ScheduleRow | None, list[dict[str, Any]]]":
    from jobrelay.admin.schedules import ScheduleOperator
    from jobrelay.runtime.wiring import open_runtime

    async with open_runtime(settings, connect_transport=False) as rt:
        operator = ScheduleOperator(rt)
        found = [row for row in await operator.rows() if row.view.name == name]
        if not found:
            return None, []
        return found[0], await operator.events(name)


@schedules_app.command("show")
@with_settings
def schedules_show_cmd(
    settings: Settings,
    name: Annotated[str, typer.Argument()],
    as_json: Annotated[bool, typer.Option("--json", help="The schedule as JSON.")] = False,
) -> None:
    """One schedule and its timeline (ticks skipped, paused, resumed), newest first."""
    row, events = run(_show(settings, name))
    if row is None:
        raise fail(f"no schedule {name!r} (a schedule appears once a relay or `up` has run it)")
    out = row.as_dict()
    timeline = [{**e, "at": e["at"].isoformat()} for e in events]
    if as_json:
        typer.echo(json.dumps({**out, "events": timeline}, indent=2))
        return
    for key, value in out.items():
        typer.echo(f"{key:<19} {json.dumps(value) if isinstance(value, dict) else value}")
    typer.echo("timeline (newest first):")
    for e in timeline:
        typer.echo(f"  {_short(e['at'])}  {e['kind']:<14} {json.dumps(e['detail'])}")


async def _pause(
    settings: Settings, name: str, paused: bool, actor: str, reason: str
) -> "PauseOutcome":
    from jobrelay.admin.schedules import ScheduleOperator
    from jobrelay.runtime.wiring import open_runtime

    async with open_runtime(settings, connect_transport=False) as rt:
        return await ScheduleOperator(rt).set_paused(name, paused, actor=actor, reason=reason)


def _set_paused(
    settings: Settings, name: str, paused: bool, reason: str, actor: str | None
) -> None:
    from jobrelay.admin.schedules import pause_refusal
    from jobrelay.library.operator import cli_actor

    if not reason.strip():
        raise fail("--reason must not be empty", 2)
    outcome = run(_pause(settings, name, paused, actor or cli_actor(), reason.strip()))
    if not outcome.done:
        raise fail(pause_refusal(name, outcome, paused))
    if paused:
        typer.echo(f"paused {name}: its ticks are skipped (and counted) until it is resumed")
        return
    skipped = outcome.skipped
    what = (
        f"{skipped.count} tick(s) skipped while paused ({_short(skipped.first.isoformat())}.."
        f"{_short(skipped.last.isoformat())})"
        if skipped
        else "no tick came due while paused"
    )
    typer.echo(f"resumed {name}: {what}; the next tick is enqueued as usual")


@schedules_app.command("pause")
@with_settings
def schedules_pause_cmd(
    settings: Settings, name: Annotated[str, typer.Argument()], reason: Reason, actor: Actor = None
) -> None:
    """Stop enqueueing a schedule's ticks; the skipped ticks are recorded."""
    _set_paused(settings, name, True, reason, actor)


@schedules_app.command("resume")
@with_settings
def schedules_resume_cmd(
    settings: Settings, name: Annotated[str, typer.Argument()], reason: Reason, actor: Actor = None
) -> None:
    """Enqueue a paused schedule's ticks again, from the next one (no catch-up of the pause)."""
    _set_paused(settings, name, False, reason, actor)
