"""``jobrelay job resend ID --reason …`` in process (typer's runner), on SQLite and PostgreSQL:
a stuck queued job gets a new work message and a ``resent`` event naming the actor and the
reason; a job in any other state, or no job, is one line and exit 2 and changes nothing
(issue 21, item 4)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

import pytest
from sqlalchemy import func, select
from typer.testing import CliRunner

from jobrelay.cli.main import app
from jobrelay.domain.states import JobState
from jobrelay.storage.engine import create_engine
from jobrelay.storage.store import Store
from jobrelay.storage.tables import outbox

from .ops_fixtures import job_in_state

pytestmark = pytest.mark.timeout(90)
T = TypeVar("T")


def on_store(database_url: str, work: Callable[[Store], Awaitable[T]]) -> T:
    async def go() -> T:
        engine = create_engine(database_url)
        try:
            return await work(Store(engine))
        finally:
            await engine.dispose()

    return asyncio.run(go())


async def messages(store: Store, job_id: str) -> int:
    async with store.reading() as conn:
        return int(await conn.scalar(select(func.count()).where(outbox.c.job_id == job_id)) or 0)


def test_job_resend_sends_a_queued_job_again_and_refuses_any_other(
    database_url: str, tmp_path: Path
) -> None:
    now = datetime.now(UTC)
    queued = on_store(database_url, lambda s: job_in_state(s, JobState.QUEUED, now))
    done = on_store(
        database_url, lambda s: job_in_state(s, JobState.SUCCEEDED, now, period="2020-06")
    )
    env = {
        "JOBRELAY_DATABASE_URL": database_url,
        "JOBRELAY_RESULTS_URL": f"file://{tmp_path}/exports",
        "JOBRELAY_BROKER_URL": "local",
    }
    runner = CliRunner()

    def cli(*args: str) -> tuple[int, str, str]:
        result = runner.invoke(app, ["job", "resend", *args], env=env)
        return result.exit_code, result.stdout, result.stderr

    code, out, err = cli(queued, "--reason", "message dead-lettered", "--actor", "alice")
    assert code == 0 and f"resent {queued}" in out, (out, err)
    assert on_store(database_url, lambda s: messages(s, queued)) == 2
    events: Any = on_store(database_url, lambda s: s.events(queued))
    last = events[-1]
    assert last.kind == "resent"
    assert (last.detail["actor"], last.detail["reason"]) == ("alice", "message dead-lettered")
    job: Any = on_store(database_url, lambda s: s.get_job(queued))
    assert job.state is JobState.QUEUED and job.attempt == 0

    for args, message in [
        ((done, "--reason", "x"), "is succeeded; resend is allowed only from queued"),
        (("00000000-0000-0000-0000-000000000000", "--reason", "x"), "no job "),
        ((queued, "--reason", "  "), "--reason must not be empty"),
    ]:
        code, _, err = cli(*args)
        assert code == 2 and err.startswith("jobrelay: error: ") and message in err, err
        assert len(err.strip().splitlines()) == 1
    assert on_store(database_url, lambda s: messages(s, queued)) == 2
    assert on_store(database_url, lambda s: messages(s, done)) == 1
