"""Migrations keep what is there: 0003 (jobs without an account), 0004 (job queues), 0005
(retention: tombstones, autovacuum settings on PostgreSQL), 0012 (the last failure's
traceback), 0013 (delayed jobs) and 0014 (a running job's cancel request) on a database
with data.

On SQLite, 0003 rebuilds the ``jobs`` table (batch mode). With foreign keys on, dropping the
old table would cascade into every outbox row, event and effects-ledger row of every job, so
the migration must run with them off; this test would lose those rows otherwise.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta
from pathlib import Path
from typing import Any

from alembic import command
from sqlalchemy import func, insert, inspect, select, text

from jobrelay.storage.engine import alembic_config, create_engine, upgrade
from jobrelay.storage.store import NewJob, Store
from jobrelay.storage.tables import JobId, job_events, jobs, metadata, outbox

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


async def _insert_old(url: str, account: str, job_id: str, *, job: bool = True) -> None:
    """A job as the code of revision 0002 wrote it: its columns only (no ``queue``). Without
    ``job``: its outbox row and event only, as if the job were gone."""
    engine = create_engine(url)
    try:
        async with engine.begin() as conn:
            if job:
                await conn.execute(
                    insert(jobs).values(
                        id=job_id,
                        type="report.export",
                        account_id=account,
                        params={"accountId": "acme", "period": "2020-05"},
                        request_hash=job_id,
                        state="queued",
                        attempt=0,
                        max_attempts=3,
                        created_at=T0,
                        updated_at=T0,
                    )
                )
            await conn.execute(
                insert(outbox).values(
                    job_id=job_id, destination="work", body="{}", headers={}, created_at=T0
                )
            )
            await conn.execute(
                insert(job_events).values(job_id=job_id, at=T0, kind="accepted", detail={})
            )
    finally:
        await engine.dispose()


async def _queue_of(url: str, job_id: str) -> str | None:
    engine = create_engine(url)
    try:
        async with engine.connect() as conn:
            return await conn.scalar(select(jobs.c.queue).where(jobs.c.id == job_id))
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


async def _job(url: str, job_id: str) -> Any:
    engine = create_engine(url)
    try:
        return await Store(engine).get_job(job_id)
    finally:
        await engine.dispose()


def test_0003_and_0004_keep_every_row_and_allow_jobs_without_an_account(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/old.db"
    upgrade(url, "0002")
    old = "00000000-0000-4000-8000-000000000001"
    asyncio.run(_insert_old(url, "acme", old))
    before = asyncio.run(_counts(url))
    assert before == (1, 1, 1)

    upgrade(url)
    assert asyncio.run(_counts(url)) == before
    assert asyncio.run(_queue_of(url, old)) == "default"  # 0004: on the default queue
    asyncio.run(_submit(url, None, "00000000-0000-4000-8000-000000000002"))
    assert asyncio.run(_counts(url)) == (2, 2, 2)


async def _reloptions(url: str) -> dict[str, list[str] | None]:
    engine = create_engine(url)
    try:
        async with engine.connect() as conn:
            rows = await conn.execute(
                text(
                    "SELECT relname, reloptions FROM pg_class WHERE relname IN "
                    "('outbox', 'local_messages', 'jobs', 'job_events', 'pruned_jobs')"
                )
            )
            return {r.relname: r.reloptions for r in rows}
    finally:
        await engine.dispose()


def test_0005_keeps_every_row_and_tunes_autovacuum_on_postgres(
    database_url: str, tmp_path: Path
) -> None:
    # Back to 0004 (the fixture's database is at head), a job as it was, then 0005 again.
    command.downgrade(alembic_config(database_url), "0004")
    if database_url.startswith("postgresql"):
        assert all(not options for options in asyncio.run(_reloptions(database_url)).values())
    asyncio.run(_submit(database_url, "acme", "00000000-0000-4000-8000-000000000001"))

    upgrade(database_url)

    assert asyncio.run(_counts(database_url)) == (1, 1, 1)
    if database_url.startswith("postgresql"):
        options = asyncio.run(_reloptions(database_url))
        assert "autovacuum_vacuum_scale_factor=0.01" in (options["outbox"] or [])
        assert "autovacuum_vacuum_scale_factor=0.01" in (options["local_messages"] or [])
        assert "autovacuum_vacuum_scale_factor=0.02" in (options["jobs"] or [])
        assert "autovacuum_vacuum_scale_factor=0.02" in (options["job_events"] or [])
        assert "pruned_jobs" in options


def test_the_schema_head_the_code_expects_is_the_newest_migration(tmp_path: Path) -> None:
    """``SCHEMA_HEAD`` is what every process checks the database against at start-up (without
    importing Alembic); it must be the head of the migration scripts, or every process would
    refuse a freshly migrated database (or run on an old one)."""
    from alembic.script import ScriptDirectory

    from jobrelay.runtime.wiring import schema_revision
    from jobrelay.storage.engine import SCHEMA_HEAD

    url = f"sqlite:///{tmp_path}/jr.db"
    head = ScriptDirectory.from_config(alembic_config(url)).get_current_head()
    assert head == SCHEMA_HEAD
    upgrade(url)

    async def current() -> str | None:
        engine = create_engine(url)
        try:
            return await schema_revision(engine)
        finally:
            await engine.dispose()

    assert asyncio.run(current()) == SCHEMA_HEAD


def test_0012_adds_the_last_traceback_to_the_jobs_there_and_goes_down_again(
    database_url: str,
) -> None:
    command.downgrade(alembic_config(database_url), "0011")
    job_id = "00000000-0000-4000-8000-000000000001"
    asyncio.run(_insert_old(database_url, "acme", job_id))

    upgrade(database_url)

    async def fail_with_traceback() -> tuple[str | None, str | None]:
        engine = create_engine(database_url)
        try:
            store = Store(engine)
            before = await store.get_job(job_id)
            assert before is not None
            claim = await store.claim_job(job_id, "w", T0, timedelta(seconds=30))
            assert claim is not None
            assert await store.quarantine(job_id, "boom", T0, claim=claim, traceback="tb\n")
            after = await store.get_job(job_id)
            assert after is not None
            return before.last_traceback, after.last_traceback
        finally:
            await engine.dispose()

    assert asyncio.run(fail_with_traceback()) == (None, "tb\n")
    command.downgrade(alembic_config(database_url), "0011")
    # The job, its outbox row and its three events kept (SQLite rebuilds the table).
    assert asyncio.run(_counts(database_url)) == (1, 1, 3)
    upgrade(database_url)


async def _delay_columns(url: str, job_id: str) -> tuple[object, object]:
    engine = create_engine(url)
    try:
        async with engine.connect() as conn:
            run_at = await conn.scalar(select(jobs.c.run_at).where(jobs.c.id == job_id))
            held = await conn.scalar(select(outbox.c.available_at).where(outbox.c.job_id == job_id))
            return run_at, held
    finally:
        await engine.dispose()


async def _outbox_indexes(url: str) -> dict[str, str]:
    """The outbox's index names and their definitions (the partial WHERE), as stored."""
    engine = create_engine(url)
    try:
        async with engine.connect() as conn:
            if url.startswith("postgresql"):
                rows = await conn.execute(
                    text("SELECT indexname, indexdef FROM pg_indexes WHERE tablename = 'outbox'")
                )
            else:
                rows = await conn.execute(
                    text("SELECT name, sql FROM sqlite_master WHERE tbl_name = 'outbox'")
                )
            return {str(r[0]): str(r[1] or "") for r in rows}
    finally:
        await engine.dispose()


