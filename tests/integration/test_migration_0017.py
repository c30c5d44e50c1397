"""Migration 0017 (``outbox.awaiting_admission``) down and up again on SQLite and PostgreSQL:
the rows written before it for a job that waits for its limits are flagged (no relay sends
them before their admission); a row of an admitted job, of a job under no limits, or already
published is not. The relay's partial index is rebuilt on the flag."""

from __future__ import annotations

import asyncio

from alembic import command
from sqlalchemy import select, text

from jobrelay.storage.engine import alembic_config, create_engine, upgrade
from jobrelay.storage.tables import outbox

from .api_fixtures import T0

_JOBS = {
    # job id: (limits, admitted, published)
    "waits": ("[]", False, False),
    "admitted": ("[]", True, False),
    "free": (None, False, False),
    "sent": ("[]", False, True),
}


async def _insert_as_0016(url: str) -> None:
    """A job and its outbox row of each kind, as the code of revision 0016 wrote them."""
    at = T0.replace(tzinfo=None) if "sqlite" in url else T0
    engine = create_engine(url)
    try:
        async with engine.begin() as conn:
            for job_id, (limits, admitted, published) in _JOBS.items():
                await conn.execute(
                    text(
                        "INSERT INTO jobs (id, type, params, request_hash, state, attempt,"
                        " max_attempts, queue, created_at, updated_at, limits, admitted_at)"
                        " VALUES (:id, 'lab.x', '{}', 'h', 'queued', 0, 3, 'default', :t, :t,"
                        " :limits, :admitted)"
                    ),
                    {"id": job_id, "t": at, "limits": limits, "admitted": at if admitted else None},
                )
                await conn.execute(
                    text(
                        "INSERT INTO outbox (job_id, destination, body, headers, created_at,"
                        " published_at) VALUES (:id, 'work', '{}', '{}', :t, :published)"
                    ),
                    {"id": job_id, "t": at, "published": at if published else None},
                )
    finally:
        await engine.dispose()


async def _flags(url: str) -> dict[str, bool]:
    engine = create_engine(url)
    try:
        async with engine.connect() as conn:
            rows = await conn.execute(select(outbox.c.job_id, outbox.c.awaiting_admission))
            return {r.job_id: bool(r.awaiting_admission) for r in rows}
    finally:
        await engine.dispose()


def test_0017_flags_the_rows_that_wait_for_admission_and_goes_down_again(
    database_url: str,
) -> None:
    command.downgrade(alembic_config(database_url), "0016")
    asyncio.run(_insert_as_0016(database_url))

    upgrade(database_url)

    expected = {"waits": True, "admitted": False, "free": False, "sent": False}
    assert asyncio.run(_flags(database_url)) == expected
    command.downgrade(alembic_config(database_url), "0016")
    upgrade(database_url)
    assert asyncio.run(_flags(database_url)) == expected  # down and up again: the same
