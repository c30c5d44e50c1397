"""Cancelling a delayed job at its due time, while the relay publishes it (issue 34, item 8).

The relay's mark of a published row takes the outbox row's lock and then, for its
``published`` event (a foreign key to ``jobs``), a key-share lock on the job's row. A cancel
that locked the job ``FOR UPDATE`` and then went for the same outbox row (to drop the held
message) waited for the relay while the relay waited for it: PostgreSQL killed one of them
("deadlock detected"), and the API answered 503 "database unavailable; nothing was changed".
Here the interleaving is made explicit, with the relay's own statements in one transaction:
the relay holds the row, the cancel starts and waits, the relay marks. The cancel must lock
as the worker's batches do (``FOR NO KEY UPDATE``), so both commit.

And a bulk cancel that changed some jobs before the database went away must not answer
"nothing was changed": its 503 names the jobs it changed and the one whose outcome is unknown.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select, text

from jobrelay.errors import StoreError
from jobrelay.runtime.wiring import Runtime
from jobrelay.storage.admin import AdminQueries
from jobrelay.storage.drivers.pg_statements import CLAIM_OUTBOX, MARK_PUBLISHED
from jobrelay.storage.tables import outbox

from .api_fixtures import api_client, bearer, build_runtime, make_token
from .ops_fixtures import new_job

pytestmark = pytest.mark.timeout(90)


@pytest.fixture
async def pg_runtime(pg_url: str, tmp_path: Path) -> AsyncIterator[Runtime]:
    rt = build_runtime(pg_url, tmp_path)
    yield rt
    await rt.engine.dispose()


async def due_delayed_job(rt: Runtime) -> str:
    """A delayed job whose run time has come: its outbox row is held (``available_at``) and
    due by any clock."""
    job = await new_job(rt.store, run_at=rt.clock() - timedelta(days=1))
    job_id, created = await rt.store.submit(job, rt.clock())
    assert created
    return job_id


async def waiting_on_a_lock(rt: Runtime, timeout: float = 30) -> None:
    """Until a backend of this database waits for a row lock (the cancel, behind the relay)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        async with rt.engine.connect() as conn:
            waiting = await conn.scalar(
                text(
                    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                    " AND wait_event_type = 'Lock'"
                )
            )
        if waiting:
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the cancel never waited for the relay's lock")


@pytest.mark.postgres
async def test_a_cancel_racing_the_relays_mark_of_a_due_delayed_job_does_not_deadlock(
    pg_runtime: Runtime, caplog: pytest.LogCaptureFixture
) -> None:
    rt = pg_runtime
    job_id = await due_delayed_job(rt)
    admin = await make_token(rt, None, admin=True)
    relay_error: BaseException | None = None
    async with api_client(rt) as client, rt.engine.connect() as relay:
        # The relay's claim, in a transaction kept open: the row's lock stays held, as it is
        # between the first and the last lock of the relay's one mark statement.
        tx = await relay.begin()
        claim = {
            "o_relay": "relay:test",
            "o_limit": 10,
            "o_claim_for": timedelta(seconds=30),
            "o_clock": None,
        }
        rows = (await relay.execute(CLAIM_OUTBOX.statement, claim)).mappings().all()
        assert [r["job_id"] for r in rows] == [job_id]
        cancel = asyncio.create_task(
            client.post(
                f"/v1/jobs/{job_id}/cancel", json={"reason": "not wanted"}, headers=bearer(admin)
            )
        )
        await waiting_on_a_lock(rt)
        # The relay's mark: the row again (held already), then the ``published`` event.
        mark = {
            "m_ids": [rows[0]["id"]],
            "m_taken": [rows[0]["taken_at"]],
            "m_relay": "relay:test",
            "m_clock": None,
        }
        try:
            marked = (await relay.execute(MARK_PUBLISHED.statement, mark)).scalar_one()
            await tx.commit()
        except Exception as exc:
            relay_error = exc
            await tx.rollback()
        response = await asyncio.wait_for(cancel, timeout=60)
    assert relay_error is None, f"the relay's mark failed: {relay_error}"
    assert marked == 1
    why = [getattr(r, "reason", "") for r in caplog.records if hasattr(r, "dependency")]
    assert response.status_code == 200, f"{response.text} ({why})"
    assert response.json()["state"] == "cancelled"
    job = await rt.store.get_job(job_id)
    assert job is not None and job.state.value == "cancelled"
    # The message went out before the cancel: its row stays, published; the worker that
    # receives it finds the job cancelled and acks it unworked.
    async with rt.store.reading() as conn:
        published = (
            (await conn.execute(select(outbox.c.published_at).where(outbox.c.job_id == job_id)))
            .scalars()
            .all()
        )
    assert len(published) == 1 and published[0] is not None


@pytest.fixture
async def runtime(database_url: str, tmp_path: Path) -> AsyncIterator[Runtime]:
    rt = build_runtime(database_url, tmp_path)
    yield rt
    await rt.engine.dispose()


async def test_a_bulk_cancel_cut_short_by_an_outage_says_which_jobs_it_changed(
    runtime: Runtime, monkeypatch: pytest.MonkeyPatch
) -> None:
    rt = runtime
    jobs = []
    for month in range(1, 6):
        job_id, _ = await rt.store.submit(await new_job(rt.store, f"2020-{month:02}"), rt.clock())
        jobs.append(job_id)
    real_cancel = AdminQueries.cancel
    calls: list[str] = []

    async def cancel_until_the_outage(self: AdminQueries, job_id: str, **kw: Any) -> Any:
        calls.append(job_id)
        if len(calls) == 3:  # the database goes away during the third job's cancel
            raise StoreError("database write failed: connection was closed in the middle")
        return await real_cancel(self, job_id, **kw)

    monkeypatch.setattr(AdminQueries, "cancel", cancel_until_the_outage)
    admin = await make_token(rt, None, admin=True)
    async with api_client(rt) as client:
        response = await client.post(
            "/v1/bulk/cancel",
            json={"reason": "wrong batch", "limit": 10, "filter": {"state": "queued"}},
            headers=bearer(admin),
        )
    assert response.status_code == 503, response.text
    problem = response.json()
    assert "nothing was changed" not in problem["detail"]
    changed, unknown = calls[:2], calls[2]
    assert problem["jobIds"] == changed
    assert problem["outcomeUnknown"] == [unknown]
    assert problem["notAttempted"] == 2
    assert isinstance(problem["before"], int)
    assert "2 jobs were cancelled" in problem["detail"]
    for job_id in changed:
        job = await rt.store.get_job(job_id)
        assert job is not None and job.state.value == "cancelled"
    for job_id in set(jobs) - set(changed):
        job = await rt.store.get_job(job_id)
        assert job is not None and job.state.value == "queued"
