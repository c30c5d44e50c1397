"""The store contract, run on both databases, each with and without the hot connections held
(``store_ways``): the same answers whichever executor sends the statements."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from datetime import UTC, datetime, timedelta

import asyncpg
import pytest
from sqlalchemy import delete

from jobrelay.domain.ids import request_hash
from jobrelay.domain.states import JobState
from jobrelay.errors import IdempotencyConflict
from jobrelay.storage import tokens
from jobrelay.storage.engine import create_engine
from jobrelay.storage.store import (
    NOTIFY_CHANNEL,
    Claim,
    ClaimRequest,
    Completed,
    CompleteRequest,
    NewJob,
    OutboxRow,
    PendingEvent,
    Store,
    TokenRecord,
)
from jobrelay.storage.tables import api_tokens
from jobrelay.worker.scope import turn_with_settles
from jobrelay.worker.timeline import TimelineWriter
from tests.id_keys import request_id
from tests.integration.store_ways import (  # noqa: F401 (way_fixture: the fixture, by name)
    held_way,
    holding,
    way_fixture,
)

T0 = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
LEASE = timedelta(seconds=30)


class Clock:
    """The store's clock, moved by the test: what leases and due times are judged by."""

    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> datetime:
        return self.now


CLOCK = Clock()
# What the port does with no held statement yet: the portable transitions (retry, quarantine,
# cancel) and the tokens go through SQLAlchemy on both drivers; accepting and the outbox on
# SQLite. Claims, completions and renewals, of one job or many, take the held statements, and
# a new job the intake connections on PostgreSQL (``PostgresDriver.intake``).
COLD_ON_BOTH = pytest.mark.cold_on("sqlite", "postgresql")
COLD_ON_SQLITE = pytest.mark.cold_on("sqlite")


def at(moment: datetime) -> datetime:
    """Move the store's clock to ``moment`` and pass it on as the recorded time too."""
    CLOCK.now = moment
    return moment


@pytest.fixture
async def store(way: tuple[str, str], request: pytest.FixtureRequest) -> AsyncIterator[Store]:
    """The store on each of its four ways (``store_ways``). Where the way holds the hot
    connections, the test must have sent work on them, unless it is marked ``cold_on`` its
    driver (what the port does there has no held statement yet); a mark the test outgrows
    fails too, so the list stays true."""
    url, how = way
    engine = create_engine(url)
    at(T0)
    store = Store(engine, clock=CLOCK)
    try:
        async with holding(store, how) as sent:
            yield store
            moved = sent() > 0
    finally:
        await engine.dispose()
    if held_way(how):
        driver = "postgresql" if (store.engine.dialect.name == "postgresql") else "sqlite"
        mark = request.node.get_closest_marker("cold_on")
        cold = mark is not None and driver in mark.args
        if cold and moved:
            pytest.fail(f"held {driver} connection used: drop the test's cold_on mark")
        if not cold and not moved:
            pytest.fail(f"nothing was sent on the held {driver} connection")


async def claim_at(store: Store, relay: str, moment: datetime) -> list[OutboxRow]:
    at(moment)
    return await store.claim_outbox(relay, 10, LEASE)


async def attempt_of(store: Store, job_id: str, worker: str, now: datetime) -> int | None:
    claim = await store.claim_job(job_id, worker, at(now), LEASE)
    return claim.attempt if claim is not None else None


async def new_job(
    store: Store, params: dict[str, str] | None = None, key: str | None = None
) -> NewJob:
    """What ``POST /v1/exports`` stores, its id keyed with ``store``'s secret."""
    params = params or {"accountId": "acme", "period": "2020-05"}
    return NewJob(
        job_id=await request_id(store, "acme", params, key),
        type="report.export",
        account_id="acme",
        params=params,
        request_hash=request_hash("acme", "report.export", params),
        max_attempts=3,
        idempotency_key=key,
    )


@COLD_ON_SQLITE
async def test_submit_writes_job_outbox_and_event_together(store: Store) -> None:
    job_id, created = await store.submit(await new_job(store), T0)
    assert created
    job = await store.get_job(job_id)
    assert job is not None and job.state is JobState.QUEUED and job.attempt == 0
    assert job.published is False and job.unpublished_since == T0
    assert [e.kind for e in await store.events(job_id)] == ["accepted"]
    assert await store.outbox_backlog() == 1


