"""Fan-in under real concurrency on PostgreSQL (issue 37, item 2): two stores on two engines,
so each write is its own backend, racing for real (no mocks).

- Two parts of one total completing at the same instant release it exactly once: one
  ``dependencies_met``, one outbox row.
- A total enqueued while its only part completes is never stranded ``waiting``: whichever
  commits second saw the first (``storage.dependencies``).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import func, select

from jobrelay.domain.states import JobState
from jobrelay.storage.engine import create_engine
from jobrelay.storage.records import ClaimRequest, NewJob
from jobrelay.storage.store import Store
from jobrelay.storage.tables import job_events, outbox

pytestmark = pytest.mark.timeout(120)

LEASE = timedelta(seconds=30)
ROUNDS = 25


@pytest.fixture
async def stores(pg_url: str) -> AsyncIterator[tuple[Store, Store]]:
    first, second = Store(create_engine(pg_url)), Store(create_engine(pg_url))
    try:
        yield first, second
    finally:
        await first.engine.dispose()
        await second.engine.dispose()


def _job(job_id: str, after: tuple[str, ...] = ()) -> NewJob:
    return NewJob(
        job_id=job_id,
        type="lab.part" if not after else "lab.total",
        account_id=None,
        params={},
        request_hash=job_id,
        max_attempts=3,
        after=after,
    )


async def _claim(store: Store, job_id: str, worker: str) -> Any:
    [claimed] = await store.claim_many(
        [ClaimRequest(job_id, None, worker, {})], datetime.now(UTC), LEASE
    )
    assert claimed is not None
    return claimed[0]


async def _released(store: Store, job_id: str) -> tuple[JobState, int, int]:
    job = await store.get_job(job_id)
    assert job is not None
    async with store.reading() as conn:
        messages = await conn.scalar(
            select(func.count()).select_from(outbox).where(outbox.c.job_id == job_id)
        )
        met = await conn.scalar(
            select(func.count())
            .select_from(job_events)
            .where(job_events.c.job_id == job_id, job_events.c.kind == "dependencies_met")
        )
    return job.state, int(messages or 0), int(met or 0)


async def test_two_parts_completing_at_once_release_the_total_once(
    stores: tuple[Store, Store],
) -> None:
    one, two = stores
    for n in range(ROUNDS):
        a, b, t = f"a-{n}", f"b-{n}", f"t-{n}"
        now = datetime.now(UTC)
        for job_id in (a, b):
            await one.submit(_job(job_id), now)
        await one.submit(_job(t, after=(a, b)), now)
        claim_a, claim_b = await _claim(one, a, "w1"), await _claim(two, b, "w2")
        done = await asyncio.gather(
            one.complete(claim_a, None, {}, datetime.now(UTC)),
            two.complete(claim_b, None, {}, datetime.now(UTC)),
        )
        assert all(d.won for d in done)
        assert await _released(one, t) == (JobState.QUEUED, 1, 1), n


async def test_a_total_enqueued_while_its_part_completes_is_never_stranded(
    stores: tuple[Store, Store],
) -> None:
    one, two = stores
    for n in range(ROUNDS):
        a, t = f"a-{n}", f"t-{n}"
        await one.submit(_job(a), datetime.now(UTC))
        claim = await _claim(one, a, "w1")

        async def enqueue(job_id: str = t, part: str = a) -> None:
            await asyncio.sleep(random.uniform(0, 0.004))
            await two.submit(_job(job_id, after=(part,)), datetime.now(UTC))

        async def complete(claim: Any = claim) -> None:
            await asyncio.sleep(random.uniform(0, 0.004))
            assert (await one.complete(claim, None, {}, datetime.now(UTC))).won

        await asyncio.gather(enqueue(), complete())
        assert await _released(one, t) == (JobState.QUEUED, 1, 1), n


async def test_an_enqueue_after_a_waiting_job_and_its_dependency_never_deadlocks_an_end(
    stores: tuple[Store, Store],
) -> None:
    """Found in review: the enqueue locked its dependencies in id order, the waiting one (W)
    before the one it waits for (A), while A's completion held A and counted W down: a
    ``deadlock detected``. Now the enqueue locks the jobs that wait for nothing first."""
    one, two = stores
    for n in range(ROUNDS):
        a, w, t = f"z-a-{n}", f"a-w-{n}", f"m-t-{n}"  # w < a < t by id
        await one.submit(_job(a), datetime.now(UTC))
        await one.submit(_job(w, after=(a,)), datetime.now(UTC))
        claim = await _claim(one, a, "w1")

        async def enqueue(job_id: str = t, deps: tuple[str, ...] = (w, a)) -> None:
            await asyncio.sleep(random.uniform(0, 0.004))
            await two.submit(_job(job_id, after=deps), datetime.now(UTC))

        async def complete(claim: Any = claim) -> None:
            await asyncio.sleep(random.uniform(0, 0.004))
            assert (await one.complete(claim, None, {}, datetime.now(UTC))).won

        await asyncio.gather(enqueue(), complete())
        assert await _released(one, w) == (JobState.QUEUED, 1, 1), n
        total = await one.get_job(t)
        assert total is not None and (total.state, total.waiting_for) == (JobState.WAITING, 1)


async def test_a_cancel_cascade_and_a_completion_never_deadlock(
    stores: tuple[Store, Store],
) -> None:
    """Found in review: W waits for A and B, V (below W by id) for B and W. A quarantined
    (holds W, then V in its cascade) while B completes (holds V, then W): each end now locks
    every waiting job it can reach, in id order, before counting any down."""
    one, two = stores
    for n in range(ROUNDS):
        a, b, w, v = f"a-{n}", f"b-{n}", f"w-{n}", f"v-{n}"  # v < w
        now = datetime.now(UTC)
        for job_id in (a, b):
            await one.submit(_job(job_id), now)
        await one.submit(_job(w, after=(a, b)), now)
        await one.submit(_job(v, after=(b, w)), now)
        claim_a, claim_b = await _claim(one, a, "w1"), await _claim(two, b, "w2")

        async def fail(claim: Any = claim_a) -> None:
            await asyncio.sleep(random.uniform(0, 0.004))
            assert await one.quarantine(claim.job_id, "no", datetime.now(UTC), claim=claim)

        async def succeed(claim: Any = claim_b) -> None:
            await asyncio.sleep(random.uniform(0, 0.004))
            assert (await two.complete(claim, None, {}, datetime.now(UTC))).won

        await asyncio.gather(fail(), succeed())
        for job_id in (w, v):
            job = await one.get_job(job_id)
            assert job is not None and job.state is JobState.CANCELLED, (n, job_id, job)
