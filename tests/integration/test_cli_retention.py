"""``jobrelay prune`` and the job commands for a pruned job, in process (typer's runner) on
SQLite and PostgreSQL. The jobs are made 40 days old by the times they are written with,
since the CLI runs on the real clock (the database's on PostgreSQL)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
from typer.testing import CliRunner

from jobrelay.cli.main import app
from jobrelay.domain.states import JobState
from jobrelay.runtime.wiring import utc_now
from jobrelay.storage.engine import create_engine
from jobrelay.storage.store import Store

from .ops_fixtures import job_in_state

pytestmark = pytest.mark.timeout(90)


@pytest.fixture(autouse=True)
def restore_logging() -> Iterator[None]:
    """``jobrelay prune`` configures logging onto the runner's stderr, which closes after
    each invoke: give the next tests the root logger they had."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def env(database_url: str, tmp_path: Path) -> dict[str, str]:
    return {
        "JOBRELAY_DATABASE_URL": database_url,
        "JOBRELAY_RESULTS_URL": f"file://{tmp_path}/exports",
    }


def make_jobs(database_url: str) -> tuple[str, str]:
    """A cancelled job 40 days old and a queued one as old (never pruned)."""

    async def go() -> tuple[str, str]:
        engine = create_engine(database_url)
        try:
            store = Store(engine)
            then = utc_now() - timedelta(days=40)
            old = await job_in_state(store, JobState.CANCELLED, then, "2020-01")
            waiting = await job_in_state(store, JobState.QUEUED, then, "2020-02")
            return old, waiting
        finally:
            await engine.dispose()

    return asyncio.run(go())


def job_exists(database_url: str, job_id: str) -> bool:
    async def go() -> bool:
        engine = create_engine(database_url)
        try:
            return await Store(engine).get_job(job_id) is not None
        finally:
            await engine.dispose()

    return asyncio.run(go())


def cli(database_url: str, tmp_path: Path, *args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(app, list(args), env=env(database_url, tmp_path))
    return result.exit_code, result.stdout, result.stderr


@pytest.mark.parametrize("bogus", ["bogus", "30", "0d", "-1d", "3w", "d"])
def test_a_bad_older_than_is_one_line_and_exit_2_and_changes_nothing(
    database_url: str, tmp_path: Path, bogus: str
) -> None:
    old, _ = make_jobs(database_url)

    code, out, err = cli(database_url, tmp_path, "prune", "--older-than", bogus)

    assert code == 2 and out == ""
    assert err.startswith("jobrelay: error: --older-than") and len(err.splitlines()) == 1
    assert job_exists(database_url, old)


def test_dry_run_counts_then_prune_deletes_and_prints_counts(
    database_url: str, tmp_path: Path
) -> None:
    old, waiting = make_jobs(database_url)

    code, out, _ = cli(database_url, tmp_path, "prune", "--dry-run")
    assert code == 0, out
    assert "dry run, nothing changed" in out and "jobs             1" in out.splitlines()
    assert job_exists(database_url, old)

    code, out, _ = cli(database_url, tmp_path, "prune", "--older-than", "41d")
    assert code == 0 and "jobs             0" in out.splitlines()  # not that old yet
    assert job_exists(database_url, old)

    code, out, _ = cli(database_url, tmp_path, "prune", "--older-than", "39d")
    assert code == 0 and "jobs             1" in out.splitlines()
    assert not job_exists(database_url, old) and job_exists(database_url, waiting)

    for command in (["job", "show", old], ["job", "replay", old], ["job", "cancel", old]):
        extra = ["--reason", "r"] if command[1] == "cancel" else []
        code, out, err = cli(database_url, tmp_path, *command, *extra)
        assert code == 2, (command, err)
        assert err.startswith(f"jobrelay: error: job {old} finished and was deleted by retention")
        assert len(err.splitlines()) == 1
    code, _, err = cli(database_url, tmp_path, "job", "show", "0" * 8 + old[8:])
    assert code == 1 and "no job" in err  # never existed: as before