@COLD_ON_SQLITE
async def test_repeat_submit_creates_nothing(store: Store) -> None:
    first, _ = await store.submit(await new_job(store), T0)
    again, created = await store.submit(await new_job(store), T0 + timedelta(seconds=5))
    assert (again, created) == (first, False)
    assert await store.outbox_backlog() == 1
    assert len(await store.events(first)) == 1


@COLD_ON_SQLITE
async def test_same_key_other_body_conflicts_and_changes_nothing(store: Store) -> None:
    await store.submit(await new_job(store, key="k1"), T0)
    with pytest.raises(IdempotencyConflict):
        await store.submit(
            await new_job(store, {"accountId": "acme", "period": "2020-06"}, key="k1"), T0
        )
    assert await store.outbox_backlog() == 1


@COLD_ON_SQLITE
async def test_concurrent_submits_of_one_job_create_it_once(store: Store) -> None:
    job = await new_job(store, key="k2")
    results = await asyncio.gather(*(store.submit(job, T0) for _ in range(8)))
    assert {job_id for job_id, _ in results} == {job.job_id}
    assert sum(created for _, created in results) == 1
    assert await store.outbox_backlog() == 1


@COLD_ON_SQLITE
async def test_submit_notifies_listening_relays_once_per_new_job(store: Store) -> None:
    if store.engine.dialect.name != "postgresql":
        pytest.skip("NOTIFY is PostgreSQL's")
    heard: list[str] = []
    marker = asyncio.Event()

    def hear(_conn: object, _pid: int, _channel: str, payload: str) -> None:
        heard.append(payload)
        if payload == "marker":
            marker.set()

    url = store.engine.url.set(drivername="postgresql").render_as_string(False)
    listener = await asyncpg.connect(url)
    try:
        await listener.add_listener(NOTIFY_CHANNEL, hear)
        await store.submit(await new_job(store), T0)
        await store.submit(await new_job(store), T0)  # the same request again: nothing written
        # Notifications arrive in commit order: once a marker sent after both submits is
        # heard, whatever they sent has been heard too (no fixed wait for an absence).
        sender = await asyncpg.connect(url)
        try:
            await sender.execute("SELECT pg_notify($1, 'marker')", NOTIFY_CHANNEL)
        finally:
            await sender.close()
        await asyncio.wait_for(marker.wait(), 30)
    finally:
        await listener.close()
    assert heard == ["", "marker"]