def test_0013_adds_the_run_time_columns_and_splits_the_relays_index(database_url: str) -> None:
    # Back to 0012 (the fixture's database is at head), a job as it was, then 0013 again.
    command.downgrade(alembic_config(database_url), "0012")
    before = asyncio.run(_outbox_indexes(database_url))
    assert "ix_outbox_delayed" not in before
    assert "available_at" not in before["ix_outbox_unpublished"]
    job_id = "00000000-0000-4000-8000-000000000012"
    asyncio.run(_insert_old(database_url, "acme", job_id))

    upgrade(database_url)

    assert asyncio.run(_counts(database_url)) == (1, 1, 1)
    assert asyncio.run(_delay_columns(database_url, job_id)) == (None, None)  # due at once
    after = asyncio.run(_outbox_indexes(database_url))
    assert "available_at IS NULL" in after["ix_outbox_unpublished"]
    assert "available_at IS NOT NULL" in after["ix_outbox_delayed"]
    # And down again keeps the job, with the index as 0012 had it.
    command.downgrade(alembic_config(database_url), "0012")
    assert asyncio.run(_counts(database_url)) == (1, 1, 1)
    assert "available_at" not in asyncio.run(_outbox_indexes(database_url))["ix_outbox_unpublished"]
    upgrade(database_url)


