"""The worker's outcome path: nothing stuck, nothing charged to a neighbour (issue 21).

A job whose outcome the database refuses (a ``Decimal`` in its meta, a key not UTF-8, a
NUL byte in its result key or error message) fails alone, once, with a reason, beside a
healthy job that shares its batch; a claim whose answer was lost is run, not deferred; the
lease is renewed until the outcome commits; a delivery given back after an error says why on
the job's timeline. The pipeline tests run on SQLite + the local transport and on PostgreSQL
+ RabbitMQ (batching on); the hand-driven ones on SQLite and PostgreSQL.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from datetime import timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import event

from jobrelay.domain.states import JobState
from jobrelay.errors import Permanent, Retry, StoreError
from jobrelay.exports.seed import seed
from jobrelay.library.operations import Operation, OperationContext, OperationResult, Registry
from jobrelay.maintenance.reconcile import LEASE_EXPIRED, Reconciler
from jobrelay.runtime.wiring import build_transport
from jobrelay.storage.records import JobRecord
from jobrelay.worker.consumer import Worker

from .pipeline import Pipeline
from .test_claims import (
    ROWS,
    HandDelivery,
    body_of,
    clock_of,
    events_of,
    eventually,
    kinds,
    runtime_for,
    submit,
)

Step = Callable[[OperationContext], Awaitable[OperationResult]]


class Scripted:
    """``report.export`` doing what the test says for each period; counts its runs."""

    type = "report.export"

    def __init__(self, steps: Mapping[str, Step]) -> None:
        self.steps = steps
        self.runs: Counter[str] = Counter()

    def validate(self, params: Mapping[str, Any]) -> None:
        return None

    async def run(self, ctx: OperationContext) -> OperationResult:
        period = str(ctx.job.params["period"])
        self.runs[period] += 1
        return await self.steps[period](ctx)


def together(barrier: asyncio.Barrier, result: OperationResult | Exception) -> Step:
    """A first attempt that ends together with the others (one batch of completions)."""

    async def step(ctx: OperationContext) -> OperationResult:
        if ctx.attempt == 1:
            await barrier.wait()
        if isinstance(result, Exception):
            raise result
        return result

    return step


async def start_worker(p: Pipeline, operation: Operation, **settings: Any) -> Worker:
    """``Pipeline.start_worker`` with the test's operation in place of the shipped one (and
    ``settings`` changed, if given)."""
    rt = dataclasses.replace(p.rt, settings=p.rt.settings.model_copy(update=settings))
    transport = build_transport(rt.settings, rt.engine, rt.clock)
    await transport.connect()
    p.worker_transports.append(transport)
    worker = Worker(dataclasses.replace(rt, transport=transport), registry=Registry([operation]))
    p._start(worker.run, p.workers)
    return worker


def count_failing_statements(p: Pipeline) -> Callable[[], Counter[str]]:
    """Every statement the database (or the driver) refused so far: from the engine's own
    hook, and from the raw asyncpg connections the worker and relay hold on PostgreSQL."""
    failures: Counter[str] = Counter()

    def on_error(context: Any) -> None:
        failures[type(context.original_exception).__name__] += 1

    event.listen(p.rt.engine.sync_engine, "handle_error", on_error)
    hot_failures = getattr(p.rt.store.driver.hot, "failures", Counter())
    return lambda: failures + hot_failures


def on_the_hot_path(p: Pipeline) -> bool:
    """The worker's batched statements went over its held connections: asyncpg's on
    PostgreSQL, its ``sqlite3`` one on a SQLite file."""
    return bool(p.rt.store.driver.hot.sent > 0)


def finished(job: JobRecord) -> bool:
    return job.state.is_terminal


async def test_a_job_whose_outcome_cannot_be_stored_fails_alone_beside_a_healthy_one(
    make_pipeline: Any,
) -> None:
    """Three first attempts end together (one batch on PostgreSQL): a healthy one, one whose
    meta holds a Decimal (not JSON) and one whose result key is not UTF-8 (a lone surrogate).
    The healthy one succeeds at attempt 1; each other is quarantined at attempt 1 saying why,
    its function run once. Old code: the batch failed as a whole, the healthy job was
    released and quarantined after three claims ("worker lost before an outcome")."""
    async with make_pipeline() as p:
        healthy = await p.submit(period="2020-01")
        decimal = await p.submit(period="2020-02")
        unencodable = await p.submit(period="2020-03")
        barrier = asyncio.Barrier(3)
        operation = Scripted(
            {
                "2020-01": together(barrier, OperationResult("exports/ok.csv", {"rows": 1})),
                "2020-02": together(
                    barrier, OperationResult("exports/d.csv", {"rows": 1, "fee": Decimal("1.5")})
                ),
                # A lone surrogate: a Python str no UTF-8 database can hold (refused while
                # the batch statement is bound, not by the per-job checks).
                "2020-03": together(barrier, OperationResult("exports/\ud800.csv", {"rows": 1})),
            }
        )
        p.start_relay()
        await start_worker(p, operation)
        ok = await p.wait_for(healthy, finished)
        refused = await p.wait_for(decimal, finished)
        refused_key = await p.wait_for(unencodable, finished)

        assert (ok.state, ok.attempt, ok.result_key) == (JobState.SUCCEEDED, 1, "exports/ok.csv")
        assert (refused.state, refused.attempt) == (JobState.QUARANTINED, 1)
        assert "Decimal" in (refused.quarantine_reason or "")
        assert (refused_key.state, refused_key.attempt) == (JobState.QUARANTINED, 1)
        assert "could not be stored" in (refused_key.quarantine_reason or "")
        assert operation.runs == {"2020-01": 1, "2020-02": 1, "2020-03": 1}
        assert (await p.kinds(healthy)).count("claimed") == 1
        assert on_the_hot_path(p)


@pytest.mark.parametrize("backend", ["sqlite-local"], indirect=True)
async def test_on_sqlite_an_unstorable_completion_fails_alone_in_its_batch(
    make_pipeline: Any,
) -> None:
    """Issue 23 item 6: SQLite batches completions too (one write transaction), and a batch
    holding one completion the driver refuses (a result key with a lone surrogate: past the
    per-job checks, refused while bound) is sent again job by job: the unstorable one is
    quarantined at attempt 1, its two neighbours succeed at attempt 1, each run once. Old
    code: no batcher on SQLite (a completion per transaction); with the batcher but no
    ``alone_on``, the whole batch fails and the neighbours are released and run again."""
    async with make_pipeline() as p:
        left = await p.submit(period="2020-01")
        bad = await p.submit(period="2020-02")
        right = await p.submit(period="2020-03")
        barrier = asyncio.Barrier(3)
        operation = Scripted(
            {
                "2020-01": together(barrier, OperationResult("exports/l.csv", {"rows": 1})),
                "2020-02": together(barrier, OperationResult("exports/\ud800.csv", {"rows": 1})),
                "2020-03": together(barrier, OperationResult("exports/r.csv", {"rows": 1})),
            }
        )
        p.start_relay()
        worker = await start_worker(p, operation)
        jobs = [await p.wait_for(job_id, finished) for job_id in (left, bad, right)]

        assert [(j.state, j.attempt) for j in jobs] == [
            (JobState.SUCCEEDED, 1),
            (JobState.QUARANTINED, 1),
            (JobState.SUCCEEDED, 1),
        ]
        assert "could not be stored" in (jobs[1].quarantine_reason or "")
        assert operation.runs == {"2020-01": 1, "2020-02": 1, "2020-03": 1}
        turns = worker.deliveries.scope.turns
        # The three went as one turn first (refused whole), then each alone.
        assert turns.batches >= 4
        for job_id in (left, right):
            assert (await p.kinds(job_id)).count("claimed") == 1
            assert (await p.kinds(job_id)).count("result_saved") == 1
        assert on_the_hot_path(p)  # the held sqlite3 connection, one hand-off a batch


def staged(barrier: asyncio.Barrier, key: str) -> Step:
    """A first attempt that writes a staged result (as ``report.export`` does) and ends
    together with the others."""

    async def step(ctx: OperationContext) -> OperationResult:
        async with ctx.results.writer(key) as writer:
            await writer.write(f"{ctx.job.id}\n".encode())
        await barrier.wait()
        return OperationResult(key, {"rows": 1})

    return step


async def test_completions_that_publish_a_staged_result_share_a_batch(
    make_pipeline: Any,
) -> None:
    """Issue 35: a job that stages its result (the flagship ``report.export``) completes on the
    batched path too: three such completions ending together share their statement, each
    result published inside it. Old code: a staged result always took the per-job completion
    (the batcher saw none of them: 0 batches)."""
    async with make_pipeline() as p:
        periods = ("2020-01", "2020-02", "2020-03")
        ids = [await p.submit(period=period) for period in periods]
        barrier = asyncio.Barrier(3)
        operation = Scripted({m: staged(barrier, f"exports/{m}.csv") for m in periods})
        turns = count_turns(p)
        p.start_relay()
        await start_worker(p, operation)
        jobs = [await p.wait_for(job_id, finished) for job_id in ids]

        await each_published_its_own_file(p, jobs)
        staged_per_turn = [n for _, n in turns if n]
        assert sum(staged_per_turn) == 3 and len(staged_per_turn) < 3
        assert on_the_hot_path(p)


async def test_the_next_claim_rides_in_the_transaction_that_publishes_a_result(
    make_pipeline: Any,
) -> None:
    """Issue 41 item 4: a job that stages its result (``report.export``) lends its slot once
    its code returns, like any other success, and the claim made in that slot goes in the
    write transaction that publishes the result and commits the success: one commit for
    both. One slot, six such jobs: each ends succeeded at attempt 1 with its file, at most
    one of them ever ``running`` at once, and a claim shares a turn with a publishing
    completion. Old code: that completion had a batcher and a transaction of its own, the
    claim waited for its commit and then took a commit of its own (no such turn)."""
    async with make_pipeline() as p:
        periods = [f"2020-0{m}" for m in range(1, 7)]
        ids = [await p.submit(period=period) for period in periods]
        running: list[int] = []

        def alone(key: str) -> Step:
            async def step(ctx: OperationContext) -> OperationResult:
                running.append(len(await p.rt.store.list_jobs(state=JobState.RUNNING)))
                async with ctx.results.writer(key) as writer:
                    await writer.write(f"{ctx.job.id}\n".encode())
                return OperationResult(key, {"rows": 1})

            return step

        operation = Scripted({m: alone(f"exports/{m}.csv") for m in periods})
        turns = count_turns(p)
        p.start_relay()
        await start_worker(p, operation, concurrency=1, prefetch=8)
        jobs = [await p.wait_for(job_id, finished) for job_id in ids]

        await each_published_its_own_file(p, jobs)
        assert running == [1] * 6
        assert any(claims and staged for claims, staged in turns), turns
        assert on_the_hot_path(p)


async def each_published_its_own_file(p: Pipeline, jobs: list[JobRecord]) -> None:
    """Every job succeeded at its first attempt, its result the file its run wrote."""
    assert [(j.state, j.attempt) for j in jobs] == [(JobState.SUCCEEDED, 1)] * len(jobs)
    for job in jobs:
        assert job.result_key is not None
        chunks = [chunk async for chunk in p.rt.results.read(job.result_key)]
        assert b"".join(chunks) == f"{job.id}\n".encode()


def count_turns(p: Any) -> list[tuple[int, int]]:
    """Each turn the worker's store is sent, as it is sent: (its claims, its completions
    with a step of their own)."""
    sent: list[tuple[int, int]] = []
    turn = p.rt.store.turn

    async def counted(claims: Any, completions: Any, *args: Any) -> Any:
        sent.append((len(claims), sum(r.in_transaction for r in completions)))
        return await turn(claims, completions, *args)

    p.rt.store.turn = counted
    return sent


async def test_a_nul_byte_ends_its_job_with_a_reason_and_never_loops(make_pipeline: Any) -> None:
    """A result key with a NUL byte (PostgreSQL's text refuses it), a Permanent and a Retry
    whose messages hold one, beside a healthy job. Each ends with a reason (the messages
    kept, their NUL escaped), the healthy one at attempt 1, and the database refuses at most
    a few statements. Old code: a hot loop of thousands of failing statements, the job
    ``running`` for good and its batch neighbour held with it."""
    async with make_pipeline() as p:
        failing = count_failing_statements(p)
        healthy = await p.submit(period="2020-01")
        bad_key = await p.submit(period="2020-02")
        bad_reason = await p.submit(period="2020-03")
        bad_retry = await p.submit(period="2020-04")
        barrier = asyncio.Barrier(4)

        async def retry_then_succeed(ctx: OperationContext) -> OperationResult:
            if ctx.attempt == 1:
                await barrier.wait()
                raise Retry("flaky \x00 service")
            return OperationResult("exports/r.csv", {"rows": 1})

        operation = Scripted(
            {
                "2020-01": together(barrier, OperationResult("exports/ok.csv", {"rows": 1})),
                "2020-02": together(barrier, OperationResult("exports/a\x00b.csv", {"rows": 1})),
                "2020-03": together(barrier, Permanent("bad \x00 input")),
                "2020-04": retry_then_succeed,
            }
        )
        p.start_relay()
        await start_worker(p, operation)
        ok = await p.wait_for(healthy, finished)
        key = await p.wait_for(bad_key, finished)
        reason = await p.wait_for(bad_reason, finished)
        retried = await p.wait_for(bad_retry, finished)

        assert (ok.state, ok.attempt) == (JobState.SUCCEEDED, 1)
        assert (key.state, key.attempt) == (JobState.QUARANTINED, 1)
        assert "NUL" in (key.quarantine_reason or "")
        assert (reason.state, reason.attempt) == (JobState.QUARANTINED, 1)
        assert reason.quarantine_reason == "bad \\x00 input"
        assert (retried.state, retried.attempt) == (JobState.SUCCEEDED, 2)
        [scheduled] = [e for e in await p.rt.store.events(bad_retry) if e.kind == "retry_scheduled"]
        assert scheduled.detail["error"] == "flaky \\x00 service"
        assert operation.runs == {"2020-01": 1, "2020-02": 1, "2020-03": 1, "2020-04": 2}
        assert sum(failing().values()) <= 2, failing()
        assert on_the_hot_path(p)


async def test_a_claim_whose_answer_was_lost_runs_its_job(make_pipeline: Any) -> None:
    """The claim commits, then its answer is lost (``claim.after_commit:drop:1``), with
    ``max_attempts=1``: the retried claim finds the worker's own claim and runs it. Old code:
    it lost to its own live lease, deferred, and the job was quarantined unrun."""
    async with make_pipeline(faults="claim.after_commit:drop:1", max_attempts="1") as p:
        job_id = await p.submit(period="2020-01")

        async def ok(ctx: OperationContext) -> OperationResult:
            return OperationResult("exports/ok.csv", {"rows": 1})

        operation = Scripted({"2020-01": ok})
        p.start_relay()
        await start_worker(p, operation)
        job = await p.wait_for(job_id, finished)

        assert (job.state, job.attempt) == (JobState.SUCCEEDED, 1)
        assert operation.runs == {"2020-01": 1}
        timeline = await p.kinds(job_id)
        assert timeline.count("claimed") == 1 and "deferred" not in timeline


async def test_the_lease_is_renewed_until_the_outcome_commits(
    database_url: str, tmp_path: Path
) -> None:
    """The result is computed, then its write fails (the database refuses that statement,
    answers the rest) for longer than lease + grace by the store's clock. The renewer keeps
    renewing, so the reconciler finds no expired lease; once the write goes through the job
    has succeeded at attempt 1 with the result computed. Old code: the heartbeat stopped when
    the operation returned, the lease lapsed and the reconciler re-queued the job."""
    rt = runtime_for(database_url, tmp_path, lease_seconds=1.5, reconcile_grace_seconds=1.0)
    await seed(rt.engine, ROWS)
    job_id = await submit(rt)
    store: Any = rt.store
    held = True
    refused = 0
    renewed = 0

    def failing_while_held(write: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
        async def attempt(*args: Any, **kwargs: Any) -> Any:
            nonlocal refused
            if held:
                refused += 1
                raise StoreError("database write failed: held by the test")
            return await write(*args, **kwargs)

        return attempt

    store.complete = failing_while_held(store.complete)
    store.complete_many = failing_while_held(store.complete_many)
    renew = store.renew_leases

    async def counted_renewal(*args: Any, **kwargs: Any) -> set[Any]:
        nonlocal renewed
        won: set[Any] = await renew(*args, **kwargs)
        renewed += len(won)
        return won

    store.renew_leases = counted_renewal

    async def until(check: Callable[[], bool]) -> None:
        async def checked() -> bool:
            return check()

        await eventually(checked, "the condition")

    connections = contextlib.AsyncExitStack()  # on PostgreSQL, as a running worker holds them
    await connections.enter_async_context(rt.store.hot_connections())
    run = asyncio.create_task(Worker(rt, worker_id="w-1").handle(HandDelivery(body_of(job_id))))
    await until(lambda: refused >= 1)
    for _ in range(3):  # 4.5 s of store time: past the lease (1.5 s) + grace (1 s)
        seen = renewed
        clock_of(rt).advance(1.5)
        await until(lambda seen=seen: renewed > seen)  # a renewal after the clock moved on
    report = await Reconciler(rt).run_once(scan_quarantine=False)
    assert [f.kind for f in report.findings if f.kind == LEASE_EXPIRED] == []
    held = False
    await asyncio.wait_for(run, timeout=30)

    job = await rt.store.get_job(job_id)
    assert job is not None and (job.state, job.attempt) == (JobState.SUCCEEDED, 1)
    assert [e["attempt"] for e in await events_of(rt, job_id, "result_saved")] == [1]
    timeline = await kinds(rt, job_id)
    assert "lease_lost" not in timeline and "retry_scheduled" not in timeline
    await connections.aclose()
    await rt.engine.dispose()


class AckFails(HandDelivery):
    async def ack(self) -> bool:
        self.outcomes.append("ack")
        raise RuntimeError("channel exploded")


async def test_a_release_after_an_error_says_why_on_the_timeline(
    database_url: str, tmp_path: Path
) -> None:
    """An error escapes the handling (here the ack itself fails): the delivery goes back to
    the broker and the job's timeline says so, with the reason. Old code: no event."""
    rt = runtime_for(database_url, tmp_path)
    await seed(rt.engine, ROWS)
    job_id = await submit(rt)
    delivery = AckFails(body_of(job_id))
    await Worker(rt, worker_id="w-1")._handle_safely(delivery)

    assert delivery.outcomes == ["ack", "release"]
    [released] = await events_of(rt, job_id, "released")
    assert released["reason"] == "RuntimeError: channel exploded"
    assert released["worker"] == "w-1"
    await rt.engine.dispose()


async def test_a_release_that_the_broker_dead_letters_says_so_on_the_timeline(
    database_url: str, tmp_path: Path
) -> None:
    """On RabbitMQ the delivery-limit backstop is silent: the release of a delivery already
    returned ``delivery_limit`` times is the one the broker dead-letters (BROKER-FACTS: limit
    5, dead-lettered at the nack of the 6th delivery), so the worker writes ``dead_lettered``
    with it. One return fewer writes only ``released``. Old code: no event."""
    rt = runtime_for(
        database_url, tmp_path, broker_url="amqp://guest:guest@127.0.0.1:5672/", delivery_limit=2
    )
    await seed(rt.engine, ROWS)
    job_id = await submit(rt)
    for count in (1, 2):
        delivery = AckFails(body_of(job_id))
        delivery.delivery_count = count
        await Worker(rt, worker_id="w-1")._handle_safely(delivery)

    assert [e["deliveryCount"] for e in await events_of(rt, job_id, "released")] == [1, 2]
    [dead] = await events_of(rt, job_id, "dead_lettered")
    assert (dead["deliveries"], dead["limit"]) == (3, 2)
    assert "delivery limit of 2 reached" in dead["reason"]
    await rt.engine.dispose()


async def test_the_local_transport_records_the_dead_letter_it_makes(
    database_url: str, tmp_path: Path
) -> None:
    """The local transport's claim moves a row handed out more than the limit to the
    quarantine queue; the same transaction writes ``dead_lettered`` on the job it names (and
    nothing for a body that names no job). Old code: the job's timeline said nothing."""
    from jobrelay.storage import local_queue as q

    rt = runtime_for(database_url, tmp_path)
    await seed(rt.engine, ROWS)
    job_id = await submit(rt)
    now = rt.clock()
    async with q.writing(rt.engine) as conn:
        await q.insert_messages(
            conn,
            [
                {"queue": q.WORK, "body": body.decode(), "headers": {}, "available_at": now}
                for body in (body_of(job_id), b"not json")
            ],
            now,
        )
    for handed_out in range(3):  # limit 1: two hand-outs, then the claim moves them aside
        async with q.writing(rt.engine) as conn:
            result = await q.claim_messages(
                conn, consumer="c", now=now, invisible_until=now, limit=10, delivery_limit=1
            )
        assert (len(result.claimed), result.quarantined) == ((2, 0) if handed_out < 2 else (0, 2))

    [dead] = await events_of(rt, job_id, "dead_lettered")
    assert (dead["deliveries"], dead["limit"]) == (2, 1)
    async with q.reading(rt.engine) as conn:
        assert await q.count_queue(conn, q.QUARANTINE) == 2
    await rt.engine.dispose()


async def test_attempts_used_up_by_released_deliveries_say_so_in_the_reason(
    database_url: str, tmp_path: Path
) -> None:
    """Every attempt claimed, the last one's delivery released after an error (its
    ``released`` event) and its lease run out: the next delivery quarantines the job with
    the release's reason, not "worker lost". Old code: "worker lost before an outcome"."""
    rt = runtime_for(database_url, tmp_path, max_attempts=1)
    await seed(rt.engine, ROWS)
    job_id = await submit(rt)
    assert await rt.store.claim_job(job_id, "w-0", rt.clock(), timedelta(seconds=30))
    await rt.store.record_event(
        job_id, "released", rt.clock(), reason="TypeError: not serialisable", worker="w-0"
    )
    clock_of(rt).advance(31)
    copy = HandDelivery(body_of(job_id))
    await Worker(rt, worker_id="w-1").handle(copy)

    job = await rt.store.get_job(job_id)
    assert job is not None and job.state is JobState.QUARANTINED
    assert job.quarantine_reason == (
        "attempts exhausted (1 claimed, no outcome: the last delivery was released after "
        "TypeError: not serialisable)"
    )
    assert copy.outcomes == ["reject"]
    await rt.engine.dispose()
