"""The ``jobrelay`` command: the typer app and its operator commands."""

from jobrelay.cli.entry import main

__all__ = ["main"]
