"""Migration 0007 (periodic schedules) down and up again on SQLite and PostgreSQL, with the
jobs that were there kept, and the new tables usable by a scheduler afterwards."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

from alembic import command
from sqlalchemy import inspect

from jobrelay.maintenance.scheduler import Scheduler
from jobrelay.storage.engine import alembic_config, create_engine, upgrade

from .api_fixtures import T0, Clock, build_runtime
from .test_migrations import _counts, _submit
from .test_schedules import app, tick_jobs


async def _tables(url: str) -> set[str]:
    engine = create_engine(url)
    try:
        async with engine.connect() as conn:
            return set(await conn.run_sync(lambda sync: inspect(sync).get_table_names()))
    finally:
        await engine.dispose()


async def _one_tick(url: str, tmp_path: Path) -> int:
    clock = Clock(T0)
    rt = dataclasses.replace(build_runtime(url, tmp_path, clock=clock), app=app)
    try:
        scheduler = Scheduler(rt)
        await scheduler.run_once()
        clock.advance(60)
        await scheduler.run_once()
        return len(await tick_jobs(rt))
    finally:
        await rt.engine.dispose()


def test_0007_down_and_up_keeps_jobs_and_schedules_work(database_url: str, tmp_path: Path) -> None:
    asyncio.run(_submit(database_url, "acme", "00000000-0000-4000-8000-000000000007"))
    assert {"schedules", "schedule_events"} <= asyncio.run(_tables(database_url))
    assert asyncio.run(_one_tick(database_url, tmp_path)) == 1

    command.downgrade(alembic_config(database_url), "0006")
    assert not {"schedules", "schedule_events"} & asyncio.run(_tables(database_url))
    assert asyncio.run(_counts(database_url))[0] == 2  # the job and the tick's job

    upgrade(database_url)
    assert {"schedules", "schedule_events"} <= asyncio.run(_tables(database_url))
    assert asyncio.run(_counts(database_url))[0] == 2
