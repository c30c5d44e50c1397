"""CLI for limits per key: ``limits list``, ``limits set``, ``limits clear``.

Its Typer app is mounted on the ``jobrelay`` command by ``cli.main``. ``set`` overrides a
declared limit (the whole limit, or one ``--key``) at run time and ``clear`` removes the
override (``storage.limit_overrides``), audited with ``--actor`` (by default
``cli:<user>@<host>``) and a required ``--reason``, like ``queues pause``; the relay applies
the change from its next admission round, no deploy. Bad input is one line and exit 2, and
writes nothing.

No ``from __future__ import annotations`` here: typer reads these annotations at run time.
"""

import json
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Annotated, Optional

import typer

from jobrelay.cli.common import fail, run, with_settings
from jobrelay.settings import Settings

app = typer.Typer()  # mounted by cli.main

if TYPE_CHECKING:
    from jobrelay.api.limits import LimitOut, LimitsOut, LimitValue
    from jobrelay.storage.limit_overrides import LimitOverride

limits_app = typer.Typer(
    help="Limits per key: what they hold back; override one at run time.", no_args_is_help=True
)
app.add_typer(limits_app, name="limits")

Actor = Annotated[
    Optional[str],  # noqa: UP045 (typer needs it)
    typer.Option(help="Who is acting, for the audit. Default: cli:<user>@<host>."),
]
# Optional for typer, required here: a missing --reason is then one line, not a usage box.
Reason = Annotated[
    Optional[str],  # noqa: UP045 (typer needs it)
    typer.Option(help="Why; kept in the limit's audit (required)."),
]
Key = Annotated[
    Optional[str],  # noqa: UP045 (typer needs it)
    typer.Option(help="One key's limit; none: the whole limit (every key)."),
]
Name = Annotated[str, typer.Argument(help="The limit's name: its job type's, or its name=.")]


async def _rows(settings: Settings) -> "LimitsOut":
    from jobrelay.api.limits import limit_rows  # FastAPI only for the command that needs it
    from jobrelay.runtime.wiring import open_runtime

    async with open_runtime(settings, connect_transport=False) as rt:
        return await limit_rows(rt)


def _value(value: "LimitValue | None") -> str:
    if value is None:
        return "-"
    if value.max is not None:
        return str(value.max)
    if value.per_second is None:  # fair between keys, or a prioritized queue's order
        return "-"
    return f"{value.per_second:g}/s burst {value.burst or 0:g}"


def _shown(row: "LimitOut") -> str:
    """The value the relay applies, and where it comes from."""
    if row.override is None:
        return _value(row.declared)
    who = "override" if row.override.key == row.key else "override of the whole limit"
    declared = f"declared {_value(row.declared)}" if row.declared else "no job declares it yet"
    return f"{_value(row.current)} ({who}; {declared})"


def _age(since: datetime | None) -> str:
    if since is None:
        return "-"
    seconds = max(0, int((datetime.now(UTC) - since).total_seconds()))
    return f"{seconds} s" if seconds < 120 else f"{seconds // 60} min"


@limits_app.command("list")
@with_settings
def limits_list_cmd(
    settings: Settings,
    as_json: Annotated[bool, typer.Option("--json", help="The limits as JSON.")] = False,
) -> None:
    """Every limit an unfinished job is under: value, running, waiting for admission."""
    out = run(_rows(settings))
    if as_json:
        typer.echo(json.dumps(out.model_dump(mode="json", by_alias=True), indent=2))
        return
    if not out.limits:
        typer.echo("no unfinished job is under a limit, and no limit is overridden")
        return
    typer.echo(
        f"{'LIMIT':<24} {'KEY':<16} {'KIND':<11} {'RUNNING':>7} {'WAITING':>7} "
        f"{'OLDEST WAIT':>11}  VALUE"
    )
    for row in out.limits:
        typer.echo(
            f"{row.limit:<24} {row.key or '-':<16} {row.kind:<11} {row.running:>7} "
            f"{row.waiting:>7} {_age(row.waiting_since):>11}  {_shown(row)}"
        )