@COLD_ON_BOTH
async def test_a_token_found_is_remembered_briefly_and_an_unknown_one_never(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert await store.find_token("h1") is None
    await store.add_token("h1", "acme", False, T0)
    assert await store.find_token("h1") == TokenRecord("acme", False)  # at once
    async with store.writing() as conn:
        await conn.execute(delete(api_tokens))
    assert await store.find_token("h1") == TokenRecord("acme", False)  # remembered
    later = time.monotonic() + tokens.TOKEN_CACHE_SECONDS + 1
    monkeypatch.setattr(tokens, "_monotonic", lambda: later)
    assert await store.find_token("h1") is None


@COLD_ON_SQLITE
async def test_outbox_claim_is_exclusive_until_it_expires(store: Store) -> None:
    await store.submit(await new_job(store), T0)
    rows = await claim_at(store, "r1", T0)
    assert len(rows) == 1
    assert await claim_at(store, "r2", T0 + timedelta(seconds=1)) == []
    again = await claim_at(store, "r2", T0 + LEASE + timedelta(seconds=1))
    assert [r.id for r in again] == [rows[0].id]
    assert again[0].publish_attempts == 2


@COLD_ON_SQLITE
async def test_mark_published_sets_fact_and_event(store: Store) -> None:
    job_id, _ = await store.submit(await new_job(store), T0)
    rows = await claim_at(store, "r1", T0)
    assert await store.mark_published("r1", rows) == 1
    job = await store.get_job(job_id)
    assert job is not None and job.published and job.unpublished_since is None
    assert await store.outbox_backlog() == 0
    # Marking twice (a second relay that also published) changes nothing more.
    assert await store.mark_published("r2", rows) == 0


@COLD_ON_SQLITE
async def test_release_keeps_row_waiting_with_error(store: Store) -> None:
    job_id, _ = await store.submit(await new_job(store), T0)
    rows = await claim_at(store, "r1", T0)
    await store.release_outbox(rows[0], "unroutable", timedelta(seconds=2))
    job = await store.get_job(job_id)
    assert job is not None and not job.published and job.last_publish_error == "unroutable"
    assert await claim_at(store, "r2", T0 + timedelta(seconds=1)) == []
    assert len(await claim_at(store, "r2", T0 + timedelta(seconds=3))) == 1


async def test_claim_increments_attempt_and_guards_live_lease(store: Store) -> None:
    job_id, _ = await store.submit(await new_job(store), T0)
    first = await store.claim_job(job_id, "w1", at(T0), LEASE)
    assert first is not None and first.attempt == 1
    assert await attempt_of(store, job_id, "w2", T0 + timedelta(seconds=1)) is None
    assert await attempt_of(store, job_id, "w2", T0 + LEASE) == 2  # lease expired: taken over
    job = await store.get_job(job_id)
    assert job is not None and job.attempt == 2 and job.lease_owner == "w2"
    # The first worker lost its lease: its result is refused, and it learns who holds it.
    lost = await store.complete(first, "k", {"rows": 1}, T0 + LEASE)
    assert (lost.won, lost.current_attempt, lost.current_state) == (False, 2, JobState.RUNNING)


async def test_complete_then_nothing_moves_it(store: Store) -> None:
    job_id, _ = await store.submit(await new_job(store), T0)
    claim = await store.claim_job(job_id, "w1", at(T0), LEASE)
    assert claim is not None
    assert (await store.complete(claim, "exports/acme/x.csv", {"rows": 3}, T0)).won
    assert await attempt_of(store, job_id, "w2", T0 + LEASE * 2) is None
    assert not await store.quarantine(job_id, "bad", T0)
    job = await store.get_job(job_id)
    assert job is not None and job.state is JobState.SUCCEEDED
    assert job.result_key == "exports/acme/x.csv"
    assert [e.kind for e in await store.events(job_id)] == ["accepted", "claimed", "result_saved"]


async def test_retry_writes_outbox_row_and_waits_until_due(store: Store) -> None:
    job_id, _ = await store.submit(await new_job(store), T0)
    claim = await store.claim_job(job_id, "w1", at(T0), LEASE)
    assert claim is not None
    assert (await store.schedule_retry(claim, "report.export", "boom", 5, T0)).won
    job = await store.get_job(job_id)
    assert job is not None and job.state is JobState.RETRY_WAIT and job.last_error == "boom"
    assert job.next_attempt_at == T0 + timedelta(seconds=5)
    rows = await claim_at(store, "r", T0)
    assert sorted(r.destination for r in rows) == ["retry.5s", "work"]
    assert await attempt_of(store, job_id, "w2", T0 + timedelta(seconds=2)) is None
    assert await attempt_of(store, job_id, "w2", T0 + timedelta(seconds=5)) == 2


async def test_attempt_budget_is_enforced_in_sql(store: Store) -> None:
    job_id, _ = await store.submit(await new_job(store), T0)
    for i in range(3):
        assert await attempt_of(store, job_id, f"w{i}", T0 + LEASE * i) == i + 1
    assert await attempt_of(store, job_id, "w9", T0 + LEASE * 10) is None


@COLD_ON_SQLITE
async def test_quarantine_keeps_reason(store: Store) -> None:
    job_id, _ = await store.submit(await new_job(store), T0)
    assert await store.quarantine(job_id, "invalid payload: x", T0, deliveryTag=1)
    job = await store.get_job(job_id)
    assert job is not None and job.state is JobState.QUARANTINED
    assert job.quarantine_reason == "invalid payload: x"
    events = await store.events(job_id)
    assert events[-1].kind == "quarantined" and events[-1].detail["deliveryTag"] == 1


def ask(job_id: str, worker: str) -> ClaimRequest:
    return ClaimRequest(job_id, "report.export", worker, {"redelivered": False})


async def test_a_claim_writes_the_settles_given_to_it(store: Store) -> None:
    """A worker's ``ack_sent`` lines ride on its next claim (no commit of their own): written
    with the claims, an unknown job's skipped, whether or not a claim wins."""
    done_id, _ = await store.submit(await new_job(store, key="done"), T0)
    fresh, _ = await store.submit(await new_job(store, key="fresh"), T0)
    acked = T0 + timedelta(seconds=1)
    settles = [
        PendingEvent(done_id, "ack_sent", acked, {"worker": "w1"}),
        PendingEvent("no-such-job", "ack_sent", acked, {"worker": "w1"}),
    ]
    [claimed] = await store.claim_many([ask(fresh, "w1")], at(T0), LEASE, settles)
    assert claimed is not None
    assert [(e.kind, e.detail) for e in await store.events(done_id)][-1] == (
        "ack_sent",
        {"worker": "w1"},
    )
    assert [e.kind for e in await store.events(fresh)] == ["accepted", "claimed"]
    lost = PendingEvent(fresh, "settle_lost", acked, {"worker": "w1"})
    assert await store.claim_many([ask(fresh, "w2")], at(T0), LEASE, [lost]) == [None]
    assert [e.kind for e in await store.events(fresh)] == ["accepted", "claimed", "settle_lost"]


@COLD_ON_SQLITE
async def test_a_settle_the_database_refuses_costs_no_claim(store: Store) -> None:
    """Review of stop 52: a settle riding on a claim that the database refused (here a kind
    longer than PostgreSQL's varchar(32); in production, its job deleted by retention under
    it) failed the claim with it. Now the claims are sent again alone, and the settle goes
    back to the timeline writer's own statement."""
    if store.engine.dialect.name != "postgresql":
        pytest.skip("SQLite does not bound a kind's length")
    job_id, _ = await store.submit(await new_job(store, key="a"), T0)
    writer = TimelineWriter(store)
    writer.start_batching()
    writer.add(job_id, "k" * 40, T0)
    [claimed], _ = await turn_with_settles(store, writer, [ask(job_id, "w1")], [], at(T0), LEASE)
    assert claimed is not None and claimed[0].attempt == 1
    assert writer.take() == []  # given back: the writer's own, never a claim's again
    await writer.close(timeout=0.5)  # refused there too: given up after the timeout
    assert [e.kind for e in await store.events(job_id)] == ["accepted", "claimed"]


async def test_batch_claims_and_completions_are_fenced_per_job(store: Store) -> None:
    """The worker's batched transitions (the held statements while it runs)."""
    a, _ = await store.submit(await new_job(store, key="a"), T0)
    b, _ = await store.submit(await new_job(store, key="b"), T0)
    claims = await store.claim_many([ask(a, "w1"), ask(b, "w1")], at(T0), LEASE)
    assert [c[0].attempt if c else None for c in claims] == [1, 1]
    assert await store.claim_many([ask(a, "w2")], at(T0 + timedelta(seconds=1)), LEASE) == [None]
    won_a, won_b = (c[0] for c in claims if c is not None)
    stale = Claim(won_b.job_id, won_b.attempt + 1, "w1")  # not the claim that holds b
    done = await store.complete_many(
        [CompleteRequest(won_a, "exports/a.csv", {"rows": 1}), CompleteRequest(stale, "x", {})],
        T0,
    )
    assert done == {a}
    job_a, job_b = await store.get_job(a), await store.get_job(b)
    assert job_a is not None and job_a.state is JobState.SUCCEEDED
    assert job_a.result_key == "exports/a.csv"
    assert job_b is not None and job_b.state is JobState.RUNNING and job_b.result_key is None
    assert [e.kind for e in await store.events(a)] == ["accepted", "claimed", "result_saved"]
    assert await store.claim_many([ask(a, "w2")], at(T0 + LEASE * 2), LEASE) == [None]


async def three_claimed(store: Store) -> tuple[Claim, Claim, Claim]:
    ids = [(await store.submit(await new_job(store, key=k), T0))[0] for k in "abc"]
    claims = await store.claim_many([ask(i, "w1") for i in ids], at(T0), LEASE)
    a, b, c = (claimed[0] for claimed in claims if claimed is not None)
    return a, b, c


def publication(
    published: list[str], job_id: str, fail: bool = False
) -> Callable[[], Awaitable[None]]:
    """A completion's step that publishes ``job_id``'s result (or finds no room for it)."""

    async def step() -> None:
        if fail:
            raise OSError(f"no room for {job_id}'s result")
        published.append(job_id)

    return step


async def b_failed_alone(
    store: Store, claims: tuple[Claim, Claim, Claim], done: Completed, published: list[str]
) -> None:
    """a and c completed, their steps run in the transaction that committed (the failed
    try's too); b is still running, and completes on its own once its step works."""
    a, b, c = claims
    assert set(done) == {a.job_id, c.job_id}
    assert list(done.failed) == [b.job_id] and isinstance(done.failed[b.job_id], OSError)
    assert published.count(a.job_id) >= 1 and published.count(c.job_id) >= 1
    states = {x.job_id: (await store.get_job(x.job_id)).state for x in claims}  # type: ignore[union-attr]
    assert states == {
        a.job_id: JobState.SUCCEEDED,
        b.job_id: JobState.RUNNING,
        c.job_id: JobState.SUCCEEDED,
    }
    again = await store.complete_many(
        [CompleteRequest(b, "exports/b.csv", {}, publication(published, b.job_id))], T0
    )
    assert set(again) == {b.job_id} and not again.failed


async def test_completions_with_steps_of_their_own_commit_together_one_failed_step_alone(
    store: Store,
) -> None:
    """A batch of completions that each publish a staged result and create a follow-up (as
    ``report.export`` does) is one statement in one transaction, the steps of each winner
    inside it; a step that raises leaves its own job running and costs no neighbour its
    outcome. (Before: the batched completion took no such request at all.)"""
    a, b, c = claims = await three_claimed(store)
    published: list[str] = []
    notice = replace(await new_job(store, key="notice-a"), type="notify.email", params={})
    done = await store.complete_many(
        [
            CompleteRequest(a, "exports/a.csv", {}, publication(published, a.job_id), (notice,)),
            CompleteRequest(b, "exports/b.csv", {}, publication(published, b.job_id, fail=True)),
            CompleteRequest(c, "exports/c.csv", {}, publication(published, c.job_id)),
        ],
        T0,
    )
    [accepted] = [e for e in await store.events(notice.job_id) if e.kind == "accepted"]
    assert accepted.detail["parentJobId"] == a.job_id
    assert [e.kind for e in await store.events(a.job_id)][-2:] == [
        "result_saved",
        "follow_up_accepted",
    ]
    await b_failed_alone(store, claims, done, published)


async def test_completions_whose_one_step_is_a_publication_fail_alone(store: Store) -> None:
    """As ``report.export``'s: publications only (no follow-up), side by side in the batch's
    transaction, with the figures of a progress not yet written. A publication that raises
    leaves its job running, and its neighbours complete."""
    a, b, c = claims = await three_claimed(store)
    published: list[str] = []
    done = await store.complete_many(
        [
            CompleteRequest(
                a, "exports/a.csv", {}, publication(published, a.job_id), progress=(3, 3)
            ),
            CompleteRequest(b, "exports/b.csv", {}, publication(published, b.job_id, fail=True)),
            CompleteRequest(c, "exports/c.csv", {}, publication(published, c.job_id)),
        ],
        T0,
    )
    found = await store.get_job(a.job_id)
    assert found is not None and (found.progress_done, found.progress_total) == (3, 3)
    assert [e.kind for e in await store.events(a.job_id)][-1] == "result_saved"
    await b_failed_alone(store, claims, done, published)


async def test_a_renewal_extends_only_the_claims_that_hold(store: Store) -> None:
    a, _ = await store.submit(await new_job(store, key="a"), T0)
    b, _ = await store.submit(await new_job(store, key="b"), T0)
    await store.claim_job(b, "w1", at(T0), LEASE)
    claim = await store.claim_job(a, "w1", at(T0), LEASE)
    assert claim is not None
    lost = Claim(b, 1, "w-other")  # b is held by w1, not by this claim
    renewed = await store.renew_leases([claim, lost], LEASE, at(T0 + LEASE / 2))
    assert set(renewed) == {claim} and not renewed.cancel_requested
    # Past the first lease's end, within the renewed one: nobody takes a over; b is taken.
    assert await attempt_of(store, a, "w2", T0 + LEASE + timedelta(seconds=1)) is None
    assert await attempt_of(store, b, "w2", T0 + LEASE + timedelta(seconds=1)) == 2
    assert await attempt_of(store, a, "w2", T0 + LEASE * 2) == 2


async def test_a_stale_claim_beside_the_current_one_of_the_same_job_is_not_renewed(
    store: Store,
) -> None:
    """One worker can hold two claims of one job: its first attempt's lease ran out, a
    redelivery came back to the same worker and claimed attempt 2 while the first run still
    goes on. One renewal statement may carry both; only the claim that holds the job is
    renewed (an answer matched by job id alone renewed the stale one too)."""
    a, _ = await store.submit(await new_job(store, key="a"), T0)
    first = await store.claim_job(a, "w1", at(T0), LEASE)
    assert first is not None
    current = await store.claim_job(a, "w1", at(T0 + LEASE + timedelta(seconds=1)), LEASE)
    assert current is not None and current.attempt == first.attempt + 1
    renewed = await store.renew_leases(
        [first, current], LEASE, at(T0 + LEASE + timedelta(seconds=2))
    )
    assert set(renewed) == {current}, set(renewed)
    assert not set(renewed.skipped)
