"""Batched claims and completions: each job in a batch wins or loses alone.

The worker sends the claims (and completions) of concurrent deliveries as one statement
(``storage/drivers/pg_statements.py``); these check that statement's guards row by row, the
same guards
the one-job path has (``test_claims.py`` runs the worker through both). Each runs on SQLite
(a batch is one write transaction there) and on both ways PostgreSQL gets them: through
SQLAlchemy, and on the raw asyncpg connections a worker or relay holds
(``storage/drivers/pg_pool.py``): the same guards, so the same answers. The tests of PostgreSQL's
own locks and errors run on PostgreSQL only.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import timedelta
from pathlib import Path

import asyncpg
import pytest
from sqlalchemy import Text, bindparam, text

from jobrelay.domain.states import JobState
from jobrelay.errors import StoreDataError, StoreError
from jobrelay.results import files
from jobrelay.runtime.wiring import Runtime
from jobrelay.storage.drivers.pg_pool import pg_statement
from jobrelay.storage.records import DONE_CHANNEL
from jobrelay.storage.repairs import RepairQueries
from jobrelay.storage.store import Claim, ClaimRequest, CompleteRequest, PendingEvent
from tests.integration.store_ways import holding, way_fixture  # noqa: F401 (fixture, by name)
from tests.integration.test_claims import (
    ROWS,
    clock_of,
    events_of,
    job_state,
    runtime_for,
    seed,
    submit,
)

LEASE = timedelta(seconds=30)


@pytest.fixture
async def db(way: tuple[str, str], tmp_path: Path) -> AsyncIterator[Runtime]:
    """The store on SQLite (one write transaction per batch, ``drivers/sqlite.py``: through
    SQLAlchemy, and whole on the ``sqlite3`` connection a worker holds, ``sqlite_conn``) and
    on PostgreSQL through both ways it sends the statements."""
    url, how = way
    runtime = runtime_for(url, tmp_path)
    await seed(runtime.engine, ROWS)
    async with holding(runtime.store, how):
        yield runtime
    await runtime.engine.dispose()


def ask(job_id: str, worker: str = "w-1", job_type: str = "report.export") -> ClaimRequest:
    return ClaimRequest(job_id, job_type, worker, {"redelivered": False})


async def test_a_batch_claims_the_ready_jobs_and_leaves_the_rest_to_the_policy(
    db: Runtime,
) -> None:
    ready = await submit(db, period="2020-01")
    leased = await submit(db, period="2020-02")
    finished = await submit(db, period="2020-03")
    wrong_type = await submit(db, period="2020-04")
    now = db.clock()
    first = await db.store.claim_many([ask(leased, "w-other"), ask(finished)], now, LEASE)
    assert all(r is not None for r in first)
    claim = first[1]
    assert claim is not None
    done = await db.store.complete_many([CompleteRequest(claim[0], "k", {"rows": 3})], now)
    assert done == {finished}

    results = await db.store.claim_many(
        [ask(ready), ask(leased), ask(finished), ask(wrong_type, job_type="notify.email")],
        now,
        LEASE,
    )
    assert results[1:] == [None, None, None]  # a live lease, finished, another type
    assert results[0] is not None
    claim_ready, job, claimed_from = results[0]
    assert (claim_ready.attempt, job.state, claimed_from) == (1, JobState.RUNNING, JobState.QUEUED)
    assert await job_state(db, leased) == (JobState.RUNNING, 1)  # untouched
    assert [e["attempt"] for e in await events_of(db, ready, "claimed")] == [1]
    assert [e["worker"] for e in await events_of(db, leased, "claimed")] == ["w-other"]


async def test_an_expired_lease_is_claimed_again_by_the_store_clock(db: Runtime) -> None:
    job_id = await submit(db)
    [won] = await db.store.claim_many([ask(job_id, "w-dead")], db.clock(), LEASE)
    assert won is not None
    [early] = await db.store.claim_many([ask(job_id)], db.clock(), LEASE)
    assert early is None
    clock_of(db).advance(LEASE.total_seconds() + 1)
    # Its worker was lost: a suspect, never claimed in a batch beside others; the read path
    # claims it (``claim_job``), alone in its worker (``worker.isolation``).
    [batched] = await db.store.claim_many([ask(job_id)], db.clock(), LEASE)
    assert batched is None
    late = await db.store.claim_job(job_id, "w-1", db.clock(), LEASE)
    assert late is not None and late.attempt == 2


async def test_a_batch_completion_is_fenced_per_job(db: Runtime) -> None:
    a, b = await submit(db, period="2020-01"), await submit(db, period="2020-02")
    claims = await db.store.claim_many([ask(a), ask(b)], db.clock(), LEASE)
    assert all(c is not None for c in claims)
    claim_a, claim_b = (c[0] for c in claims if c is not None)
    stale_b = Claim(b, claim_b.attempt - 1, claim_b.worker_id)  # an attempt that lost
    assert await db.store.report_progress(claim_a, 1, 4, db.clock())
    won = await db.store.complete_many(
        [CompleteRequest(claim_a, "ka", {"rows": 1}), CompleteRequest(stale_b, "kb", {})],
        db.clock(),
    )
    assert won == {a}
    assert await job_state(db, a) == (JobState.SUCCEEDED, 1)
    assert await job_state(db, b) == (JobState.RUNNING, 1)
    assert await events_of(db, b, "result_saved") == []
    saved = await events_of(db, a, "result_saved")
    assert [(e["resultKey"], e["meta"]["rows"], e["worker"]) for e in saved] == [("ka", 1, "w-1")]
    job = await db.store.get_job(a)
    # The progress is the job's own: the meta's "rows" does not overwrite it.
    assert job is not None and job.result_key == "ka"
    assert (job.progress_done, job.progress_total) == (1, 4)


async def test_a_completion_writes_its_progress_figures_and_leaves_the_jobs_without(
    db: Runtime,
) -> None:
    """Issue 41, item 4: the figures a job reported but had not written ride its success."""
    a, b = await submit(db, period="2020-01"), await submit(db, period="2020-02")
    claims = await db.store.claim_many([ask(a), ask(b)], db.clock(), LEASE)
    claim_a, claim_b = (c[0] for c in claims if c is not None)
    assert await db.store.report_progress(claim_b, 1, 4, db.clock())
    won = await db.store.complete_many(
        [
            CompleteRequest(claim_a, "ka", {}, progress=(7, 7)),
            CompleteRequest(claim_b, "kb", {}),
        ],
        db.clock(),
    )
    assert won == {a, b}
    got = [await db.store.get_job(job_id) for job_id in (a, b)]
    assert [(j.progress_done, j.progress_total) for j in got if j is not None] == [(7, 7), (1, 4)]


async def test_a_batchs_staged_results_share_one_fsync_of_their_directory(
    db: Runtime, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 41, item 4: the winners' publications run side by side in the completion's
    transaction, so their renames share the directory's ``fsync`` (old code: one each)."""
    ids = [await submit(db, period=f"2020-0{i}") for i in range(1, 5)]
    claims = await db.store.claim_many([ask(i) for i in ids], db.clock(), LEASE)
    sessions = []
    for job_id in ids:
        session = db.results.writer(f"batch/{job_id}.csv", staged=True)
        async with session as writer:
            await writer.write(b"x\n")
        sessions.append(session)
    synced: list[str] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        path = os.readlink(f"/proc/self/fd/{fd}")
        if os.path.isdir(path):
            synced.append(path)
        real_fsync(fd)

    monkeypatch.setattr(files.os, "fsync", fsync)
    requests = [
        CompleteRequest(c[0], f"batch/{c[0].job_id}.csv", {}, publish=s.publish)
        for c, s in zip(claims, sessions, strict=True)
        if c is not None
    ]
    assert await db.store.complete_many(requests, db.clock()) == set(ids)
    assert len(synced) == 1
    assert [await db.results.exists(f"batch/{job_id}.csv") for job_id in ids] == [True] * 4


