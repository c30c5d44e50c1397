"""Periodic jobs in real processes: a one-second schedule of an app written outside the repo.

- Three relays on PostgreSQL + RabbitMQ (each runs a scheduler) → one job per tick, no tick
  missing between the first and the last; pause and resume with the CLI while they run.
- A scheduler killed with ``kill -9`` and restarted, on PostgreSQL (a relay) and on the
  embedded default (``up``): with a catch-up window, every tick of the outage is enqueued
  once when it comes back; with the default (``last``), the ticks it missed are recorded as
  skipped, and every tick is either one job or listed as skipped, never both, never neither.

Ticks are real seconds; the assertions are about keys and counts, never about timing.
"""

from __future__ import annotations

import json
import textwrap
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine, text

from jobrelay.domain.schedules import LISTED

from .procs import FAST_ENV, clean_env, free_port, poll, processes, run_cli, wait_http

NAME = "every-second"
JOBS = f"""
from datetime import datetime

import jobrelay
from pydantic import BaseModel

app = jobrelay.App()


class Beat(BaseModel):
    scheduled_at: datetime


@app.job("beat.second", params=Beat)
async def beat(ctx: jobrelay.JobContext[Beat], params: Beat) -> None:
    ctx.log.info("beat for %s", params.scheduled_at.isoformat())


app.schedule(beat, cron="* * * * * *", name="{NAME}")
"""
PREFIX = f"schedule:{NAME}:"


def write_app(root: Path) -> Path:
    pkg = root / "tickapp"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "jobs.py").write_text(textwrap.dedent(JOBS))
    return root


def rows(url: str, query: str, **params: Any) -> list[Any]:
    engine = create_engine(url.replace("postgresql://", "postgresql+psycopg://"))
    try:
        with engine.connect() as conn:
            return list(conn.execute(text(query), params).all())
    finally:
        engine.dispose()


def ticks(url: str) -> list[datetime]:
    """The tick of every tick job, from its key; sorted (a tick twice would show twice)."""
    keys = rows(
        url, "SELECT idempotency_key FROM jobs WHERE idempotency_key LIKE :p", p=PREFIX + "%"
    )
    return sorted(datetime.fromisoformat(k.removeprefix(PREFIX)) for (k,) in keys)


def scheduled_events(url: str) -> list[dict[str, Any]]:
    found = rows(url, "SELECT detail FROM job_events WHERE kind = 'scheduled'")
    return [d if isinstance(d, dict) else json.loads(d) for (d,) in found]


def skipped_ticks(url: str) -> list[datetime]:
    found = rows(url, "SELECT detail FROM schedule_events WHERE kind = 'ticks_skipped' ORDER BY id")
    out: list[datetime] = []
    for (raw,) in found:
        detail = raw if isinstance(raw, dict) else json.loads(raw)
        # Every skipped tick is counted; only the first LISTED are named (a pause that a
        # loaded machine stretches past 20 s skips more): rebuild the run from first..last.
        every = consecutive(
            datetime.fromisoformat(detail["first"]), datetime.fromisoformat(detail["last"])
        )
        listed = [datetime.fromisoformat(t) for t in detail["ticks"]]
        assert detail["countComplete"] and detail["count"] == len(every)
        assert listed == every[:LISTED]
        out.extend(every)
    return out


def consecutive(first: datetime, last: datetime) -> list[datetime]:
    n = int((last - first).total_seconds())
    return [first + timedelta(seconds=i) for i in range(n + 1)]


def count_at_least(url: str, n: int) -> bool:
    return len(ticks(url)) >= n


def wait_past(moment: datetime, seconds: float) -> bool:
    return datetime.now(UTC) >= moment + timedelta(seconds=seconds)


def cli_json(env: dict[str, str], root: Path, *args: str) -> Any:
    done = run_cli(*args, "--json", env=env, cwd=root)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.mark.slow
