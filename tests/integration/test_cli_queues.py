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
