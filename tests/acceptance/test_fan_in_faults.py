"""Fan-in under faults, with real processes (issue 37, property 1).

A relay and two workers (``jobrelay relay`` / ``jobrelay worker --app``) run an app of the
test's own: 1,000 parts (``enqueue_many``) and a total written ``after=`` all of them. One
worker crashes between a part's completion commit and its ack (``worker.before_ack:crash``);
then, while parts remain, a worker is SIGKILLed at a random moment, again and again, and each
dead worker is restarted as a supervisor would. On SQLite (the local transport, several
processes on one file) and on PostgreSQL + RabbitMQ.

The property, checked against the database: the total ran its body only with every part
ended (the body records what it saw), committed exactly one ``result_saved`` with the right
value, and was claimed only after the last part's ``result_saved`` (by ``job_events.id``,
the store's sequence); it was released once (one ``dependencies_met``).
"""

from __future__ import annotations

import asyncio
import importlib
import json
import random
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

import jobrelay
from jobrelay.storage.tables import job_events

from .procs import FAST_ENV, Proc, clean_env, poll, processes, run_cli

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

PARTS = 1_000
KILLS = 4

APP = """
import asyncio
import json
import os

from pydantic import BaseModel

import jobrelay

app = jobrelay.App()


class Part(BaseModel):
    i: int


class Total(BaseModel):
    pass


@app.job("fan.part", params=Part, max_attempts=25)
async def part(ctx: jobrelay.JobContext[Part], p: Part) -> dict:
    await asyncio.sleep(0.002)
    return {"square": p.i * p.i}


@app.job("fan.total", params=Total, max_attempts=25)
async def total(ctx: jobrelay.JobContext[Total], p: Total) -> dict:
    deps = await ctx.dependencies()
    seen = sorted({d.state.value for d in deps})
    with open(os.environ["FANAPP_LOG"], "a") as log:
        log.write(json.dumps({"attempt": ctx.attempt, "states": seen, "n": len(deps)}) + "\\n")
    return {"total": sum(d.result["square"] for d in deps), "parts": len(deps)}
"""


def write_app(root: Path) -> Path:
    package = root / "fanapp"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "jobs.py").write_text(textwrap.dedent(APP))
    return root


def enqueue(root: Path, url: str) -> tuple[list[str], str]:
    """The parts and the total, in one transaction of the test's own."""
    sys.path.insert(0, str(root))
    try:
        jobs = importlib.import_module("fanapp.jobs")
    finally:
        sys.path.remove(str(root))

    async def write() -> tuple[list[str], str]:
        engine = jobrelay.create_engine(url)
        try:
            async with engine.begin() as conn:
                ids = await jobs.part.enqueue_many(conn, [{"i": i} for i in range(PARTS)])
                total = await jobs.total.enqueue(conn, {}, after=ids)
            return ids, total
        finally:
            await engine.dispose()

    return asyncio.run(write())


def read(url: str, job_ids: list[str]) -> dict[str, Any]:
    async def go() -> dict[str, Any]:
        engine = jobrelay.create_engine(url)
        store = jobrelay.App(settings=jobrelay.Settings(database_url=url))
        try:
            found = {}
            for job_id in job_ids:
                found[job_id] = await store.get_job(job_id)
            async with engine.connect() as conn:
                rows = (
                    await conn.execute(
                        select(job_events.c.id, job_events.c.job_id, job_events.c.kind).where(
                            job_events.c.kind.in_(["result_saved", "claimed", "dependencies_met"])
                        )
                    )
                ).all()
            found["events"] = rows
            return found
        finally:
            await store.aclose()
            await engine.dispose()

    return asyncio.run(go())


@pytest.fixture(params=["sqlite", "postgres"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> dict[str, str]:
    """The processes' settings, and ``url``: the database as the test reads it."""
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'jobrelay.db'}"
        env = clean_env(JOBRELAY_DATABASE_URL=url)
        done = run_cli("db", "upgrade", env=env)
        assert done.returncode == 0, done.stderr
        return {"url": url, "JOBRELAY_DATABASE_URL": url}
    url = request.getfixturevalue("pg_url")
    return {
        "url": url,
        "JOBRELAY_DATABASE_URL": request.getfixturevalue("pg_app_url"),
        "JOBRELAY_BROKER_URL": request.getfixturevalue("amqp_app_url"),
    }


def test_a_total_after_a_thousand_parts_runs_once_under_kills(
    tmp_path: Path, backend: dict[str, str]
) -> None:
    root = write_app(tmp_path / "outside")
    log = tmp_path / "total.log"
    url = backend.pop("url")
    env = clean_env(
        JOBRELAY_APP="fanapp.jobs:app",
        JOBRELAY_RESULTS_URL=f"file://{tmp_path / 'results'}",
        FANAPP_LOG=str(log),
        **backend,
        **FAST_ENV,
    )
    if "JOBRELAY_BROKER_URL" in env:
        declared = run_cli("broker", "declare", env=env, cwd=root)
        assert declared.returncode == 0, declared.stderr
    parts, total = enqueue(root, url)
    rng = random.Random(37)
    with processes(tmp_path) as start:
        start("relay", "relay", env=env, cwd=root)
        crashing = {**env, "JOBRELAY_FAULTS": "worker.before_ack:crash:3"}
        workers: list[Proc] = [
            start("worker", "worker", env=crashing, cwd=root),
            start("worker", "worker", env=env, cwd=root),
        ]
        poll(lambda: workers[0].popen.poll() is not None, 60, "the crash before an ack")
        assert workers[0].popen.returncode == 137, workers[0].log()[-2000:]
        workers[0] = start("worker", "worker", env=env, cwd=root)
        kills = 0
        while kills < KILLS:
            time.sleep(rng.uniform(0.3, 1.0))
            state = read(url, [total])[total]
            if state is not None and state.state.value != "waiting":
                break  # every part has ended: no more kills
            victim = rng.randrange(len(workers))
            workers[victim].kill9()
            kills += 1
            workers[victim] = start("worker", "worker", env=env, cwd=root)
        done = poll(
            lambda: (j := read(url, [total])[total]) is not None and j.state.is_terminal and j,
            180,
            "the total to end",
        )
    assert kills >= 1, "no worker was killed while parts remained"
    assert done.state.value == "succeeded", (done.state, done.last_error)
    assert done.result == {"total": sum(i * i for i in range(PARTS)), "parts": PARTS}
    found = read(url, [*parts, total])
    assert all(found[p].state.value == "succeeded" for p in parts)
    events = found["events"]
    saved: dict[str, list[int]] = {}
    for row in events:
        if row.kind == "result_saved":
            saved.setdefault(row.job_id, []).append(row.id)
    assert len(saved[total]) == 1  # exactly one outcome of the total
    assert all(len(saved[p]) == 1 for p in parts)
    released = [row for row in events if row.kind == "dependencies_met"]
    assert [row.job_id for row in released] == [total]
    first_claim = min(row.id for row in events if row.kind == "claimed" and row.job_id == total)
    assert first_claim > max(saved[p][0] for p in parts)  # never before the last part
    runs = [json.loads(line) for line in log.read_text().splitlines()]
    assert runs and all(r == {**r, "states": ["succeeded"], "n": PARTS} for r in runs), runs
