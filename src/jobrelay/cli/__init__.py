"""The ``jobrelay`` command: the typer app and its operator commands."""


def main() -> None:
    """The console script: imports the command tree only when it runs, so that importing
    ``jobrelay.cli`` (the app loader, the tests) costs nothing."""
    from jobrelay.cli.entry import main as entry

    entry()


__all__ = ["main"]
