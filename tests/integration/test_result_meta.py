"""A job's own result metadata cannot overwrite ``result_saved``'s fields (issue 21, item 10).

The event used to be ``{"resultKey", "worker", **meta}``: a job returning ``{"worker": …}``
or ``{"resultKey": …}`` rewrote who saved what. The metadata now sits under ``meta``, on the
one-job completion (SQLite and PostgreSQL) and on the batched one (PostgreSQL).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from jobrelay.domain.ids import request_hash
from jobrelay.storage.engine import create_engine
from jobrelay.storage.store import CompleteRequest, NewJob, Store
from tests.id_keys import request_id

T0 = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
LEASE = timedelta(seconds=30)
# What a job may return about its result; its keys collide with the event's own.
HOSTILE = {
    "worker": "not-the-worker",
    "resultKey": "not/the/key",
    "attempt": 99,
    "rows": 2,
    "note": "mine",
}


@pytest.fixture
async def store(database_url: str) -> AsyncIterator[Store]:
    engine = create_engine(database_url)
    yield Store(engine)
    await engine.dispose()


async def claimed(store: Store, period: str) -> Any:
    params = {"accountId": "acme", "period": period}
    job = NewJob(
        job_id=await request_id(store, "acme", params),
        type="report.export",
        account_id="acme",
        params=params,
        request_hash=request_hash("acme", "report.export", params),
        max_attempts=3,
    )
    job_id, _ = await store.submit(job, T0)
    claim = await store.claim_job(job_id, "host-w:1:abcdef", T0, LEASE)
    assert claim is not None
    return claim


async def saved(store: Store, job_id: str) -> dict[str, Any]:
    [event] = [e for e in await store.events(job_id) if e.kind == "result_saved"]
    return dict(event.detail)


def the_worker_s_meta(attempt: int) -> dict[str, Any]:
    """The operation's meta as the worker sends it: as the operation gave it (the worker
    once added the attempt to it; the claim's attempt is the event's own field)."""
    return dict(HOSTILE)


async def test_user_meta_stays_under_its_own_key(store: Store) -> None:
    claim = await claimed(store, "2020-05")
    meta = the_worker_s_meta(claim.attempt)
    assert (await store.complete(claim, "exports/acme/x.csv", meta, T0)).won
    detail = await saved(store, claim.job_id)
    assert detail["worker"] == "host-w:1:abcdef"
    assert detail["resultKey"] == "exports/acme/x.csv"
    assert detail["attempt"] == claim.attempt == 1
    assert detail["meta"] == HOSTILE
    job = await store.get_job(claim.job_id)
    assert job.result_key == "exports/acme/x.csv" and job.result_meta["note"] == "mine"


async def test_the_batched_completion_keeps_it_there_too(pg_url: str) -> None:
    engine = create_engine(pg_url)
    try:
        store = Store(engine)
        claim = await claimed(store, "2020-06")
        request = CompleteRequest(claim, "exports/acme/y.csv", the_worker_s_meta(claim.attempt))
        assert await store.complete_many([request], T0) == {claim.job_id}
        detail = await saved(store, claim.job_id)
        assert (detail["worker"], detail["resultKey"]) == ("host-w:1:abcdef", "exports/acme/y.csv")
        assert detail["meta"] == HOSTILE and detail["attempt"] == 1
    finally:
        await engine.dispose()
