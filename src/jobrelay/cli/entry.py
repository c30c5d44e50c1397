"""The process entry point (``jobrelay``, ``python -m jobrelay``): every error is one line.

typer, left to itself, draws a usage error as a framed box of several lines with a hint
under it. jobrelay's promise is one line on stderr, ``jobrelay: error: …``, for every
failure at start-up, so that scripts and people read the same thing; usage errors (an
unknown option, a port out of range, a missing argument) are no exception. ``--help`` and
the help shown for a bare group are left as they are.
"""

from __future__ import annotations

import sys

import typer

from jobrelay.cli.main import app


def main() -> None:
    try:
        code = app(standalone_mode=False)
    except typer.TyperException as exc:
        # `jobrelay db` alone: typer has printed the group's help already.
        if type(exc).__name__ != "NoArgsIsHelpError":
            typer.echo(f"jobrelay: error: {one_line(exc.format_message())}", err=True)
        sys.exit(exc.exit_code)
    except typer.Abort:
        sys.exit(1)
    except KeyboardInterrupt:  # pragma: no cover
        sys.exit(130)
    sys.exit(code if isinstance(code, int) else 0)


def one_line(message: str) -> str:
    return " ".join(message.split())
