"""``enqueue_many`` (issue 37, item 3): many jobs of one type in the caller's transaction, in
statements of many rows, not one round trip per job; on both databases, async and sync.

Counted with SQLAlchemy's own ``before_cursor_execute`` event on the engine: the statements
really sent, whatever the driver.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from datetime import timedelta
from typing import Any

import pytest
from pydantic import BaseModel
from sqlalchemy import Engine, event, func, select
from sqlalchemy import create_engine as create_sync_engine
from sqlalchemy.ext.asyncio import AsyncEngine

import jobrelay
from jobrelay.storage.engine import async_url
from jobrelay.storage.tables import job_events, jobs, outbox

pytestmark = pytest.mark.timeout(120)

N = 1_200  # more than two statements' worth of rows


class Item(BaseModel):
    i: int


app = jobrelay.App()


@app.job("lab.item", params=Item)
async def item(ctx: jobrelay.JobContext[Item], p: Item) -> Any:
    return p.i


@pytest.fixture
async def engine(database_url: str) -> AsyncIterator[AsyncEngine]:
    engine = jobrelay.create_engine(database_url)
    yield engine
    await engine.dispose()


@pytest.fixture
def sync_engine(database_url: str) -> Iterator[Engine]:
    url = async_url(database_url)
    driver = "postgresql+psycopg" if url.get_backend_name() == "postgresql" else "sqlite"
    engine = create_sync_engine(url.set(drivername=driver))
    yield engine
    engine.dispose()


def _counting(engine: Engine) -> list[str]:
    sent: list[str] = []
    event.listen(engine, "before_cursor_execute", lambda *a: sent.append(a[2]))
    return sent


async def _counts(engine: AsyncEngine) -> tuple[int, int, int]:
    async with engine.connect() as conn:
        return (
            int(await conn.scalar(select(func.count()).select_from(jobs)) or 0),
            int(await conn.scalar(select(func.count()).select_from(outbox)) or 0),
            int(
                await conn.scalar(
                    select(func.count())
                    .select_from(job_events)
                    .where(job_events.c.kind == "accepted")
                )
                or 0
            ),
        )


async def test_many_jobs_are_written_in_a_few_statements_with_their_ids_in_order(
    engine: AsyncEngine,
) -> None:
    sent = _counting(engine.sync_engine)
    async with engine.begin() as conn:
        ids = await item.enqueue_many(conn, [Item(i=i) for i in range(N)])
    written = list(sent)
    assert len(ids) == N == len(set(ids))
    assert await _counts(engine) == (N, N, N)
    # Three statements per 500 rows (jobs, outbox, events), a BEGIN and a NOTIFY: not one
    # round trip per job.
    assert len(written) <= 3 * 3 + 2, [s[:30] for s in written]
    async with engine.connect() as conn:
        rows = dict((await conn.execute(select(jobs.c.id, jobs.c.params))).all())
    assert [rows[i]["i"] for i in ids] == list(range(N))


async def test_keys_make_each_job_idempotent_and_a_reused_key_conflicts(
    engine: AsyncEngine,
) -> None:
    keys = [f"k-{i}" for i in range(10)]
    async with engine.begin() as conn:
        first = await item.enqueue_many(conn, [{"i": i} for i in range(10)], keys=keys)
    async with engine.begin() as conn:
        again = await item.enqueue_many(conn, [{"i": i} for i in range(10)], keys=keys)
    assert again == first
    assert await _counts(engine) == (10, 10, 10)
    with pytest.raises(jobrelay.IdempotencyConflict):
        async with engine.begin() as conn:
            await item.enqueue_many(conn, [{"i": 99}], keys=["k-3"])
    assert await _counts(engine) == (10, 10, 10)


async def test_one_bad_params_refuses_the_batch_naming_its_index(engine: AsyncEngine) -> None:
    batch: list[Any] = [{"i": 1}, {"i": 2}, {"i": "three"}]
    with pytest.raises(jobrelay.InvalidParams, match=r"\[2\]\.i"):
        async with engine.begin() as conn:
            await item.enqueue_many(conn, batch)
    assert await _counts(engine) == (0, 0, 0)
    with pytest.raises(jobrelay.ConfigError, match="one per job"):
        async with engine.begin() as conn:
            await item.enqueue_many(conn, [{"i": 1}], keys=["a", "b"])


async def test_a_delay_and_after_apply_to_every_job(engine: AsyncEngine) -> None:
    async with engine.begin() as conn:
        first = await item.enqueue(conn, {"i": 0})
        held = await item.enqueue_many(conn, [{"i": 1}, {"i": 2}], delay=timedelta(minutes=5))
        waiting = await item.enqueue_many(conn, [{"i": 3}, {"i": 4}], after=[first])
    async with engine.connect() as conn:
        states = dict((await conn.execute(select(jobs.c.id, jobs.c.state))).all())
        due = dict((await conn.execute(select(outbox.c.job_id, outbox.c.available_at))).all())
    assert all(due[i] is not None for i in held)
    assert [states[i] for i in waiting] == ["waiting", "waiting"]


def test_the_sync_twin_writes_the_same_rows(sync_engine: Engine) -> None:
    sent = _counting(sync_engine)
    with sync_engine.begin() as conn:
        ids = item.enqueue_many_sync(conn, [Item(i=i) for i in range(N)])
    assert len(set(ids)) == N
    assert len(sent) <= 3 * 3 + 2, [s[:30] for s in sent]
    with sync_engine.connect() as conn:
        assert conn.scalar(select(func.count()).select_from(outbox)) == N
