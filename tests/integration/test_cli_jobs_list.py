"""``jobrelay jobs list``: an unknown ``--type`` warns naming the known types instead of a
silent ``0 job(s)``; ``--queue`` and ``--account`` filter. In process (typer's runner), on
SQLite and PostgreSQL (issue 24, the newcomer's traps)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from jobrelay.runtime.wiring import utc_now
from jobrelay.storage.engine import create_engine
from jobrelay.storage.store import Store

from .ops_fixtures import new_job
from .test_cli_job_ids import cli as job_cli
from .test_cli_job_ids import restore_logging  # noqa: F401 (its autouse fixture)

pytestmark = pytest.mark.timeout(90)


def submit(database_url: str, account: str, period: str, **extra: Any) -> str:
    async def go() -> str:
        engine = create_engine(database_url)
        try:
            store = Store(engine)
            job_id, _ = await store.submit(
                await new_job(store, period, account, **extra), utc_now()
            )
            return job_id
        finally:
            await engine.dispose()

    return asyncio.run(go())


def cli(database_url: str, tmp_path: Path, *args: str) -> tuple[int, str, str]:
    return job_cli(database_url, tmp_path, "jobs", "list", *args)


def test_an_unknown_type_warns_naming_the_known_ones(database_url: str, tmp_path: Path) -> None:
    submit(database_url, "acme", "2020-05")
    code, out, err = cli(database_url, tmp_path, "--type", "orders.fulfil")
    assert code == 0 and "0 job(s)" in out
    [warning] = err.splitlines()
    assert "'orders.fulfil'" in warning and "report.export" in warning
    code, out, err = cli(database_url, tmp_path, "--type", "report.export")
    assert code == 0 and "1 job(s)" in out and err == ""


def test_queue_and_account_filter(database_url: str, tmp_path: Path) -> None:
    acme = submit(database_url, "acme", "2020-05")
    globex = submit(database_url, "globex", "2020-06")
    high = submit(database_url, "acme", "2020-07", queue="high")
    code, out, _ = cli(database_url, tmp_path, "--account", "globex")
    assert code == 0 and globex in out and acme not in out and "1 job(s)" in out
    code, out, _ = cli(database_url, tmp_path, "--queue", "high")
    assert code == 0 and high in out and acme not in out and "1 job(s)" in out
    code, out, _ = cli(database_url, tmp_path, "--queue", "default", "--account", "acme")
    assert code == 0 and acme in out and high not in out and globex not in out
    code, out, err = cli(database_url, tmp_path, "--queue", "Not A Queue")
    assert code == 2 and out == "" and len(err.splitlines()) == 1 and "--queue" in err