@pytest.mark.parametrize("way", ["sqlalchemy", "asyncpg"], indirect=True)
@pytest.mark.parametrize("batched", [True, False], ids=["batch", "one"])
async def test_a_claim_does_not_wait_for_an_open_event_insert_of_the_same_job(
    db: Runtime, batched: bool
) -> None:
    # A relay marking a row published inserts its ``published`` event, whose foreign key
    # takes a key-share lock on the job. A claim that locked the job FOR UPDATE waited for
    # that transaction, and with the relay waiting on another job the worker held, the two
    # deadlocked (seen in the benchmark). FOR NO KEY UPDATE does not conflict with it.
    job_id = await submit(db)
    async with db.engine.connect() as other:
        transaction = await other.begin()
        await db.store.add_event(other, job_id, "published", db.clock())
        async with asyncio.timeout(10):
            if batched:
                [claimed] = await db.store.claim_many([ask(job_id)], db.clock(), LEASE)
            else:
                claimed = await db.store.claim_delivered(
                    job_id, "report.export", "w-1", db.clock(), LEASE
                )
        await transaction.rollback()
    assert claimed is not None and claimed[0].attempt == 1


@pytest.mark.parametrize("way", ["asyncpg"], indirect=True)
async def test_a_connection_cut_mid_prepare_is_an_outage_not_a_crash(
    db: Runtime, monkeypatch: pytest.MonkeyPatch
) -> None:
    """asyncpg raises ``InternalClientError`` ("cannot switch to state 12; another operation
    is in progress") when a backend is terminated while a statement is being prepared (seen
    in a loaded run of the test below). It is the connection's fault: a ``StoreError`` the
    worker holds its delivery on, not an unclassified exception that releases it."""
    import asyncpg

    assert db.store.driver.hot.active
    real_fetch = asyncpg.connection.Connection.fetch
    cut = {"left": 1}

    async def fetch_cut_once(self: asyncpg.Connection, *args: object, **kw: object) -> object:
        if cut["left"]:
            cut["left"] -= 1
            raise asyncpg.exceptions.InternalClientError(
                "cannot switch to state 12; another operation (2) is in progress"
            )
        return await real_fetch(self, *args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(asyncpg.connection.Connection, "fetch", fetch_cut_once)
    one = pg_statement(text("SELECT 1 AS one"))
    with pytest.raises(StoreError) as lost:
        await db.store.driver.rows(one, {})
    assert not isinstance(lost.value, StoreDataError)
    assert [row["one"] for row in await db.store.driver.rows(one, {})] == [1]


@pytest.mark.parametrize("way", ["sqlalchemy", "asyncpg"], indirect=True)
async def test_a_refused_value_is_a_data_error_and_a_lost_connection_an_outage(
    db: Runtime,
) -> None:
    """Issue 21, item 2, on both paths: a value the driver cannot encode (an attempt out
    of the column's range) or the server refuses (text that is not JSON: SQLSTATE 22P02) is
    a ``StoreDataError``, never retried as it is; a connection the server closed is a plain
    ``StoreError`` (an outage), and the next statement goes through."""
    [claimed] = await db.store.claim_many([ask(await submit(db))], db.clock(), LEASE)
    assert claimed is not None
    with pytest.raises(StoreDataError):
        await db.store.complete_many(
            [CompleteRequest(Claim(claimed[0].job_id, 2**40, claimed[0].worker_id), "k", {})],
            db.clock(),
        )
    not_json = pg_statement(
        text("SELECT CAST(:value AS jsonb) AS v").bindparams(bindparam("value", type_=Text()))
    )
    with pytest.raises(StoreDataError, match="json"):
        await db.store.driver.rows(not_json, {"value": "not json"})

    sleep = pg_statement(text("SELECT pg_sleep(30) AS slept"))
    sleeping = asyncio.create_task(db.store.driver.rows(sleep, {}))
    async with db.engine.connect() as admin:  # the backend running that statement goes away
        # Autocommit: in a transaction pg_stat_activity would show its first snapshot only.
        await admin.execution_options(isolation_level="AUTOCOMMIT")
        for _ in range(100):
            terminated = await admin.scalar(
                text(
                    "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
                    " WHERE datname = current_database() AND query LIKE '%pg_sleep(30)%'"
                    " AND pid <> pg_backend_pid()"
                )
            )
            if terminated:
                break
            await asyncio.sleep(0.05)
    with pytest.raises(StoreError) as lost:
        await asyncio.wait_for(sleeping, timeout=10)
    assert not isinstance(lost.value, StoreDataError)
    [row] = await db.store.driver.rows(not_json, {"value": '{"a": 1}'})
    assert row["v"] == {"a": 1}


async def test_leases_are_renewed_together_and_fenced_per_job(db: Runtime) -> None:
    """The worker's lease renewer: one statement for every running claim; a claim another
    claim has superseded is not renewed, its neighbours are, by the store's clock."""
    a, b = await submit(db, period="2020-01"), await submit(db, period="2020-02")
    claims = await db.store.claim_many([ask(a), ask(b)], db.clock(), LEASE)
    claim_a, claim_b = (c[0] for c in claims if c is not None)
    stale_b = Claim(b, claim_b.attempt + 1, claim_b.worker_id)  # not the claim holding b
    clock_of(db).advance(10)
    renewed = await db.store.renew_leases([claim_a, stale_b], LEASE, db.clock())
    assert renewed == {claim_a}
    job_a, job_b = await db.store.get_job(a), await db.store.get_job(b)
    assert job_a is not None and job_b is not None
    assert job_a.lease_expires_at == db.clock() + LEASE
    assert job_b.lease_expires_at == db.clock() - timedelta(seconds=10) + LEASE


async def test_a_batch_holding_an_unstorable_row_is_refused_whole(db: Runtime) -> None:
    """A completion the driver refuses (a result key with a lone surrogate) fails its batch
    with a ``StoreDataError`` and nothing of the batch commits: its neighbour is still
    running, without a ``result_saved``, and completes alone (what the worker's batcher does
    on that error). On SQLite the batch is one transaction, rolled back whole."""
    a, b = await submit(db, period="2020-01"), await submit(db, period="2020-02")
    claims = await db.store.claim_many([ask(a), ask(b)], db.clock(), LEASE)
    claim_a, claim_b = (c[0] for c in claims if c is not None)
    healthy = CompleteRequest(claim_a, "ka", {"rows": 1})
    with pytest.raises(StoreDataError):
        await db.store.complete_many([healthy, CompleteRequest(claim_b, "k\ud800", {})], db.clock())
    assert await job_state(db, a) == (JobState.RUNNING, 1)
    assert await events_of(db, a, "result_saved") == []
    assert await db.store.complete_many([healthy], db.clock()) == {a}
    assert await job_state(db, a) == (JobState.SUCCEEDED, 1)


async def test_a_job_whose_worker_was_lost_is_never_claimed_beside_others(db: Runtime) -> None:
    """A suspect (its last attempt ended with its worker lost: the lease expired, or the
    reconciler requeued it ``worker_lost``) loses the claims made without a read, in a
    batch or alone; the read path's ``claim_job`` takes it (the worker runs it alone). A
    retry after an ordinary failure is no suspect."""
    expired, requeued, healthy = [await submit(db, period=f"2020-0{m}") for m in (1, 2, 3)]
    now = db.clock()
    claims = await db.store.claim_many([ask(j, "w-dead") for j in (expired, requeued)], now, LEASE)
    assert all(c is not None for c in claims)
    clock_of(db).advance(LEASE.total_seconds() + 1)
    lost = RepairQueries(db.store)
    assert await lost.requeue_expired_lease(requeued, "w-dead", db.clock(), db.clock(), "rec")
    assert await job_state(db, requeued) == (JobState.RETRY_WAIT, 1)
    ready = [ask(expired), ask(requeued), ask(healthy)]
    batched = await db.store.claim_many(ready, db.clock(), LEASE)
    assert [c is not None for c in batched] == [False, False, True]
    for job_id in (expired, requeued):  # the one-job claim of a delivery refuses it too
        delivered = await db.store.claim_delivered(
            job_id, "report.export", "w-1", db.clock(), LEASE
        )
        assert delivered is None
        alone = await db.store.claim_job(job_id, "w-1", db.clock(), LEASE)
        assert alone is not None and alone.attempt == 2


async def test_a_turn_completes_and_claims_each_job_fenced_alone(db: Runtime) -> None:
    """Issue 41 item 1: a worker's turn, the completions of one batch and the claims of the
    next in one statement (PostgreSQL) or transaction (SQLite). Each half keeps its guards
    row by row: a stale completion loses beside a winning one, a claim of a running job or of
    another type beside a winning claim, and the settles riding on the turn are written."""
    a, b = await submit(db, period="2020-01"), await submit(db, period="2020-02")
    c, d = await submit(db, period="2020-03"), await submit(db, period="2020-04")
    claims = await db.store.claim_many([ask(a), ask(b)], db.clock(), LEASE)
    claim_a, claim_b = (x[0] for x in claims if x is not None)
    stale_b = Claim(b, claim_b.attempt + 1, claim_b.worker_id)
    settle = PendingEvent(a, "ack_sent", db.clock(), {"attempt": 0})
    claimed, done = await db.store.turn(
        [ask(c), ask(d, job_type="notify.email")],
        [CompleteRequest(claim_a, "ka", {"rows": 1}), CompleteRequest(stale_b, "kb", {})],
        db.clock(),
        LEASE,
        [settle],
    )
    assert done == {a} and not done.failed
    assert claimed[1] is None  # another type
    assert claimed[0] is not None and claimed[0][0].attempt == 1
    assert await job_state(db, a) == (JobState.SUCCEEDED, 1)
    assert await job_state(db, b) == (JobState.RUNNING, 1)
    assert await job_state(db, c) == (JobState.RUNNING, 1)
    assert await job_state(db, d) == (JobState.QUEUED, 0)
    assert [e["attempt"] for e in await events_of(db, c, "claimed")] == [1]
    assert len(await events_of(db, a, "ack_sent")) == 1
    assert await events_of(db, b, "result_saved") == []


async def test_a_settle_riding_on_the_claim_of_its_own_job_is_written(db: Runtime) -> None:
    """A settle (a redelivery's ``rejected``, say) riding on a batch that claims the same
    job: the claim has locked and updated the row, and the settle's write must not take that
    row for gone (its key-share lock skips a row its own statement changed, migration 0023)."""
    a = await submit(db, period="2020-01")
    settle = PendingEvent(a, "rejected", db.clock(), {"attempt": 0})
    claimed = await db.store.claim_many([ask(a)], db.clock(), LEASE, [settle])
    assert claimed[0] is not None
    assert len(await events_of(db, a, "rejected")) == 1


async def test_a_turn_commits_both_halves_or_neither(db: Runtime) -> None:
    """The turn is one commit: a completion the driver refuses (a result key with a lone
    surrogate) refuses the claims beside it too, nothing of either written; the worker's
    batcher then sends each request alone."""
    a, c = await submit(db, period="2020-01"), await submit(db, period="2020-03")
    [won] = await db.store.claim_many([ask(a)], db.clock(), LEASE)
    assert won is not None
    bad = CompleteRequest(won[0], "k\ud800", {})
    with pytest.raises(StoreDataError):
        await db.store.turn([ask(c)], [bad], db.clock(), LEASE)
    assert await job_state(db, c) == (JobState.QUEUED, 0)
    assert await events_of(db, c, "claimed") == []
    assert await job_state(db, a) == (JobState.RUNNING, 1)


async def test_a_turn_claims_in_the_transaction_of_a_completion_with_a_step(db: Runtime) -> None:
    """Issue 41 item 4: a completion with a step of its own (a staged result to publish)
    takes part in a turn: the claims ride in its write transaction, one commit. A step that
    fails rolls the transaction back and it is sent again without that completion, the
    claims in it again: each claimed once (attempt 1, one ``claimed`` event), the settle
    riding on it written once, and a completion left with no neighbour still lets the
    claims commit. Old code: refused (``ValueError``), the claims a commit of their own."""
    a, b = await submit(db, period="2020-01"), await submit(db, period="2020-02")
    c, d = await submit(db, period="2020-03"), await submit(db, period="2020-04")
    e = await submit(db, period="2020-05")
    claims = await db.store.claim_many([ask(a), ask(b), ask(e)], db.clock(), LEASE)
    claim_a, claim_b, claim_e = (x[0] for x in claims if x is not None)
    published: list[str] = []

    def publishing(name: str, fails: bool = False) -> Callable[[], Awaitable[None]]:
        async def publish() -> None:
            published.append(name)
            if fails:
                raise OSError(f"{name}: disk full")

        return publish

    settle = PendingEvent(a, "ack_sent", db.clock(), {"attempt": 0})
    claimed, done = await db.store.turn(
        [ask(c)],
        [
            CompleteRequest(claim_a, "ka", {}, publish=publishing("a")),
            CompleteRequest(claim_b, "kb", {}, publish=publishing("b", fails=True)),
        ],
        db.clock(),
        LEASE,
        [settle],
    )
    assert done == {a} and set(done.failed) == {b}
    assert isinstance(done.failed[b], OSError)
    assert claimed[0] is not None and claimed[0][0].attempt == 1
    assert await job_state(db, a) == (JobState.SUCCEEDED, 1)
    assert await job_state(db, b) == (JobState.RUNNING, 1)
    assert await job_state(db, c) == (JobState.RUNNING, 1)
    assert [e["attempt"] for e in await events_of(db, c, "claimed")] == [1]
    assert len(await events_of(db, a, "ack_sent")) == 1
    assert await events_of(db, b, "result_saved") == []
    assert published.count("b") == 1

    claimed, done = await db.store.turn(
        [ask(d)],
        [CompleteRequest(claim_e, "ke", {}, publish=publishing("e", fails=True))],
        db.clock(),
        LEASE,
    )
    assert not done and set(done.failed) == {e}
    assert claimed[0] is not None and claimed[0][0].attempt == 1
    assert await job_state(db, d) == (JobState.RUNNING, 1)
    assert await job_state(db, e) == (JobState.RUNNING, 1)


async def test_a_turn_that_completes_jobs_wakes_their_waiters(db: Runtime) -> None:
    """The waiters of the jobs a turn completes (``App.wait``) are told at its commit: its
    ``told`` CTE writes nothing, so it runs only because the statement reads it (a review
    asked whether it was planned away; it was not, and the turn now reads it outright)."""
    if db.engine.dialect.name != "postgresql":
        pytest.skip("NOTIFY is PostgreSQL's; SQLite's waiters read data_version")
    a, c = await submit(db, period="2020-01"), await submit(db, period="2020-03")
    [won] = await db.store.claim_many([ask(a)], db.clock(), LEASE)
    assert won is not None
    told = asyncio.Event()
    url = db.engine.url.set(drivername="postgresql").render_as_string(False)
    listener = await asyncpg.connect(url)
    try:
        await listener.add_listener(DONE_CHANNEL, lambda *_: told.set())
        claimed, done = await db.store.turn(
            [ask(c)], [CompleteRequest(won[0], "ka", {})], db.clock(), LEASE
        )
        assert done == {a} and claimed[0] is not None
        await asyncio.wait_for(told.wait(), 10)
    finally:
        await listener.close()
