"""Migration 0009 (``local_messages.dead_lettered_at``) down and up again on SQLite and
PostgreSQL: the messages already in the local quarantine queue get the migration's time, so
retention keeps each of them one full period from the upgrade; waiting messages get none."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime

from alembic import command
from sqlalchemy import insert, select, text

from jobrelay.storage.engine import alembic_config, create_engine, upgrade
from jobrelay.storage.tables import local_messages

from .api_fixtures import T0


async def _insert_as_0008(url: str) -> None:
    """Two rows as the code of revision 0008 wrote them (no ``dead_lettered_at``)."""
    engine = create_engine(url)
    try:
        async with engine.begin() as conn:
            for queue in ("quarantine", "work"):
                await conn.execute(
                    text(
                        "INSERT INTO local_messages (queue, body, headers, available_at, "
                        "delivery_count, created_at) VALUES (:q, '{}', '{}', :t, 0, :t)"
                    ),
                    {"q": queue, "t": T0.replace(tzinfo=None) if "sqlite" in url else T0},
                )
    finally:
        await engine.dispose()


async def _dead_lettered(url: str) -> dict[str, datetime | None]:
    engine = create_engine(url)
    try:
        async with engine.connect() as conn:
            rows = await conn.execute(
                select(local_messages.c.queue, local_messages.c.dead_lettered_at)
            )
            return {r.queue: r.dead_lettered_at for r in rows}
    finally:
        await engine.dispose()


async def _insert_now(url: str) -> None:
    engine = create_engine(url)
    try:
        async with engine.begin() as conn:
            await conn.execute(
                insert(local_messages).values(
                    queue="work", body="{}", headers={}, available_at=T0, created_at=T0
                )
            )
    finally:
        await engine.dispose()


def test_0009_stamps_the_dead_letters_already_there_and_goes_down_again(database_url: str) -> None:
    command.downgrade(alembic_config(database_url), "0008")
    asyncio.run(_insert_as_0008(database_url))
    before = datetime.now(UTC)

    upgrade(database_url)

    stamped = asyncio.run(_dead_lettered(database_url))
    assert stamped["work"] is None
    assert stamped["quarantine"] is not None and stamped["quarantine"] >= before
    command.downgrade(alembic_config(database_url), "0008")
    upgrade(database_url)
    asyncio.run(_insert_now(database_url))  # the table is whole again after down and up
