"""Helpers shared by the operations tests (operator actions, reconciler, metrics, tracing).

``held_runs`` is the hand-driven setup of the lease tests: three jobs run at once by one
worker, each held until the test lets them return.

``backend`` runs a test once on SQLite + the local transport and once on PostgreSQL +
RabbitMQ; ``make_pipeline`` builds the in-process pipeline of pipeline.py on it. The store
helpers put a job into a given state the way the pipeline would (claim, then an outcome),
with times from the test's clock, so no test waits for a real lease or retry.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, TypeVar

import pytest

from jobrelay.domain.ids import request_hash
from jobrelay.domain.states import JobState
from jobrelay.exports.seed import seed
from jobrelay.library.operations import OperationContext, OperationResult, Registry
from jobrelay.runtime.wiring import Runtime
from jobrelay.storage.store import NewJob, Store
from jobrelay.worker.consumer import Worker
from tests.id_keys import request_id

from .pipeline import pipeline, settings_for
from .test_claims import ROWS, HandDelivery, body_of, events_of, job_state, submit
from .test_outcomes import Scripted, Step

T = TypeVar("T")
WORKER = "host-w:1:abcdef"
LEASE = timedelta(seconds=30)
TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"


@pytest.fixture(params=["sqlite-local", "postgres-rabbitmq"])
def backend(request: pytest.FixtureRequest) -> tuple[str, str]:
    if request.param == "sqlite-local":
        return request.getfixturevalue("sqlite_url"), "local"
    # The processes run least-privileged: a role with DML grants only, a vhost-limited user.
    return request.getfixturevalue("pg_app_url"), request.getfixturevalue("amqp_app_url")


@pytest.fixture
def make_pipeline(backend: tuple[str, str], tmp_path: Path) -> Any:
    database_url, broker_url = backend

    def build(**extra: Any) -> Any:
        settings = settings_for(database_url, broker_url, tmp_path / "exports", **extra)
        return pipeline(settings)

    return build


async def new_job(
    store: Store, period: str = "2020-05", account: str = "acme", **extra: Any
) -> NewJob:
    """What ``POST /v1/exports`` stores for this export, its id keyed as ``store`` keys it."""
    params = {"accountId": account, "period": period}
    return NewJob(
        job_id=await request_id(store, account, params),
        type="report.export",
        account_id=account,
        params=params,
        request_hash=request_hash(account, "report.export", params),
        max_attempts=3,
        **extra,
    )


async def job_in_state(
    store: Store, state: JobState, now: datetime, period: str = "2020-05", **extra: Any
) -> str:
    """A job moved to ``state`` through the same store calls the worker makes."""
    job_id, _ = await store.submit(await new_job(store, period, **extra), now)
    if state is JobState.QUEUED:
        return job_id
    if state is JobState.CANCELLED:
        assert (await store.get_job(job_id)) is not None
        from jobrelay.storage.admin import AdminQueries

        assert (await AdminQueries(store).cancel(job_id, actor="t", reason="t", now=now)).done
        return job_id
    claim = await store.claim_job(job_id, WORKER, now, LEASE)
    assert claim is not None and claim.attempt == 1
    if state is JobState.SUCCEEDED:
        key = f"exports/acme/{job_id}.csv"
        assert (await store.complete(claim, key, {"rows": 1}, now)).won
    elif state is JobState.RETRY_WAIT:
        assert (await store.schedule_retry(claim, "report.export", "boom", 5, now)).won
    elif state is JobState.QUARANTINED:
        assert await store.quarantine(job_id, "invalid period 2020-13", now, claim=claim)
    return job_id


async def kinds(rt: Runtime, job_id: str) -> list[str]:
    return [e.kind for e in await rt.store.events(job_id)]


async def eventually(
    check: Callable[[], Awaitable[T | None]], timeout: float = 20, what: str = "condition"
) -> T:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = await check()
        if value:
            return value
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


PERIODS = ("2020-01", "2020-02", "2020-03")


@dataclass
class HeldRuns:
    """Three jobs (one per ``PERIODS``) handed to one worker by hand, their runs under way."""

    rt: Runtime
    job_ids: list[str]
    deliveries: list[HandDelivery]
    runs: list[asyncio.Task[None]]
    operation: Scripted
    worker: Worker
    release: asyncio.Event  # set: the held runs return

    async def all_running(self) -> None:
        async def running() -> bool:
            states = [await job_state(self.rt, job_id) for job_id in self.job_ids]
            return states == [(JobState.RUNNING, 1)] * len(self.job_ids)

        await eventually(running, what="three claims")

    async def all_succeed(self) -> None:
        """Let them return: every job succeeds at attempt 1, acked, having lost no lease,
        and each ran once."""
        self.release.set()
        await asyncio.wait_for(asyncio.gather(*self.runs), timeout=60)
        for job_id, delivery in zip(self.job_ids, self.deliveries, strict=True):
            assert await job_state(self.rt, job_id) == (JobState.SUCCEEDED, 1)
            assert await events_of(self.rt, job_id, "lease_lost") == []
            assert delivery.outcomes == ["ack"]
        assert self.operation.runs == {period: 1 for period in PERIODS}


async def held_runs(
    rt: Runtime,
    returns: Callable[[OperationContext], OperationResult] = lambda ctx: OperationResult(
        None, {"rows": 0}
    ),
    steps: Mapping[str, Step] | None = None,
) -> HeldRuns:
    """Seed the ledger, submit the three jobs and hand them to one worker (``w-1``). Each
    run waits for ``release``, then gives ``returns(ctx)``; ``steps`` replaces the held
    step of the periods it names."""
    await seed(rt.engine, ROWS)
    job_ids = [await submit(rt, period=period) for period in PERIODS]
    release = asyncio.Event()

    async def held(ctx: OperationContext) -> OperationResult:
        await release.wait()
        return returns(ctx)

    operation = Scripted({period: held for period in PERIODS} | dict(steps or {}))
    worker = Worker(rt, registry=Registry([operation]), worker_id="w-1")
    deliveries = [HandDelivery(body_of(job_id)) for job_id in job_ids]
    runs = [asyncio.create_task(worker.handle(d)) for d in deliveries]
    return HeldRuns(rt, job_ids, deliveries, runs, operation, worker, release)
