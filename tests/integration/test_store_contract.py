"""The store contract, run against SQLite and PostgreSQL alike."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta

import pytest

from jobrelay.domain.ids import job_id_for, request_hash
from jobrelay.domain.states import JobState
from jobrelay.errors import IdempotencyConflict
from jobrelay.storage.engine import create_engine
from jobrelay.storage.store import NewJob, Store

T0 = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
LEASE = timedelta(seconds=30)


@pytest.fixture
async def store(database_url: str) -> AsyncIterator[Store]:
    engine = create_engine(database_url)
    yield Store(engine)
    await engine.dispose()


def new_job(params: dict[str, str] | None = None, key: str | None = None) -> NewJob:
    params = params or {"accountId": "acme", "period": "2020-05"}
    return NewJob(
        job_id=job_id_for("acme", "report.export", params, key),
        type="report.export",
        account_id="acme",
        params=params,
        request_hash=request_hash("acme", "report.export", params),
        max_attempts=3,
        idempotency_key=key,
    )


async def test_submit_writes_job_outbox_and_event_together(store: Store) -> None:
    job_id, created = await store.submit(new_job(), T0)
    assert created
    job = await store.get_job(job_id)
    assert job is not None and job.state is JobState.QUEUED and job.attempt == 0
    assert job.published is False and job.unpublished_since == T0
    assert [e.kind for e in await store.events(job_id)] == ["accepted"]
    assert await store.outbox_backlog() == 1


async def test_repeat_submit_creates_nothing(store: Store) -> None:
    first, _ = await store.submit(new_job(), T0)
    again, created = await store.submit(new_job(), T0 + timedelta(seconds=5))
    assert (again, created) == (first, False)
    assert await store.outbox_backlog() == 1
    assert len(await store.events(first)) == 1


async def test_same_key_other_body_conflicts_and_changes_nothing(store: Store) -> None:
    await store.submit(new_job(key="k1"), T0)
    with pytest.raises(IdempotencyConflict):
        await store.submit(new_job({"accountId": "acme", "period": "2020-06"}, key="k1"), T0)
    assert await store.outbox_backlog() == 1


async def test_outbox_claim_is_exclusive_until_it_expires(store: Store) -> None:
    await store.submit(new_job(), T0)
    rows = await store.claim_outbox("r1", T0, 10, LEASE)
    assert len(rows) == 1
    assert await store.claim_outbox("r2", T0 + timedelta(seconds=1), 10, LEASE) == []
    again = await store.claim_outbox("r2", T0 + LEASE + timedelta(seconds=1), 10, LEASE)
    assert [r.id for r in again] == [rows[0].id]
    assert again[0].publish_attempts == 2


async def test_mark_published_sets_fact_and_event(store: Store) -> None:
    job_id, _ = await store.submit(new_job(), T0)
    rows = await store.claim_outbox("r1", T0, 10, LEASE)
    assert await store.mark_published("r1", rows, T0 + timedelta(seconds=1)) == 1
    job = await store.get_job(job_id)
    assert job is not None and job.published and job.unpublished_since is None
    assert await store.outbox_backlog() == 0
    # Marking twice (a second relay that also published) changes nothing more.
    assert await store.mark_published("r2", rows, T0 + timedelta(seconds=2)) == 0


async def test_release_keeps_row_waiting_with_error(store: Store) -> None:
    job_id, _ = await store.submit(new_job(), T0)
    rows = await store.claim_outbox("r1", T0, 10, LEASE)
    await store.release_outbox(rows[0], "unroutable", T0 + timedelta(seconds=2))
    job = await store.get_job(job_id)
    assert job is not None and not job.published and job.last_publish_error == "unroutable"
    assert await store.claim_outbox("r2", T0 + timedelta(seconds=1), 10, LEASE) == []
    assert len(await store.claim_outbox("r2", T0 + timedelta(seconds=3), 10, LEASE)) == 1


async def test_claim_increments_attempt_and_guards_live_lease(store: Store) -> None:
    job_id, _ = await store.submit(new_job(), T0)
    assert await store.claim_job(job_id, "w1", T0, LEASE) == 1
    assert await store.claim_job(job_id, "w2", T0 + timedelta(seconds=1), LEASE) is None
    assert await store.claim_job(job_id, "w2", T0 + LEASE, LEASE) == 2  # lease expired: taken over
    job = await store.get_job(job_id)
    assert job is not None and job.attempt == 2 and job.lease_owner == "w2"
    # The first worker lost its lease: its result is refused.
    assert not await store.complete(job_id, "w1", "k", {"rows": 1}, T0 + LEASE)


async def test_complete_then_nothing_moves_it(store: Store) -> None:
    job_id, _ = await store.submit(new_job(), T0)
    await store.claim_job(job_id, "w1", T0, LEASE)
    assert await store.complete(job_id, "w1", "exports/acme/x.csv", {"rows": 3}, T0)
    assert await store.claim_job(job_id, "w2", T0 + LEASE * 2, LEASE) is None
    assert not await store.quarantine(job_id, "bad", T0)
    job = await store.get_job(job_id)
    assert job is not None and job.state is JobState.SUCCEEDED
    assert job.result_key == "exports/acme/x.csv"
    assert [e.kind for e in await store.events(job_id)] == ["accepted", "claimed", "result_saved"]


async def test_retry_writes_outbox_row_and_waits_until_due(store: Store) -> None:
    job_id, _ = await store.submit(new_job(), T0)
    await store.claim_job(job_id, "w1", T0, LEASE)
    assert await store.schedule_retry(job_id, "w1", "report.export", "boom", 5, T0)
    job = await store.get_job(job_id)
    assert job is not None and job.state is JobState.RETRY_WAIT and job.last_error == "boom"
    assert job.next_attempt_at == T0 + timedelta(seconds=5)
    rows = await store.claim_outbox("r", T0, 10, LEASE)
    assert sorted(r.destination for r in rows) == ["retry.5s", "work"]
    assert await store.claim_job(job_id, "w2", T0 + timedelta(seconds=2), LEASE) is None
    assert await store.claim_job(job_id, "w2", T0 + timedelta(seconds=5), LEASE) == 2


async def test_attempt_budget_is_enforced_in_sql(store: Store) -> None:
    job_id, _ = await store.submit(new_job(), T0)
    for i in range(3):
        assert await store.claim_job(job_id, f"w{i}", T0 + LEASE * i, LEASE) == i + 1
    assert await store.claim_job(job_id, "w9", T0 + LEASE * 10, LEASE) is None


async def test_quarantine_keeps_reason(store: Store) -> None:
    job_id, _ = await store.submit(new_job(), T0)
    assert await store.quarantine(job_id, "invalid payload: x", T0, deliveryTag=1)
    job = await store.get_job(job_id)
    assert job is not None and job.state is JobState.QUARANTINED
    assert job.quarantine_reason == "invalid payload: x"
    events = await store.events(job_id)
    assert events[-1].kind == "quarantined" and events[-1].detail["deliveryTag"] == 1