@pytest.mark.postgres
@pytest.mark.rabbitmq
@pytest.mark.timeout(240)
@pytest.mark.long
def test_three_relays_on_postgres_make_one_job_per_tick(
    tmp_path: Path, pg_url: str, amqp_url: str
) -> None:
    root = write_app(tmp_path / "outside")
    env = clean_env(
        JOBRELAY_DATABASE_URL=pg_url,
        JOBRELAY_BROKER_URL=amqp_url,
        JOBRELAY_RESULTS_URL=f"file://{tmp_path / 'results'}",
        JOBRELAY_APP="tickapp.jobs:app",
        # A window, not the default `last`: on a loaded machine all three could stall for
        # over a second, and `last` would then (rightly, and recorded) skip a tick.
        JOBRELAY_SCHEDULE_CATCHUP="1h",
        **FAST_ENV,
    )
    for command in (("db", "upgrade"), ("broker", "declare")):
        done = run_cli(*command, env=env, cwd=root)
        assert done.returncode == 0, done.stderr
    with processes(tmp_path) as start:
        relays = [start("relay", "relay", env=env, cwd=root) for _ in range(3)]
        start("worker", "worker", env=env, cwd=root)
        poll(lambda: count_at_least(pg_url, 8), 60, "eight ticks")
        for relay in relays:
            assert relay.popen.poll() is None, relay.log()[-2000:]
            assert "scheduler started" in relay.log()

        # Pause with the CLI while the three run: the schedulers skip and count the ticks.
        paused_at = datetime.now(UTC)
        done = run_cli("schedules", "pause", NAME, "--reason", "test", env=env, cwd=root)
        assert done.returncode == 0, done.stderr

        def skipped_while_paused() -> int:
            (row,) = cli_json(env, root, "schedules", "list")["schedules"]
            return int((row["skippedWhilePaused"] or {}).get("count", 0))

        poll(lambda: skipped_while_paused() >= 2, 30, "two ticks skipped while paused")
        done = run_cli("schedules", "resume", NAME, "--reason", "test over", env=env, cwd=root)
        assert done.returncode == 0, done.stderr
        resumed_at = datetime.now(UTC)
        before = len(ticks(pg_url))
        poll(lambda: count_at_least(pg_url, before + 3), 30, "ticks after the resume")
    found = ticks(pg_url)
    assert len(found) == len(set(found))  # one job per tick
    skipped = skipped_ticks(pg_url)
    assert skipped and not set(skipped) & set(found)
    # Every tick from the first to the last is a job, except the paused ones, which are
    # recorded as skipped.
    assert sorted(found + skipped) == consecutive(found[0], found[-1])
    # One run of skipped ticks, ending before the resume. (It may start a little before the
    # pause: the ticks due since the schedulers' last pass when the pause landed.)
    assert sorted(skipped) == consecutive(min(skipped), max(skipped))
    assert paused_at - timedelta(seconds=10) <= min(skipped) and max(skipped) <= resumed_at
    events = scheduled_events(pg_url)
    assert sorted(datetime.fromisoformat(e["tick"]) for e in events) == found  # written once
    shown = cli_json(env, root, "schedules", "show", NAME)
    assert [e["kind"] for e in shown["events"]][:3] == ["resumed", "ticks_skipped", "paused"]
    last = rows(
        pg_url, "SELECT id FROM jobs WHERE idempotency_key = :k", k=PREFIX + found[-1].isoformat()
    )
    assert shown["lastJobId"] == last[0][0] and shown["lastTick"] == found[-1].isoformat()