async def _job_columns(url: str) -> set[str]:
    engine = create_engine(url)
    try:
        async with engine.connect() as conn:

            def names(sync_conn: Any) -> set[str]:
                return {c["name"] for c in inspect(sync_conn).get_columns("jobs")}

            return await conn.run_sync(names)
    finally:
        await engine.dispose()


def test_0014_adds_the_cancel_request_columns_and_keeps_every_row(database_url: str) -> None:
    """0014 (a running job's cancel request): three nullable columns at the end of ``jobs``;
    a job written before it reads as never asked to cancel; down again drops only them."""
    command.downgrade(alembic_config(database_url), "0013")
    cancel_columns = {"cancel_requested_at", "cancel_requested_by", "cancel_reason"}
    assert not cancel_columns & asyncio.run(_job_columns(database_url))
    old = "00000000-0000-4000-8000-000000000012"
    asyncio.run(_insert_old(database_url, "acme", old))

    upgrade(database_url)

    assert cancel_columns <= asyncio.run(_job_columns(database_url))
    assert asyncio.run(_counts(database_url)) == (1, 1, 1)

    job = asyncio.run(_job(database_url, old))
    assert job is not None and job.cancel_requested_at is None and job.cancel_reason is None
    command.downgrade(alembic_config(database_url), "0013")
    assert not cancel_columns & asyncio.run(_job_columns(database_url))
    assert asyncio.run(_counts(database_url)) == (1, 1, 1)
    upgrade(database_url)


async def _jobs_indexes(url: str) -> dict[str, list[str | None]]:
    engine = create_engine(url)
    try:
        async with engine.connect() as conn:

            def names(sync_conn: Any) -> dict[str, list[str | None]]:
                return {
                    str(i["name"]): list(i["column_names"])
                    for i in inspect(sync_conn).get_indexes("jobs")
                }

            return await conn.run_sync(names)
    finally:
        await engine.dispose()


async def _finished_at(url: str) -> dict[str, Any]:
    engine = create_engine(url)
    try:
        async with engine.connect() as conn:
            rows = await conn.execute(text("SELECT id, finished_at FROM jobs"))
            return {r.id: r.finished_at for r in rows}
    finally:
        await engine.dispose()


def test_0022_stamps_the_finished_jobs_and_takes_the_indexes_off_the_state(
    database_url: str,
) -> None:
    """0022 (HOT transitions): a job finished before it gets ``finished_at`` = its last change
    (what retention judged it by), an unfinished one none; no index holds ``state`` or
    ``updated_at`` any more; down again puts the state index back."""
    command.downgrade(alembic_config(database_url), "0021")
    done, running = "00000000-0000-4000-8000-000000000022", "00000000-0000-4000-8000-000000000023"
    asyncio.run(_insert_old(database_url, "acme", done))
    asyncio.run(_insert_old(database_url, "acme", running))

    async def finish() -> None:
        engine = create_engine(database_url)
        try:
            async with engine.begin() as conn:
                await conn.execute(jobs.update().where(jobs.c.id == done).values(state="succeeded"))
                await conn.execute(
                    jobs.update().where(jobs.c.id == running).values(state="running")
                )
        finally:
            await engine.dispose()

    asyncio.run(finish())
    assert "ix_jobs_state_updated" in asyncio.run(_jobs_indexes(database_url))

    upgrade(database_url)

    stamped = asyncio.run(_finished_at(database_url))
    assert stamped[running] is None
    assert stamped[done] is not None
    indexes = asyncio.run(_jobs_indexes(database_url))
    assert "ix_jobs_state_updated" not in indexes
    assert indexes["ix_jobs_finished"] == ["finished_at"]
    assert not any({"state", "updated_at"} & set(cols) for cols in indexes.values())
    assert asyncio.run(_counts(database_url)) == (2, 2, 2)

    command.downgrade(alembic_config(database_url), "0021")
    assert asyncio.run(_jobs_indexes(database_url))["ix_jobs_state_updated"] == [
        "state",
        "updated_at",
    ]
    assert "finished_at" not in asyncio.run(_job_columns(database_url))
    upgrade(database_url)


