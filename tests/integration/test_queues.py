"""Queues: ``@app.job(queue=...)`` routes a job type to a work queue of its own.

An application with a quick type on the default queue and a slow one on ``images``; two
workers, each given one queue, on the real local transport with the real relay. Each worker
runs only its own queue's type, and a retry of the queued type comes back to its queue.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path

import pytest
from pydantic import BaseModel

import jobrelay
from jobrelay.domain.messages import JobMessage
from jobrelay.domain.states import JobState
from jobrelay.errors import ConfigError
from jobrelay.observe.faults import Faults
from jobrelay.relay.publisher import Relay
from jobrelay.results.files import FileResults
from jobrelay.runtime.wiring import Runtime, topology_for
from jobrelay.settings import Settings
from jobrelay.storage.admin import AdminQueries
from jobrelay.storage.engine import create_engine
from jobrelay.storage.repairs import RepairQueries
from jobrelay.storage.store import EventRecord, Store
from jobrelay.storage.tables import outbox
from jobrelay.transport.local import LocalTransport
from jobrelay.worker.consumer import Worker


class Ping(BaseModel):
    n: int


class Resize(BaseModel):
    image_id: int


app = jobrelay.App()


@app.job("quick.ping", params=Ping)
async def ping(ctx: jobrelay.JobContext[Ping], params: Ping) -> None:
    return None


@app.job("images.resize", params=Resize, retry_delays=(1,), queue="images")
async def resize(ctx: jobrelay.JobContext[Resize], params: Resize) -> None:
    if ctx.attempt == 1:
        raise jobrelay.Retry("the first attempt always fails")


def test_queue_names_are_validated_and_the_app_knows_its_queues() -> None:
    other = jobrelay.App()
    for bad in ("", "Images", "a.b", "-x", "x" * 33):
        with pytest.raises(ConfigError):
            other.job(f"t.{len(bad)}{bad[:3]}", params=Ping, queue=bad)
    assert app.queues == ("default", "images")
    assert resize.new_job({"image_id": 1}).destination == "work.images"
    assert ping.new_job({"n": 1}).destination == "work"


@pytest.fixture
async def rt(database_url: str, tmp_path: Path) -> AsyncIterator[Runtime]:
    settings = Settings(
        database_url=database_url,
        results_url=f"file://{tmp_path}/results",
        retry_delays=(1,),
        lease_seconds=5,
        relay_poll_seconds=0.05,
        prefetch=2,
        drain_seconds=3,
    )
    engine = create_engine(database_url)
    topology = topology_for(settings, app)
    runtime = Runtime(
        settings=settings,
        engine=engine,
        store=Store(engine),
        transport=LocalTransport(engine, topology, poll_seconds=0.05),
        results=FileResults(settings.results_url),
        faults=Faults(),
        topology=topology,
        app=app,
    )
    yield runtime
    await runtime.transport.close()
    await engine.dispose()


async def _wait_for(rt: Runtime, job_id: str, state: JobState, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = await rt.store.get_job(job_id)
        if job is not None and job.state is state:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"job {job_id} not {state.value} within {timeout}s: {job}")


async def test_each_worker_runs_only_its_queue_and_a_retry_returns_to_its_queue(
    rt: Runtime,
) -> None:
    async with rt.engine.begin() as conn:
        quick = await ping.enqueue(conn, {"n": 1})
        slow = await resize.enqueue(conn, {"image_id": 7})
    stops = [asyncio.Event() for _ in range(3)]
    transports = [LocalTransport(rt.engine, rt.topology, poll_seconds=0.05) for _ in range(2)]
    workers = {
        "default": Worker(dataclasses.replace(rt, transport=transports[0]), queues=["default"]),
        "images": Worker(dataclasses.replace(rt, transport=transports[1]), queues=["images"]),
    }
    tasks = [
        asyncio.create_task(Relay(rt).run(stops[0])),
        asyncio.create_task(workers["default"].run(stops[1])),
        asyncio.create_task(workers["images"].run(stops[2])),
    ]
    try:
        await _wait_for(rt, quick, JobState.SUCCEEDED)
        await _wait_for(rt, slow, JobState.SUCCEEDED)
    finally:
        for stop in stops:
            stop.set()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait_for(task, 15)
        for transport in transports:
            await transport.close()

    def claimed_by(events: list[EventRecord]) -> set[str]:
        return {e.detail["worker"] for e in events if e.kind == "claimed"}

    quick_events = await rt.store.events(quick)
    slow_events = await rt.store.events(slow)
    assert claimed_by(quick_events) == {workers["default"].worker_id}
    # Both attempts of the queued type, the retry included, ran on the images worker.
    assert claimed_by(slow_events) == {workers["images"].worker_id}
    assert [e.detail["attempt"] for e in slow_events if e.kind == "claimed"] == [1, 2]
    async with rt.engine.connect() as conn:
        sent = {
            (r.job_id, r.destination)
            for r in await conn.execute(outbox.select().where(outbox.c.job_id.in_([quick, slow])))
        }
    assert sent == {(quick, "work"), (slow, "work.images"), (slow, "retry.images.1s")}
    job = await rt.store.get_job(slow)
    assert job is not None and job.queue == "images"


async def test_a_worker_given_an_unknown_queue_is_a_config_error(rt: Runtime) -> None:
    with pytest.raises(ConfigError, match="'nope'") as raised:
        Worker(rt, queues=["images", "nope"])
    assert raised.value.variable == "--queue"


def test_worker_with_an_unknown_queue_is_a_one_line_usage_error(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "jobrelay",
            "worker",
            "--app",
            "tests.integration.test_queues:app",
            "--database-url",
            f"sqlite:///{tmp_path}/never-created.db",
            "--queue",
            "images",
            "--queue",
            "nope",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [
        "jobrelay: error: --queue: no job type of this app uses queue 'nope' "
        "(its queues: default, images)"
    ]
    assert not (tmp_path / "never-created.db").exists()


async def test_a_deferral_a_replay_and_a_reconciler_resend_go_to_the_jobs_own_queue(
    rt: Runtime,
) -> None:
    async with rt.engine.begin() as conn:
        job_id = await resize.enqueue(conn, {"image_id": 8})
    now = rt.clock()
    await rt.store.defer(job_id, JobMessage(job_id, "images.resize"), 1, "not yet", now)
    assert await rt.store.quarantine(job_id, "operator test", now)
    outcome = await AdminQueries(rt.store).replay(
        job_id, actor="test", reason="fixed", budget=1, now=now
    )
    assert outcome.done
    # The reconciler's re-send of a job whose worker was lost goes there too.
    assert await rt.store.claim_job(job_id, "lost-worker", now, timedelta(seconds=1))
    later = now + timedelta(hours=1)
    assert await RepairQueries(rt.store).requeue_expired_lease(
        job_id, "lost-worker", later, later, "reconciler"
    )
    async with rt.engine.connect() as conn:
        sent = [
            r.destination
            for r in await conn.execute(
                outbox.select().where(outbox.c.job_id == job_id).order_by(outbox.c.id)
            )
        ]
    assert sent == ["work.images", "retry.images.1s", "work.images", "work.images"]
