"""docs/tutorial-first-job.md, run for real: examples/first_job under `jobrelay up --app`.

The example's main inserts a signup and enqueues its welcome job in one transaction, then
does the same in a transaction that rolls back. The committed job must succeed through the
real API + relay + worker process (SQLite + local transport, the embedded default), and the
rolled-back one must have left nothing. The tutorial's code blocks must be the example's code.
"""

from __future__ import annotations

import os
import re
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from .procs import FAST_ENV, clean_env, free_port, poll, processes, run_cli, wait_http

ROOT = Path(__file__).resolve().parents[2]
TUTORIAL = ROOT / "docs" / "tutorial-first-job.md"
FINISHED = {"succeeded", "quarantined", "cancelled"}


def read(db: Path, sql: str, *args: str) -> list[tuple[object, ...]]:
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=30) as conn:
        return conn.execute(sql, args).fetchall()


def job_state(db: Path, job_id: str) -> str | None:
    rows = read(db, "SELECT state FROM jobs WHERE id = ?", job_id)
    return str(rows[0][0]) if rows else None


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.long
def test_the_tutorial_signup_runs_its_job_and_the_rollback_leaves_nothing(
    tmp_path: Path,
) -> None:
    db = tmp_path / "jobrelay.db"
    results = tmp_path / "results"
    python_path = os.pathsep.join(
        p for p in (str(ROOT), str(ROOT / "src"), os.environ.get("PYTHONPATH")) if p
    )
    env = clean_env(
        JOBRELAY_DATABASE_URL=f"sqlite:///{db}",
        JOBRELAY_RESULTS_URL=f"file://{results}",
        PYTHONPATH=python_path,
        **FAST_ENV,
    )
    port = free_port()
    with processes(tmp_path) as start:
        up = start(
            "up", "up", "--app", "examples.first_job.app:app", "--port", str(port),
            env=env, cwd=ROOT,
        )  # fmt: skip
        wait_http(f"http://127.0.0.1:{port}", up)  # `up` ran `db upgrade` before serving

        ran = subprocess.run(
            [sys.executable, "-m", "examples.first_job.main"],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert ran.returncode == 0, ran.stdout + ran.stderr
        # `up` may take the job before the example reads it back: any state past the commit.
        committed = re.search(
            r"^committed: signup (\d+), job (\S+) is (queued|running|succeeded)$", ran.stdout, re.M
        )
        rolled_back = re.search(
            r"^rolled back: 0 signup rows, job (\S+) is None$", ran.stdout, re.M
        )
        assert committed and rolled_back, ran.stdout
        job_id, lost_id = committed[2], rolled_back[1]

        state = poll(
            lambda: s if (s := job_state(db, job_id)) in FINISHED else None,
            60,
            f"job {job_id} to finish\n{up.log()[-3000:]}",
        )
        assert state == "succeeded", up.log()[-3000:]

        shown = run_cli("job", "show", job_id, env={**env, "COLUMNS": "200"}, cwd=ROOT)
        assert shown.returncode == 0, shown.stderr
        assert "succeeded" in shown.stdout and "next: done" in shown.stdout, shown.stdout
        via_app = subprocess.run(
            [sys.executable, "-m", "examples.first_job.main", "show", job_id],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert f"welcome.send {job_id}: succeeded, attempt 1/3" in via_app.stdout, via_app
        key = f"welcome.send/{job_id}/welcome.txt"
        # The value the job returned, read back with its result key.
        assert f"result {key} {{'signupId': 1, 'welcomed': True}}" in via_app.stdout, via_app
        assert (results / key).read_text() == "Welcome aboard, ada@example.com!\n"

        # The rolled-back transaction took its job with it: no row, no outbox, no event.
        missing = run_cli("job", "show", lost_id, env=env, cwd=ROOT)
        assert missing.returncode == 1 and "no job" in missing.stdout + missing.stderr
        assert read(db, "SELECT id FROM jobs") == [(job_id,)]
        assert read(db, "SELECT count(*) FROM outbox WHERE job_id = ?", lost_id) == [(0,)]
        assert read(db, "SELECT count(*) FROM job_events WHERE job_id = ?", lost_id) == [(0,)]
        signup_id = int(committed[1])
        assert read(db, "SELECT id, email FROM signups") == [(signup_id, "ada@example.com")]


def test_the_tutorial_quotes_the_example_as_it_is() -> None:
    """Every ```python block after a line naming `examples/first_job/<file>` is in that file."""
    text = TUTORIAL.read_text()
    quoted = re.findall(r"`(examples/first_job/\w+\.py)`[^\n]*\n+```python\n(.*?)```", text, re.S)
    assert len(quoted) >= 3, "the tutorial quotes the example by file"
    for path, block in quoted:
        source = (ROOT / path).read_text()
        assert block in source, f"{TUTORIAL.name} quotes {path} out of date:\n{block}"
