"""What jobrelay creates on disk is its owner's only, whatever the umask (issue 25, item 8).

An SQLite database and an export both hold an account's ledger: on a shared host the
process's umask (commonly 022) would make them world-readable.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from jobrelay.processes.entry_points import upgrade_database
from jobrelay.results.files import FileResults
from jobrelay.settings import Settings


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture
def open_umask() -> Iterator[None]:
    """The permissive umask most machines run with, so the test does not depend on ours."""
    previous = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(previous)


async def test_the_embedded_database_and_its_directory_are_owner_only(
    open_umask: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    settings = Settings()  # the embedded default: sqlite:///./var/jobrelay.db
    assert settings.database_url == "sqlite:///./var/jobrelay.db"

    await upgrade_database(settings)

    assert mode(tmp_path / "var") == 0o700
    made = [p for p in (tmp_path / "var").iterdir() if p.name.startswith("jobrelay.db")]
    assert tmp_path / "var" / "jobrelay.db" in made
    assert {p.name: mode(p) for p in made} == {p.name: 0o600 for p in made}


async def test_a_database_in_an_existing_directory_is_owner_only(
    open_umask: None, tmp_path: Path
) -> None:
    await upgrade_database(Settings(database_url=f"sqlite:///{tmp_path}/app.db"))

    assert mode(tmp_path / "app.db") == 0o600


async def test_result_files_and_the_directories_made_for_them_are_owner_only(
    open_umask: None, tmp_path: Path
) -> None:
    base = tmp_path / "srv"
    base.mkdir()
    base.chmod(0o755)
    results = FileResults(f"file://{base}/exports")

    async with results.writer("acme/2020/03.csv") as out:
        await out.write(b"entry_id\r\n")

    assert mode(base / "exports" / "acme" / "2020" / "03.csv") == 0o600
    for directory in ("exports", "exports/acme", "exports/acme/2020"):
        assert mode(base / directory) == 0o700, directory
    assert mode(base) == 0o755  # what existed already is left as it was