CASES = [
    pytest.param("sqlite", "1h", id="embedded-window"),
    pytest.param("sqlite", "last", id="embedded-last"),
    pytest.param("postgres", "1h", id="postgres-window", marks=[pytest.mark.postgres]),
]


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize(("database", "catchup"), CASES)
@pytest.mark.long
def test_a_scheduler_killed_and_restarted_loses_and_doubles_no_tick(
    tmp_path: Path, request: pytest.FixtureRequest, database: str, catchup: str
) -> None:
    root = write_app(tmp_path / "outside")
    settings = {
        "JOBRELAY_RESULTS_URL": f"file://{tmp_path / 'results'}",
        "JOBRELAY_APP": "tickapp.jobs:app",
        "JOBRELAY_SCHEDULE_CATCHUP": catchup,
        **FAST_ENV,
    }
    if database == "sqlite":
        url = f"sqlite:///{tmp_path / 'jobrelay.db'}"
        env = clean_env(JOBRELAY_DATABASE_URL=url, **settings)
        port = free_port()
        args: tuple[str, ...] = ("up", "--port", str(port))
    else:
        url = str(request.getfixturevalue("pg_url"))
        env = clean_env(JOBRELAY_DATABASE_URL=url, **settings)
        args = ("relay",)  # the local transport on PostgreSQL: no broker needed to enqueue
    done = run_cli("db", "upgrade", env=env, cwd=root)
    assert done.returncode == 0, done.stderr
    with processes(tmp_path) as start:
        first = start("scheduler", *args, env=env, cwd=root)
        if database == "sqlite":
            wait_http(f"http://127.0.0.1:{port}", first)
        poll(lambda: count_at_least(url, 3), 60, "three ticks")
        first.kill9()
        killed_at = datetime.now(UTC)
        before = ticks(url)
        poll(lambda: wait_past(killed_at, 3.5), 10, "an outage of three seconds and more")
        restarted_at = datetime.now(UTC)
        second = start("scheduler", *args, env=env, cwd=root)
        poll(lambda: count_at_least(url, len(before) + 3), 60, "ticks after the restart")
        assert second.popen.poll() is None, second.log()[-2000:]
    found = ticks(url)
    assert len(found) == len(set(found))
    skipped = skipped_ticks(url)
    # Due while no scheduler ran (a new process needs well over a second to make its first
    # pass, so a tick a second before the restart is still one it has to catch up).
    outage = [
        t
        for t in consecutive(found[0], found[-1])
        if killed_at < t <= restarted_at - timedelta(seconds=1)
    ]
    assert outage
    if catchup == "last":
        # The ticks it missed are recorded, the latest one is enqueued: none are neither.
        assert skipped and not set(skipped) & set(found)
        assert sorted(found + skipped) == consecutive(found[0], found[-1])
        assert len(set(outage) & set(found)) <= 1  # at most the latest, at the restart
    else:
        assert skipped == []
        assert found == consecutive(found[0], found[-1])  # the outage was caught up
        late = {
            datetime.fromisoformat(e["tick"])
            for e in scheduled_events(url)
            if e["delaySeconds"] >= 1.0
        }
        assert set(outage) <= late  # enqueued by the restarted scheduler, late


def test_schedules_cli_refuses_bad_input_with_one_line(tmp_path: Path) -> None:
    root = write_app(tmp_path / "outside")
    url = f"sqlite:///{tmp_path / 'jobrelay.db'}"
    env = clean_env(JOBRELAY_DATABASE_URL=url, JOBRELAY_APP="tickapp.jobs:app")
    assert run_cli("db", "upgrade", env=env, cwd=root).returncode == 0
    listed = run_cli("schedules", "list", env=env, cwd=root)
    assert listed.returncode == 0 and "no schedules yet" in listed.stdout
    blank = run_cli("schedules", "pause", NAME, "--reason", "  ", env=env, cwd=root)
    assert (blank.returncode, blank.stderr) == (2, "jobrelay: error: --reason must not be empty\n")
    unknown = run_cli("schedules", "resume", "nope", "--reason", "x", env=env, cwd=root)
    assert unknown.returncode == 1 and unknown.stderr.startswith("jobrelay: error: no schedule")
    bad = run_cli("schedules", "list", "--schedule-catchup", "soon", env=env, cwd=root)
    assert bad.returncode == 2 and "JOBRELAY_SCHEDULE_CATCHUP" in bad.stderr
    assert rows(url, "SELECT count(*) FROM schedule_events") == [(0,)]