async def _referred(url: str, table: str) -> list[str]:
    engine = create_engine(url)
    try:
        async with engine.connect() as conn:
            keys = await conn.run_sync(lambda c: inspect(c).get_foreign_keys(table))
            return [key["referred_table"] for key in keys]
    finally:
        await engine.dispose()


def test_0023_takes_the_foreign_keys_off_the_events_and_the_outbox(database_url: str) -> None:
    """0023: ``job_events`` and ``outbox`` keep every row and lose their foreign key to
    ``jobs`` (a trigger per row on PostgreSQL); down again deletes any row whose job is gone
    and puts the keys back."""
    command.downgrade(alembic_config(database_url), "0022")
    kept = "00000000-0000-4000-8000-000000000024"
    asyncio.run(_insert_old(database_url, "acme", kept))
    assert asyncio.run(_referred(database_url, "job_events")) == ["jobs"]
    assert asyncio.run(_referred(database_url, "outbox")) == ["jobs"]

    upgrade(database_url)

    assert asyncio.run(_referred(database_url, "job_events")) == []
    assert asyncio.run(_referred(database_url, "outbox")) == []
    assert asyncio.run(_counts(database_url)) == (1, 1, 1)
    # Rows whose job is gone: none the code writes, but nothing refuses them now.
    asyncio.run(
        _insert_old(database_url, "acme", "00000000-0000-4000-8000-000000000025", job=False)
    )
    assert asyncio.run(_counts(database_url)) == (1, 2, 2)

    command.downgrade(alembic_config(database_url), "0022")
    assert asyncio.run(_referred(database_url, "job_events")) == ["jobs"]
    assert asyncio.run(_referred(database_url, "outbox")) == ["jobs"]
    assert asyncio.run(_counts(database_url)) == (1, 1, 1)
    upgrade(database_url)


def _job_id_columns() -> set[tuple[str, str]]:
    """Every column of the schema that holds a job's id: those typed ``JobId``."""
    return {
        (table.name, column.name)
        for table in metadata.sorted_tables
        for column in table.columns
        if column.type is JobId
    }


async def _collations(url: str) -> dict[tuple[str, str], str | None]:
    """Each varchar column's collation (PostgreSQL); each table's DDL (SQLite)."""
    engine = create_engine(url)
    try:
        async with engine.connect() as conn:
            if engine.dialect.name == "sqlite":  # its tables as written: unchanged there
                rows = await conn.execute(text("SELECT name, '', sql FROM sqlite_master"))
            else:
                rows = await conn.execute(
                    text(
                        "SELECT table_name, column_name, collation_name"
                        " FROM information_schema.columns WHERE table_schema = current_schema()"
                        " AND data_type = 'character varying'"
                    )
                )
            return {(table, column): collation for table, column, collation in rows}
    finally:
        await engine.dispose()


def test_0024_gives_every_job_id_column_the_c_collation(database_url: str) -> None:
    """0024 (PostgreSQL): each column holding a job's id compares bytes ("C") and no
    other column does, so the migration misses none of the schema's ``JobId`` columns; the
    rows stay; down again puts the database's default back. On SQLite it changes nothing."""
    ids = _job_id_columns()
    postgres = database_url.startswith("postgresql")
    kept = "00000000-0000-4000-8000-000000000026"
    command.downgrade(alembic_config(database_url), "0023")
    asyncio.run(_insert_old(database_url, "acme", kept))
    before = asyncio.run(_collations(database_url))
    if postgres:
        assert {before[each] for each in ids} == {None}

    upgrade(database_url)

    after = asyncio.run(_collations(database_url))
    if not postgres:
        assert after == before
    else:
        assert {after[each] for each in ids} == {"C"}
        others = {key: value for key, value in after.items() if key not in ids}
        assert set(others.values()) == {None}  # only the job ids
    assert asyncio.run(_counts(database_url)) == (1, 1, 1)
    assert asyncio.run(_job(database_url, kept)) is not None

    command.downgrade(alembic_config(database_url), "0023")
    assert asyncio.run(_collations(database_url)) == before
    upgrade(database_url)
