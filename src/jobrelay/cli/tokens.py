"""CLI for API tokens: ``jobrelay token create | list | revoke``.

A token's secret is printed once, by ``create``, and only its hash is stored; ``list`` shows
everything else (id, account, label, role, created, last used, expires, state) and never the
secret; ``revoke ID`` ends a token. An API process remembers a valid token for up to 5 s
(``storage/tokens.py``), so a revoked token is refused everywhere within 5 s, and at once by
the processes that had not seen it lately; an expired one is refused from its expiry on.

``token_app`` is ``jobrelay token``, mounted by ``cli.main``.
No ``from __future__ import annotations`` here: typer reads these annotations at run time.
"""

import json
import re
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Annotated, Optional

import typer

from jobrelay.cli.common import fail, run, with_settings
from jobrelay.cli.retention import parse_days
from jobrelay.settings import Settings

if TYPE_CHECKING:  # imported where they run, so `jobrelay --help` stays light
    from jobrelay.storage.records import TokenInfo

token_app = typer.Typer(help="API tokens.", no_args_is_help=True)


@token_app.command("create")
@with_settings
def token_create_cmd(
    settings: Settings,
    account: Annotated[Optional[str], typer.Option(help="Account the token acts for.")] = None,  # noqa: UP045
    admin: Annotated[bool, typer.Option(help="Operator token for every account.")] = False,
    label: Annotated[Optional[str], typer.Option(help="A note on who holds it.")] = None,  # noqa: UP045
    expires_in: Annotated[
        Optional[str],  # noqa: UP045
        typer.Option(help="Refuse it after this long: 30d, 12h, 15m, 90s [default: never]."),
    ] = None,
) -> None:
    """Create an API token; the token alone is printed on the last line."""
    from jobrelay.api.schemas import ACCOUNT_PATTERN
    from jobrelay.processes.entry_points import create_token

    if account is None and not admin:
        raise fail("give --account ACCOUNT (or --admin)", 2)
    if account is not None and not re.fullmatch(ACCOUNT_PATTERN, account):
        raise fail(f"--account {account!r} is not a valid account id ({ACCOUNT_PATTERN})", 2)
    lifetime = None
    if expires_in is not None:
        try:
            lifetime = timedelta(days=parse_days(expires_in, "--expires-in"))
        except ValueError as exc:
            raise fail(str(exc), 2) from None
    token = run(create_token(settings, account, admin, label, lifetime))
    until = f", expires in {expires_in}" if expires_in else ""
    typer.echo(
        f"created {'admin' if admin else 'account'} token for {account or 'all accounts'}{until}",
        err=True,
    )
    typer.echo(token)


async def _list(settings: Settings) -> "tuple[list[TokenInfo], datetime]":
    from jobrelay.runtime.wiring import open_runtime

    async with open_runtime(settings, connect_transport=False) as rt:
        return await rt.store.list_tokens(), await rt.store.db_now()


def _when(value: datetime | None) -> str:
    return value.strftime("%Y-%m-%d %H:%M:%SZ") if value else "-"


def _as_json(info: "TokenInfo", now: datetime) -> dict[str, object]:
    return {
        "id": info.id,
        "account": info.account_id,
        "label": info.label,
        "role": "admin" if info.is_admin else "account",
        "created": info.created_at.isoformat(),
        "lastUsed": info.last_used_at.isoformat() if info.last_used_at else None,
        "expires": info.expires_at.isoformat() if info.expires_at else None,
        "revoked": info.revoked_at.isoformat() if info.revoked_at else None,
        "state": info.state(now),
    }


@token_app.command("list")
@with_settings
def token_list_cmd(
    settings: Settings,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON array.")] = False,
) -> None:
    """Every token without its secret: id, account, label, role, created, last used, expires."""
    tokens, now = run(_list(settings))
    if as_json:
        typer.echo(json.dumps([_as_json(t, now) for t in tokens], indent=2))
        return
    header = ("id", "account", "label", "role", "created", "last used", "expires", "state")
    rows = [header] + [
        (
            str(t.id),
            t.account_id or "*",
            t.label or "-",
            "admin" if t.is_admin else "account",
            _when(t.created_at),
            _when(t.last_used_at),
            _when(t.expires_at),
            t.state(now),
        )
        for t in tokens
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    for row in rows:
        typer.echo("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())


async def _revoke(settings: Settings, token_id: int) -> "TokenInfo | None":
    from jobrelay.runtime.wiring import open_runtime

    async with open_runtime(settings, connect_transport=False) as rt:
        return await rt.store.revoke_token(token_id)


@token_app.command("revoke")
@with_settings
def token_revoke_cmd(
    settings: Settings,
    token_id: Annotated[str, typer.Argument(metavar="ID", help="The id from `token list`.")],
) -> None:
    """Revoke a token: every API process refuses it (401) within 5 s."""
    if not token_id.isdigit():
        raise fail(f"token id {token_id!r}: expected the number shown by `jobrelay token list`", 2)
    info = run(_revoke(settings, int(token_id)))
    if info is None:
        raise fail(f"no token {token_id} (see `jobrelay token list`)", 2)
    typer.echo(
        f"revoked token {info.id} ({info.label or info.account_id or 'admin'}) at "
        f"{_when(info.revoked_at)}; API processes refuse it within 5 s"
    )
