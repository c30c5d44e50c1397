"""Migrations keep what is there: 0003 (jobs without an account) on a database with data.

On SQLite, 0003 rebuilds the ``jobs`` table (batch mode). With foreign keys on, dropping the
old table would cascade into every outbox row, event and effects-ledger row of every job, so
the migration must run with them off; this test would lose those rows otherwise.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from sqlalchemy import func, select

from jobrelay.storage.engine import create_engine, upgrade
from jobrelay.storage.store import NewJob, Store
from jobrelay.storage.tables import job_events, jobs, outbox

from .api_fixtures import T0


async def _counts(url: str) -> tuple[int, int, int]:
    engine = create_engine(url)
    try:
        async with engine.connect() as conn:
            return (
                int(await conn.scalar(select(func.count()).select_from(jobs)) or 0),
                int(await conn.scalar(select(func.count()).select_from(outbox)) or 0),
                int(await conn.scalar(select(func.count()).select_from(job_events)) or 0),
            )
    finally:
        await engine.dispose()


async def _submit(url: str, account: str | None, job_id: str) -> None:
    engine = create_engine(url)
    try:
        await Store(engine).submit(
            NewJob(
                job_id=job_id,
                type="report.export",
                account_id=account,
                params={"accountId": "acme", "period": "2020-05"},
                request_hash=job_id,
                max_attempts=3,
            ),
            T0,
        )
    finally:
        await engine.dispose()


def test_0003_keeps_every_row_and_allows_jobs_without_an_account(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/old.db"
    upgrade(url, "0002")
    asyncio.run(_submit(url, "acme", "00000000-0000-4000-8000-000000000001"))
    before = asyncio.run(_counts(url))
    assert before == (1, 1, 1)

    upgrade(url)
    assert asyncio.run(_counts(url)) == before
    asyncio.run(_submit(url, None, "00000000-0000-4000-8000-000000000002"))
    assert asyncio.run(_counts(url)) == (2, 2, 2)
