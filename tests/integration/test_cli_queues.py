"""``jobrelay queues list|pause|resume`` in process (typer's runner), on SQLite and
PostgreSQL with the local transport: the flag the workers poll, audited; bad input is one
line and exit 2, and changes nothing."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from jobrelay.cli.main import app
from jobrelay.storage.engine import create_engine
from jobrelay.storage.queue_pauses import QueueEvent, queue_history
from jobrelay.storage.store import Store

pytestmark = pytest.mark.timeout(90)


def history(database_url: str) -> list[QueueEvent]:
    async def go() -> list[QueueEvent]:
        engine = create_engine(database_url)
        try:
            return await queue_history(Store(engine), "default")
        finally:
            await engine.dispose()

    return asyncio.run(go())


def test_queues_commands_pause_resume_and_refuse_bad_input(
    database_url: str, tmp_path: Path
) -> None:
    env = {
        "JOBRELAY_DATABASE_URL": database_url,
        "JOBRELAY_RESULTS_URL": f"file://{tmp_path}/exports",
        "JOBRELAY_BROKER_URL": "local",
    }
    runner = CliRunner()

    def cli(*args: str) -> tuple[int, str, str]:
        result = runner.invoke(app, ["queues", *args], env=env)
        return result.exit_code, result.stdout, result.stderr

    code, out, _ = cli("list", "--json")
    assert code == 0, out
    [default] = [q for q in json.loads(out)["queues"] if q["queue"] == "default"]
    assert default["paused"] is False and default["ready"] == 0

    for args, message in [
        (("pause", "default", "--reason", "  "), "--reason must not be empty"),
        (("pause", "nope", "--reason", "x"), "no queue 'nope' in this app"),
    ]:
        code, _, err = cli(*args)
        assert code == 2 and err.startswith("jobrelay: error: ") and message in err, err
        assert len(err.strip().splitlines()) == 1
    assert history(database_url) == []

    code, out, _ = cli("pause", "default", "--reason", "deploy", "--actor", "alice")
    assert code == 0 and "paused default" in out
    code, _, err = cli("pause", "default", "--reason", "again")
    assert code == 1 and "already paused" in err
    code, out, _ = cli("list")
    assert code == 0 and "paused by alice (deploy)" in out
    code, out, _ = cli("resume", "default", "--reason", "done")
    assert code == 0 and "resumed default" in out
    resumed, paused = history(database_url)
    assert (paused.kind, paused.actor, paused.reason) == ("paused", "alice", "deploy")
    assert (resumed.kind, resumed.reason) == ("resumed", "done")
    assert resumed.actor.startswith("cli:")


def test_job_show_names_the_pause_holding_a_queued_job(database_url: str, tmp_path: Path) -> None:
    from .test_cli_job_ids import cli as job_cli
    from .test_cli_jobs_list import submit

    job_id = submit(database_url, "acme", "2020-05")
    runner = CliRunner()
    env = {
        "JOBRELAY_DATABASE_URL": database_url,
        "JOBRELAY_RESULTS_URL": f"file://{tmp_path}/exports",
        "JOBRELAY_BROKER_URL": "local",
    }
    paused = runner.invoke(
        app, ["queues", "pause", "default", "--reason", "deploy 42", "--actor", "alice"], env=env
    )
    assert paused.exit_code == 0, paused.stdout
    code, out, _ = job_cli(database_url, tmp_path, "job", "show", job_id)
    assert code == 0, out
    assert "queue default is paused since " in out and "by alice: deploy 42" in out
    [next_line] = [line for line in out.splitlines() if line.startswith("next: ")]
    assert next_line.startswith("next: queue default is paused since ")
    assert "is a worker running" not in next_line
    # params as JSON; a job with an account names it, one without prints no "account None"
    assert '{"period": "2020-05"' in out or '"period": "2020-05"' in out
    code, out, _ = job_cli(database_url, tmp_path, "job", "show", job_id, "--json")
    assert code == 0 and json.loads(out)["queuePause"]["by"] == "alice"
