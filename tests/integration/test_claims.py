"""Claims that cannot be stolen: the holes no crash test reaches (issue 9), in one process.

Each test drives the real Worker and the real store (SQLite and PostgreSQL) with deliveries
made by hand, so the race it is about happens at a chosen point instead of by chance:
two copies of one job in one worker process, a stale attempt finishing after the winner, a
bad copy racing a good one, a lease renewed while another delivery judged it expired,
worker clocks 30 s off the database's, a settle the broker never took, a drain deadline and
a job type only newer workers know. Subprocess versions (a worker frozen with SIGSTOP, a
PostgreSQL outage) are in tests/acceptance/test_claim_fencing.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from datetime import date, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any, TypeVar

import pytest
from sqlalchemy import insert, select, update

from jobrelay.domain.ids import request_hash
from jobrelay.domain.states import JobState
from jobrelay.domain.unknown_types import DEFERS_HEADER
from jobrelay.errors import StoreError
from jobrelay.exports.ledger import ledger_entries
from jobrelay.exports.seed import seed
from jobrelay.observe.faults import Faults
from jobrelay.runtime.wiring import Runtime
from jobrelay.storage.store import Claim, NewJob, Store
from jobrelay.storage.tables import jobs, outbox
from jobrelay.transport.base import Delivery
from jobrelay.worker.consumer import Worker
from tests.id_keys import request_id

from .api_fixtures import Clock, build_runtime

T = TypeVar("T")
ROWS = 20


class HandDelivery:
    """A delivery made by the test; ``taken`` is what the broker answers to a settle."""

    def __init__(
        self, body: bytes, *, headers: Mapping[str, object] | None = None, taken: bool = True
    ) -> None:
        self.body = body
        self.headers: Mapping[str, object] = dict(headers or {})
        self.redelivered = False
        self.delivery_count = 0
        self.taken = taken
        self.outcomes: list[str] = []

    async def ack(self) -> bool:
        self.outcomes.append("ack")
        return self.taken

    async def reject(self) -> bool:
        self.outcomes.append("reject")
        return self.taken

    def outcome_committed(self) -> None:
        return None  # no prefetch window of its own to free

    async def release(self) -> None:
        self.outcomes.append("release")


def runtime_for(database_url: str, tmp_path: Path, *, faults: str = "", **settings: Any) -> Runtime:
    rt = build_runtime(database_url, tmp_path, faults=Faults(faults), clock=Clock())
    return dataclasses.replace(rt, settings=rt.settings.model_copy(update=settings))


@pytest.fixture
async def rt(database_url: str, tmp_path: Path) -> AsyncIterator[Runtime]:
    runtime = runtime_for(database_url, tmp_path)
    await seed(runtime.engine, ROWS)
    yield runtime
    await runtime.engine.dispose()


def clock_of(rt: Runtime) -> Clock:
    assert isinstance(rt.clock, Clock)
    return rt.clock


async def submit(rt: Runtime, job_type: str = "report.export", period: str = "2020-05") -> str:
    params = {"accountId": "acme", "period": period}
    job = NewJob(
        job_id=await request_id(rt.store, "acme", params, job_type=job_type),
        type=job_type,
        account_id="acme",
        params=params,
        request_hash=request_hash("acme", job_type, params),
        max_attempts=rt.settings.max_attempts,
    )
    job_id, _ = await rt.store.submit(job, rt.clock())
    return job_id


def body_of(job_id: str, job_type: str = "report.export", version: int = 1) -> bytes:
    return json.dumps({"jobId": job_id, "type": job_type, "version": version}).encode()


async def kinds(rt: Runtime, job_id: str) -> list[str]:
    return [e.kind for e in await rt.store.events(job_id)]


async def events_of(rt: Runtime, job_id: str, kind: str) -> list[dict[str, Any]]:
    return [e.detail for e in await rt.store.events(job_id) if e.kind == kind]


async def eventually(check: Callable[[], Awaitable[T | None]], what: str, timeout: float = 20) -> T:
    """Poll ``check`` until it returns something truthy (no fixed sleeps)."""
    async with asyncio.timeout(timeout):
        while True:
            if value := await check():
                return value
            await asyncio.sleep(0.02)


async def job_state(rt: Runtime, job_id: str) -> tuple[JobState, int]:
    job = await rt.store.get_job(job_id)
    assert job is not None
    return job.state, job.attempt


def served_file(rt: Runtime, key: str) -> bytes:
    root = Path(rt.settings.results_url.removeprefix("file://"))
    return (root / key).read_bytes()


# --- 1. one claim, one token ------------------------------------------------------------


async def test_two_copies_in_one_process_only_the_newest_claim_saves_its_result(
    database_url: str, tmp_path: Path
) -> None:
    """Two copies of one job under ONE worker id, the renewals failing: the lease lapses,
    the second copy claims again. The first run finishes first, but its claim was
    superseded: it must record ``lease_lost``, not ``result_saved``. (Two handlers: in one
    handler the second copy, a suspect, would wait for the first run to end,
    ``worker.isolation``; the fence is on the attempt, not only the owner.)"""
    rt = runtime_for(database_url, tmp_path, faults="export.run:stall:0.5:1,export.run:stall:1.5:2")
    await seed(rt.engine, ROWS)
    job_id = await submit(rt)
    worker = Worker(rt, worker_id="host:1:shared")

    async def failing_renewal(*args: Any, **kwargs: Any) -> set[Claim]:
        raise StoreError("database write failed: lease renewal made to fail")

    rt.store.renew_leases = failing_renewal  # type: ignore[method-assign]
    first, second = HandDelivery(body_of(job_id)), HandDelivery(body_of(job_id))
    run_first = asyncio.create_task(worker.handle(first))
    await eventually(lambda: _in_state(rt, job_id, JobState.RUNNING, 1), "first claim")
    clock_of(rt).advance(rt.settings.lease_seconds + 1)  # the lease lapsed by the store clock
    again = Worker(rt, worker_id="host:1:shared")
    run_second = asyncio.create_task(again.handle(second))
    await asyncio.gather(run_first, run_second)

    job = await rt.store.get_job(job_id)
    assert job is not None and job.state is JobState.SUCCEEDED and job.attempt == 2
    saved = await events_of(rt, job_id, "result_saved")
    assert [s["attempt"] for s in saved] == [2]
    lost = await events_of(rt, job_id, "lease_lost")
    assert [(e["attempt"], e["currentAttempt"]) for e in lost] == [(1, 2)]
    assert first.outcomes == ["ack"] and second.outcomes == ["ack"]
    # The attempt is the event's (above), never mixed into the operation's own meta.
    assert job.result_meta is not None and "attempt" not in job.result_meta
    await rt.engine.dispose()


async def _in_state(rt: Runtime, job_id: str, state: JobState, attempt: int) -> bool:
    return await job_state(rt, job_id) == (state, attempt)


async def test_a_lost_lease_stops_the_run(database_url: str, tmp_path: Path) -> None:
    """Another claim took the job over while this run stalls: the next renewal finds the
    lease gone and cancels the operation, instead of letting it run on for ten minutes."""
    rt = runtime_for(database_url, tmp_path, faults="export.run:stall:600:1", lease_seconds=1.5)
    await seed(rt.engine, ROWS)
    job_id = await submit(rt)
    stalled = HandDelivery(body_of(job_id))
    run = asyncio.create_task(Worker(rt, worker_id="w-slow").handle(stalled))
    await eventually(lambda: _in_state(rt, job_id, JobState.RUNNING, 1), "first claim")
    clock_of(rt).advance(2)
    await Worker(rt, worker_id="w-new").handle(HandDelivery(body_of(job_id)))
    assert await job_state(rt, job_id) == (JobState.SUCCEEDED, 2)

    # A 600 s stall ends only because the lease renewer cancelled it.
    await asyncio.wait_for(run, timeout=30)
    lost = await events_of(rt, job_id, "lease_lost")
    assert [(e["attempt"], e["currentAttempt"]) for e in lost] == [(1, 2)]
    assert stalled.outcomes == ["ack"]
    assert [s["attempt"] for s in await events_of(rt, job_id, "result_saved")] == [2]
    await rt.engine.dispose()


async def test_a_stale_attempt_never_replaces_the_winning_object(
    database_url: str, tmp_path: Path
) -> None:
    """The zombie, in one process: attempt 1 stalls past its lease, attempt 2 completes, the
    ledger changes, then attempt 1 wakes and writes a different CSV. The object served at the
    result key must stay the one whose size and sha256 the job recorded."""
    rt = runtime_for(database_url, tmp_path, faults="export.run:stall:1:1")
    await seed(rt.engine, ROWS)
    job_id = await submit(rt)
    zombie = HandDelivery(body_of(job_id))
    run = asyncio.create_task(Worker(rt, worker_id="w-zombie").handle(zombie))
    await eventually(lambda: _in_state(rt, job_id, JobState.RUNNING, 1), "first claim")
    clock_of(rt).advance(rt.settings.lease_seconds + 1)
    await Worker(rt, worker_id="w-winner").handle(HandDelivery(body_of(job_id)))
    async with rt.engine.begin() as conn:
        await conn.execute(
            insert(ledger_entries).values(
                account_id="acme",
                period="2020-05",
                booked_on=date(2020, 5, 31),
                description="late entry the winner never saw",
                counterparty="zombie ltd",
                amount=Decimal("1.00"),
                currency="EUR",
            )
        )
    await asyncio.wait_for(run, timeout=30)

    job = await rt.store.get_job(job_id)
    assert job is not None and job.state is JobState.SUCCEEDED and job.attempt == 2
    assert job.result_key is not None and job.result_meta is not None
    served = served_file(rt, job.result_key)
    assert len(served) == job.result_meta["bytes"]
    assert hashlib.sha256(served).hexdigest() == job.result_meta["sha256"]
    assert b"late entry" not in served
    assert len(await events_of(rt, job_id, "result_saved")) == 1
    assert [e["attempt"] for e in await events_of(rt, job_id, "lease_lost")] == [1]
    leftovers = list(served_file_dir(rt, job.result_key).glob(".*.tmp"))
    assert leftovers == [], "the stale attempt's staged bytes were not discarded"
    await rt.engine.dispose()


def served_file_dir(rt: Runtime, key: str) -> Path:
    root = Path(rt.settings.results_url.removeprefix("file://"))
    return (root / key).parent


# --- 2. guards equal observations --------------------------------------------------------


async def test_a_bad_copy_never_quarantines_a_job_a_good_copy_claimed_since(
    rt: Runtime,
) -> None:
    """The bad copy reads the job while ``queued`` and decides to quarantine it; before its
    write, a good copy claims the job. The quarantine must lose, the bad copy is rejected."""
    job_id = await submit(rt)
    real_quarantine = rt.store.quarantine

    async def claimed_first(*args: Any, **kwargs: Any) -> bool:
        assert await rt.store.claim_job(job_id, "w-good", rt.clock(), timedelta(seconds=30))
        return await real_quarantine(*args, **kwargs)

    rt.store.quarantine = claimed_first  # type: ignore[method-assign]
    bad = HandDelivery(
        json.dumps({"jobId": job_id, "type": "report.export", "version": 1, "x": 1}).encode()
    )
    await Worker(rt, worker_id="w-bad").handle(bad)

    assert await job_state(rt, job_id) == (JobState.RUNNING, 1)
    assert "quarantined" not in await kinds(rt, job_id)
    assert bad.outcomes == ["reject"]


async def test_exhausted_attempts_are_rechecked_against_the_lease_that_was_seen(
    rt: Runtime,
) -> None:
    """All attempts claimed, the last one's lease looks expired to a new delivery, which
    decides "attempts exhausted". Before it writes, the owner's heartbeat renews the lease:
    the owner is alive, so the job must not be quarantined under it."""
    job_id = await submit(rt)
    lease = timedelta(seconds=30)
    for i in range(rt.settings.max_attempts):
        assert await rt.store.claim_job(job_id, f"w{i}", rt.clock(), lease)
        clock_of(rt).advance(31)
    real_quarantine = rt.store.quarantine

    async def renewed_first(*args: Any, **kwargs: Any) -> bool:
        async with rt.engine.begin() as conn:
            await conn.execute(
                update(jobs).where(jobs.c.id == job_id).values(lease_expires_at=rt.clock() + lease)
            )
        return await real_quarantine(*args, **kwargs)

    rt.store.quarantine = renewed_first  # type: ignore[method-assign]
    copy = HandDelivery(body_of(job_id))
    await Worker(rt, worker_id="w-late").handle(copy)

    state, attempt = await job_state(rt, job_id)
    assert (state, attempt) == (JobState.RUNNING, rt.settings.max_attempts)
    assert "quarantined" not in await kinds(rt, job_id)
    assert "deferred" in await kinds(rt, job_id)  # re-read: a live lease, checked again later
    assert copy.outcomes == ["ack"]


# --- 3. one clock -------------------------------------------------------------------------


@pytest.mark.parametrize("skew", [-30, 30], ids=["worker-behind", "worker-ahead"])
async def test_worker_clock_skew_changes_no_judgement(
    database_url: str, tmp_path: Path, skew: int
) -> None:
    """The store judges by the database's clock (PostgreSQL ``now()``; on SQLite the one
    process's clock). A worker whose clock is 30 s off still runs a due retry and still
    respects a live lease."""
    base = runtime_for(database_url, tmp_path)
    store = Store(base.engine)  # no injected clock: the database's own
    rt = dataclasses.replace(
        base, store=store, clock=lambda: store.local_now() + timedelta(seconds=skew)
    )
    await seed(store.engine, ROWS)
    due_job = await submit(rt, period="2020-05")
    held_job = await submit(rt, period="2020-06")
    db_now = await store.db_now()
    async with rt.engine.begin() as conn:
        # A retry due 5 s ago, and a lease another worker holds for 20 s more, by the database.
        await conn.execute(
            update(jobs)
            .where(jobs.c.id == due_job)
            .values(state="retry_wait", attempt=1, next_attempt_at=db_now - timedelta(seconds=5))
        )
        await conn.execute(
            update(jobs)
            .where(jobs.c.id == held_job)
            .values(
                state="running",
                attempt=1,
                lease_owner="w-other",
                lease_expires_at=db_now + timedelta(seconds=20),
            )
        )
    worker = Worker(rt, worker_id="w-skewed")
    await worker.handle(HandDelivery(body_of(due_job)))
    await worker.handle(HandDelivery(body_of(held_job)))

    assert await job_state(rt, due_job) == (JobState.SUCCEEDED, 2)
    assert "duplicate_acked" not in await kinds(rt, due_job)
    assert await job_state(rt, held_job) == (JobState.RUNNING, 1)
    held = await rt.store.get_job(held_job)
    assert held is not None and held.lease_owner == "w-other"
    assert "deferred" in await kinds(rt, held_job)
    await rt.engine.dispose()


# --- 4. settles and the drain ---------------------------------------------------------------


async def test_a_settle_the_broker_did_not_take_is_recorded_as_settle_lost(rt: Runtime) -> None:
    job_id = await submit(rt)
    delivery = HandDelivery(body_of(job_id), taken=False)
    await Worker(rt).handle(delivery)
    assert await job_state(rt, job_id) == (JobState.SUCCEEDED, 1)
    timeline = await kinds(rt, job_id)
    assert timeline[-1] == "settle_lost" and "ack_sent" not in timeline
    assert (await events_of(rt, job_id, "settle_lost"))[0]["action"] == "ack_sent"
    # The redelivery the broker makes is then a duplicate of the committed outcome.
    again = HandDelivery(body_of(job_id))
    await Worker(rt).handle(again)
    assert again.outcomes == ["ack"]
    assert (await kinds(rt, job_id))[-2:] == ["duplicate_acked", "ack_sent"]


class OneShotTransport:
    """Hands out the given deliveries, then waits; enough for ``Worker.run``."""

    def __init__(self, deliveries: list[Delivery]) -> None:
        self._deliveries = deliveries

    async def consume(
        self, prefetch: int, queue: str = "default", *, keep_in_flight: bool = False
    ) -> AsyncIterator[Delivery]:
        for delivery in self._deliveries:
            yield delivery
        await asyncio.Event().wait()


async def test_sigterm_drains_for_drain_seconds_then_stops_without_settling(
    database_url: str, tmp_path: Path
) -> None:
    rt = runtime_for(
        database_url, tmp_path, faults="export.run:stall:600", drain_seconds=0.5, lease_seconds=30
    )
    await seed(rt.engine, ROWS)
    job_id = await submit(rt)
    delivery = HandDelivery(body_of(job_id))
    rt = dataclasses.replace(rt, transport=OneShotTransport([delivery]))  # type: ignore[arg-type]
    stop = asyncio.Event()
    running = asyncio.create_task(Worker(rt).run(stop))
    await eventually(lambda: _in_state(rt, job_id, JobState.RUNNING, 1), "claim")
    stop.set()
    await asyncio.wait_for(running, timeout=30)  # not the 600 s of the stalled export
    assert delivery.outcomes == [], "what the drain deadline cut off must stay unsettled"
    timeline = await kinds(rt, job_id)
    assert "ack_sent" not in timeline and "result_saved" not in timeline
    await rt.engine.dispose()


# --- 5. rolling deploys -----------------------------------------------------------------------


async def test_a_type_only_newer_workers_know_is_deferred_not_quarantined(rt: Runtime) -> None:
    job_id = await submit(rt, job_type="images.resize")
    delivery = HandDelivery(body_of(job_id, "images.resize"), headers={"traceparent": "t"})
    await Worker(rt).handle(delivery)

    assert await job_state(rt, job_id) == (JobState.QUEUED, 0)
    assert delivery.outcomes == ["ack"]
    deferred = await events_of(rt, job_id, "deferred")
    assert len(deferred) == 1 and "images.resize" in deferred[0]["reason"]
    rows = await _outbox_rows(rt, job_id)
    assert len(rows) == 2  # the first work message and the deferral
    assert rows[-1].destination.startswith("retry.")
    assert rows[-1].body == body_of(job_id, "images.resize").decode()
    assert rows[-1].headers[DEFERS_HEADER] == "1"


async def test_a_version_only_newer_workers_know_is_deferred(rt: Runtime) -> None:
    job_id = await submit(rt)
    delivery = HandDelivery(body_of(job_id, version=2))
    await Worker(rt).handle(delivery)
    assert await job_state(rt, job_id) == (JobState.QUEUED, 0)
    assert delivery.outcomes == ["ack"]
    assert (
        "unsupported message version: 2" in (await events_of(rt, job_id, "deferred"))[0]["reason"]
    )


async def test_an_unknown_type_is_quarantined_once_deferrals_reach_the_delivery_limit(
    rt: Runtime,
) -> None:
    job_id = await submit(rt, job_type="images.resize")
    limit = rt.settings.delivery_limit
    delivery = HandDelivery(body_of(job_id, "images.resize"), headers={DEFERS_HEADER: str(limit)})
    await Worker(rt).handle(delivery)
    job = await rt.store.get_job(job_id)
    assert job is not None and job.state is JobState.QUARANTINED
    assert job.quarantine_reason is not None and "no worker knew it" in job.quarantine_reason
    assert delivery.outcomes == ["reject"]


async def test_an_unknown_type_without_a_job_row_is_still_rejected(rt: Runtime) -> None:
    ghost = await request_id(rt.store, "acme", {"n": 1}, job_type="images.resize")
    delivery = HandDelivery(body_of(ghost, "images.resize"))
    await Worker(rt).handle(delivery)
    assert delivery.outcomes == ["reject"]
    assert await rt.store.get_job(ghost) is None


async def _outbox_rows(rt: Runtime, job_id: str) -> list[Any]:
    async with rt.engine.connect() as conn:
        return list(
            (
                await conn.execute(
                    select(outbox).where(outbox.c.job_id == job_id).order_by(outbox.c.id)
                )
            ).all()
        )