def _reason(reason: str | None) -> str:
    if reason is None or not reason.strip():
        raise fail("--reason is required (why; kept in the limit's audit)", 2)
    if "\x00" in reason:
        raise fail("--reason must not contain a NUL character", 2)
    return reason.strip()


def _target(name: str, key: str | None) -> str:
    from jobrelay.domain.limits import LimitError
    from jobrelay.storage.limit_overrides import target

    try:
        return target(name, key)
    except LimitError as exc:
        raise fail(str(exc), 2) from None


async def _set(
    settings: Settings,
    ident: str,
    max: int | None,
    per_second: float | None,
    burst: float | None,
    actor: str,
    reason: str,
) -> "LimitOverride":
    from jobrelay.runtime.wiring import open_runtime
    from jobrelay.storage.limit_overrides import set_override

    async with open_runtime(settings, connect_transport=False) as rt:
        return await set_override(
            rt.store,
            ident,
            max=max,
            per_second=per_second,
            burst=burst,
            actor=actor,
            reason=reason,
            now=rt.clock(),
        )


async def _clear(settings: Settings, ident: str, actor: str, reason: str) -> "LimitOverride | None":
    from jobrelay.runtime.wiring import open_runtime
    from jobrelay.storage.limit_overrides import clear_override

    async with open_runtime(settings, connect_transport=False) as rt:
        return await clear_override(rt.store, ident, actor=actor, reason=reason, now=rt.clock())


def _said(override: "LimitOverride") -> str:
    if override.max is not None and override.per_second is None:
        return f"concurrency {override.max}"
    burst = "one second's worth" if override.burst is None else f"{override.burst:g}"
    rate = f"rate {override.per_second:g}/s, burst {burst}"
    return rate if override.max is None else f"concurrency {override.max}, {rate}"


@limits_app.command("set")
@with_settings
def limits_set_cmd(
    settings: Settings,
    name: Name,
    key: Key = None,
    concurrency: Annotated[
        Optional[int],  # noqa: UP045 (typer needs it)
        typer.Option(help="At most this many jobs hold a slot at once."),
    ] = None,
    rate: Annotated[
        Optional[str],  # noqa: UP045 (typer needs it)
        typer.Option(help="At most this many admissions: N/second, N/minute or N/hour."),
    ] = None,
    burst: Annotated[
        Optional[int],  # noqa: UP045 (typer needs it)
        typer.Option(help="With --rate: the bucket's size (default: one second's worth)."),
    ] = None,
    reason: Reason = None,
    actor: Actor = None,
) -> None:
    """Override a limit (or one --key's) until cleared; the relay applies it at once."""
    from jobrelay.domain.limits import LimitError, parse_rate
    from jobrelay.library.operator import cli_actor

    why = _reason(reason)
    if (concurrency is None) == (rate is None):
        raise fail("give exactly one of --concurrency and --rate", 2)
    if concurrency is not None and not 1 <= concurrency <= 1_000_000:
        raise fail("--concurrency must be a whole number from 1 to 1000000", 2)
    if burst is not None and (rate is None or not 1 <= burst <= 1_000_000):
        raise fail("--burst goes with --rate, a whole number from 1 to 1000000", 2)
    per_second: float | None = None
    if rate is not None:
        try:
            count, period = parse_rate(rate)
            per_second = count / period
        except (LimitError, OverflowError) as exc:
            raise fail(f"--rate: {exc}", 2) from None
    ident = _target(name, key)
    fill = None if burst is None else float(burst)
    override = run(_set(settings, ident, concurrency, per_second, fill, actor or cli_actor(), why))
    typer.echo(f"limit {name}{f' key {key}' if key else ''}: {_said(override)} (overridden)")


@limits_app.command("clear")
@with_settings
def limits_clear_cmd(
    settings: Settings, name: Name, key: Key = None, reason: Reason = None, actor: Actor = None
) -> None:
    """Remove a limit's override: its declared value holds again."""
    from jobrelay.library.operator import cli_actor

    why = _reason(reason)
    ident = _target(name, key)
    removed = run(_clear(settings, ident, actor or cli_actor(), why))
    what = f"limit {name}{f' key {key}' if key else ''}"
    if removed is None:
        raise fail(f"{what} has no override to clear")
    typer.echo(f"{what}: override cleared; its declared value holds again")
