"""A PostgreSQL failover under load, with real processes (issue 38).

A primary and a synchronous standby of the test's own (``jobrelay.chaos.pg_pair``: never the
machine's PostgreSQL); a relay and two workers (``jobrelay relay`` / ``jobrelay worker
--app``, the database-backed transport, so every hand-off is in the database) configured
with both hosts in one URL. Jobs are enqueued, the primary is stopped at once and the
standby promoted while they run; more jobs are enqueued on the new primary; then the old
primary is made a standby and the pair fails back, under load again.

The property, against the database and the jobs' own side effects: every job succeeded
once (one ``result_saved``), no body ran twice, and every jobrelay process is still the one
started (none exited: each found the new primary by itself).
"""

from __future__ import annotations

import asyncio
import importlib
import json
import sys
import textwrap
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import psycopg
import pytest

import jobrelay
from jobrelay.chaos.pg_pair import PairError, PostgresPair, available

from ..conftest import _unavailable
from ..own_servers import OwnAutoFailover, OwnPostgresError
from .procs import FAST_ENV, Proc, clean_env, poll, processes, run_cli

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

WAVE = 300

APP = """
import asyncio
import json
import os

from pydantic import BaseModel

import jobrelay

app = jobrelay.App()


class Step(BaseModel):
    i: int


@app.job("failover.step", params=Step, max_attempts=10)
async def step(ctx: jobrelay.JobContext[Step], p: Step) -> dict:
    with open(os.environ["FAILOVER_LOG"], "a") as log:
        log.write(json.dumps({"job": ctx.job_id, "attempt": ctx.attempt}) + "\\n")
    await asyncio.sleep(0.01)
    return {"i": p.i}
"""


@pytest.fixture
def pair() -> Iterator[PostgresPair]:
    """A primary and a synchronous standby of the test's own; a clear skip (a failure under
    JOBRELAY_REQUIRE_SERVICES=1) where the server binaries are missing."""
    if (reason := available()) is not None:
        _unavailable("a PostgreSQL primary and standby", reason)
    try:
        made = PostgresPair()
    except PairError as exc:
        _unavailable("a PostgreSQL primary and standby", str(exc))
    try:
        yield made
    finally:
        made.remove()


def write_app(root: Path) -> Path:
    package = root / "failoverapp"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "jobs.py").write_text(textwrap.dedent(APP))
    return root


def enqueue(root: Path, url: str, start: int) -> list[str]:
    sys.path.insert(0, str(root))
    try:
        jobs = importlib.import_module("failoverapp.jobs")
    finally:
        sys.path.remove(str(root))

    async def write() -> list[str]:
        engine = jobrelay.create_engine(url)
        try:
            async with engine.begin() as conn:
                return await jobs.step.enqueue_many(
                    conn, [{"i": i} for i in range(start, start + WAVE)]
                )
        finally:
            await engine.dispose()

    return asyncio.run(write())


def states(url: str) -> Counter[str]:
    with psycopg.connect(url, autocommit=True) as conn:
        rows = conn.execute("SELECT state, count(*) FROM jobs GROUP BY state").fetchall()
    return Counter({state: n for state, n in rows})


def test_two_failovers_and_a_failback_lose_nothing_and_stop_no_process(
    tmp_path: Path, pair: PostgresPair
) -> None:
    with psycopg.connect(pair.admin_url(), autocommit=True) as conn:
        conn.execute("CREATE DATABASE jobrelay")

    def rejoin(wave: int) -> None:
        if wave == 0:
            pair.rejoin()  # the second failover is a failback onto the first primary

    recoveries = run_through_failovers(
        tmp_path, pair.url("jobrelay"), lambda wave: pair.failover(), rejoin
    )
    print(f"recovery after each failover (first job succeeded): {recoveries}")


def test_pg_auto_failover_moving_the_primary_twice_loses_nothing(tmp_path: Path) -> None:
    """The same load on a pg_auto_failover formation (a monitor and two nodes), the URL as
    ``pg_autoctl show uri`` gives it (both hosts, ``target_session_attrs=read-write``), the
    primary moved by the monitor twice (``pg_autoctl perform failover``): there and back."""
    try:
        formation = OwnAutoFailover()
    except OwnPostgresError as exc:
        _unavailable("pg_auto_failover", str(exc))
    try:
        try:
            formation.start()
        except OwnPostgresError as exc:
            _unavailable("pg_auto_failover", str(exc))
        recoveries = run_through_failovers(
            tmp_path, formation.url, lambda wave: formation.failover()
        )
        print(f"pg_auto_failover: recovery after each failover: {recoveries}")
    finally:
        formation.remove()


def run_through_failovers(
    tmp_path: Path,
    url: str,
    fail_over: Callable[[int], object],
    after: Callable[[int], object] = lambda wave: None,
) -> list[float]:
    """Three waves of jobs with a relay and two workers on ``url``; ``fail_over(wave)`` once
    each of the first two waves is under way, then, once a job succeeded after it,
    ``after(wave)``. Asserts the property (module docstring); returns the seconds from each
    failover to the first job succeeded after it."""
    root = write_app(tmp_path / "outside")
    log = tmp_path / "runs.log"
    env = clean_env(
        JOBRELAY_DATABASE_URL=url,
        JOBRELAY_BROKER_URL="local",
        JOBRELAY_APP="failoverapp.jobs:app",
        JOBRELAY_RESULTS_URL=f"file://{tmp_path / 'results'}",
        FAILOVER_LOG=str(log),
        **{**FAST_ENV, "JOBRELAY_LEASE_SECONDS": "15", "JOBRELAY_VISIBILITY_SECONDS": "15"},
    )
    upgraded = run_cli("db", "upgrade", env=env, cwd=root)
    assert upgraded.returncode == 0, upgraded.stderr
    ids: list[str] = []
    recoveries: list[float] = []
    with processes(tmp_path) as start:
        procs: list[Proc] = [
            start("relay", "relay", env=env, cwd=root),
            start("worker", "worker", env=env, cwd=root),
            start("worker", "worker", env=env, cwd=root),
        ]
        for wave in range(3):
            ids += enqueue(root, url, wave * WAVE)
            # Under load: a third of this wave done, the rest queued or running.
            due = len(ids) - 2 * WAVE // 3
            poll(lambda due=due: states(url)["succeeded"] >= due, 120, f"wave {wave} under way")
            if wave == 2:
                break
            # Read first: the rest of the wave may all finish the moment the new primary is up.
            before = states(url)["succeeded"]
            fail_over(wave)
            started = time.monotonic()
            poll(lambda b=before: states(url)["succeeded"] > b, 60, "a job after the failover")
            recoveries.append(time.monotonic() - started)
            after(wave)
        poll(lambda: states(url)["succeeded"] == len(ids), 180, "every job to succeed")
        exited = {p.name: p.popen.poll() for p in procs if p.popen.poll() is not None}
        logs = {p.name: p.log()[-3000:] for p in procs}
    assert exited == {}, (exited, logs)
    assert states(url) == Counter({"succeeded": len(ids)})
    with psycopg.connect(url, autocommit=True) as conn:
        saved = conn.execute(
            "SELECT job_id, count(*) FROM job_events WHERE kind = 'result_saved' GROUP BY job_id"
        ).fetchall()
    assert len(saved) == len(ids) and all(n == 1 for _, n in saved)
    runs = Counter(json.loads(line)["job"] for line in log.read_text().splitlines())
    assert set(runs) == set(ids)
    assert [job for job, n in runs.items() if n > 1] == []  # no body ran twice
    return recoveries
