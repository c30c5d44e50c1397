"""The store contract, run against SQLite and PostgreSQL alike."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta

import asyncpg
import pytest
from sqlalchemy import delete

from jobrelay.domain.ids import request_hash
from jobrelay.domain.states import JobState
from jobrelay.errors import IdempotencyConflict
from jobrelay.storage import tokens
from jobrelay.storage.engine import create_engine
from jobrelay.storage.store import NOTIFY_CHANNEL, NewJob, OutboxRow, Store, TokenRecord
from jobrelay.storage.tables import api_tokens
from tests.id_keys import request_id

T0 = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
LEASE = timedelta(seconds=30)


class Clock:
    """The store's clock, moved by the test: what leases and due times are judged by."""

    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> datetime:
        return self.now


CLOCK = Clock()


def at(moment: datetime) -> datetime:
    """Move the store's clock to ``moment`` and pass it on as the recorded time too."""
    CLOCK.now = moment
    return moment


@pytest.fixture
async def store(database_url: str) -> AsyncIterator[Store]:
    engine = create_engine(database_url)
    at(T0)
    yield Store(engine, clock=CLOCK)
    await engine.dispose()


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


async def test_submit_writes_job_outbox_and_event_together(store: Store) -> None:
    job_id, created = await store.submit(await new_job(store), T0)
    assert created
    job = await store.get_job(job_id)
    assert job is not None and job.state is JobState.QUEUED and job.attempt == 0
    assert job.published is False and job.unpublished_since == T0
    assert [e.kind for e in await store.events(job_id)] == ["accepted"]
    assert await store.outbox_backlog() == 1


async def test_repeat_submit_creates_nothing(store: Store) -> None:
    first, _ = await store.submit(await new_job(store), T0)
    again, created = await store.submit(await new_job(store), T0 + timedelta(seconds=5))
    assert (again, created) == (first, False)
    assert await store.outbox_backlog() == 1
    assert len(await store.events(first)) == 1


async def test_same_key_other_body_conflicts_and_changes_nothing(store: Store) -> None:
    await store.submit(await new_job(store, key="k1"), T0)
    with pytest.raises(IdempotencyConflict):
        await store.submit(
            await new_job(store, {"accountId": "acme", "period": "2020-06"}, key="k1"), T0
        )
    assert await store.outbox_backlog() == 1


async def test_concurrent_submits_of_one_job_create_it_once(store: Store) -> None:
    job = await new_job(store, key="k2")
    results = await asyncio.gather(*(store.submit(job, T0) for _ in range(8)))
    assert {job_id for job_id, _ in results} == {job.job_id}
    assert sum(created for _, created in results) == 1
    assert await store.outbox_backlog() == 1


async def test_submit_notifies_listening_relays_once_per_new_job(store: Store) -> None:
    if not store.is_postgres:
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


async def test_outbox_claim_is_exclusive_until_it_expires(store: Store) -> None:
    await store.submit(await new_job(store), T0)
    rows = await claim_at(store, "r1", T0)
    assert len(rows) == 1
    assert await claim_at(store, "r2", T0 + timedelta(seconds=1)) == []
    again = await claim_at(store, "r2", T0 + LEASE + timedelta(seconds=1))
    assert [r.id for r in again] == [rows[0].id]
    assert again[0].publish_attempts == 2


async def test_mark_published_sets_fact_and_event(store: Store) -> None:
    job_id, _ = await store.submit(await new_job(store), T0)
    rows = await claim_at(store, "r1", T0)
    assert await store.mark_published("r1", rows) == 1
    job = await store.get_job(job_id)
    assert job is not None and job.published and job.unpublished_since is None
    assert await store.outbox_backlog() == 0
    # Marking twice (a second relay that also published) changes nothing more.
    assert await store.mark_published("r2", rows) == 0


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


async def test_quarantine_keeps_reason(store: Store) -> None:
    job_id, _ = await store.submit(await new_job(store), T0)
    assert await store.quarantine(job_id, "invalid payload: x", T0, deliveryTag=1)
    job = await store.get_job(job_id)
    assert job is not None and job.state is JobState.QUARANTINED
    assert job.quarantine_reason == "invalid payload: x"
    events = await store.events(job_id)
    assert events[-1].kind == "quarantined" and events[-1].detail["deliveryTag"] == 1
