"""Where an SQLite database lives, and the rule that a mistyped path leaves no file behind.

SQLite creates a database file the moment anything connects to a path that does not exist,
so a typo in ``JOBRELAY_DATABASE_URL`` would otherwise leave an empty database (and, before
this rule, its directories) wherever it pointed, and the command would then complain about
a schema that is "at nothing". The rule:

- every command except ``db upgrade`` (and ``up``/``demo``, which run it) needs the file to
  exist already, and says so in one line before anything connects (``require_database``);
- ``db upgrade`` creates the file in a directory that exists, never the directory itself,
  except the embedded default's own ``./var``; and when the upgrade fails, it removes what
  it created (``new_database``), so a bad URL leaves nothing behind either.
- what it creates is its owner's only: the file ``0600`` (created empty, before SQLite opens
  it, which then gives its ``-wal`` and ``-journal`` the same mode) and ``./var`` ``0700``.

PostgreSQL URLs and in-memory SQLite pass through untouched.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from sqlalchemy.exc import ArgumentError

from jobrelay.errors import ConfigError
from jobrelay.results.files import DIR_MODE, FILE_MODE
from jobrelay.settings import Settings
from jobrelay.storage.engine import no_database, sqlalchemy_url

VARIABLE = "JOBRELAY_DATABASE_URL"
DEFAULT_URL: str = Settings.model_fields["database_url"].default
# What SQLite writes next to a database in WAL mode.
_COMPANIONS = ("-wal", "-shm", "-journal")


def sqlite_path(database_url: str) -> Path | None:
    """The file an SQLite URL names, or None (PostgreSQL, in-memory, a ``file:`` URI)."""
    try:
        url = sqlalchemy_url(database_url)
    except (ArgumentError, ValueError):
        return None  # not ours to judge here: the engine names the bad URL
    if url.get_backend_name() != "sqlite" or url.query.get("uri"):
        return None
    if url.database in (None, "", ":memory:"):
        return None
    return Path(url.database).expanduser()


def require_database(database_url: str) -> None:
    """Refuse, before anything connects, to work on an SQLite file that does not exist."""
    path = sqlite_path(database_url)
    if path is not None and not path.is_file():
        raise no_database(path, " (not a file)" if path.exists() else "")


@contextlib.contextmanager
def new_database(database_url: str) -> Iterator[None]:
    """Around ``db upgrade``: allow creating the file (in an existing directory), and remove
    what was created if the body fails."""
    path = sqlite_path(database_url)
    if path is not None and path.exists() and not path.is_file():
        # Refused before connecting: aiosqlite, failing to open it, leaves a thread behind
        # that prints a traceback at exit.
        raise ConfigError(VARIABLE, f"{path} is not a database file (a directory?): fix the path")
    if path is None or path.exists():
        yield
        return
    created_dir = None
    if not path.parent.is_dir():
        if database_url != DEFAULT_URL or path.parent.exists():
            raise ConfigError(
                VARIABLE,
                f"directory {path.parent} does not exist: `jobrelay db upgrade` creates the "
                "database file, not its directory; create it, or fix the path",
            )
        path.parent.mkdir(mode=DIR_MODE, parents=True)
        created_dir = path.parent
    try:
        # SQLite takes an empty file as an empty database, and would create one 0644.
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE))
        yield
    except BaseException:
        for leftover in (path, *(Path(f"{path}{suffix}") for suffix in _COMPANIONS)):
            leftover.unlink(missing_ok=True)
        if created_dir is not None:
            with contextlib.suppress(OSError):  # not empty: someone else put files there
                created_dir.rmdir()
        raise
