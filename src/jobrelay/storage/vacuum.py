"""Keeping jobrelay's own tables vacuumed when the PostgreSQL server's autovacuum is off.

The outbox, the local queue, the jobs and their events churn: every publish, claim and
completion leaves a dead row version, and retention deletes in bulk. With autovacuum on
(PostgreSQL's default, and what an operator should run) the per-table settings of migration
0005 keep them small. With it off, as on some CI and benchmark machines, nothing reclaims
those rows and the tables and their indexes grow without bound, however short the
retention. The reconciler leader then runs a plain ``VACUUM (ANALYZE)`` on these tables
after each prune: it takes no lock that blocks reads or writes (only ``VACUUM FULL`` does),
and on tables kept small by retention it is quick. ``JOBRELAY_SELF_VACUUM=false`` turns
this off for operators who schedule their own.
"""

from __future__ import annotations

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from jobrelay.storage.capabilities import capabilities_of
from jobrelay.storage.tables import effects_ledger, job_events, jobs, local_messages, outbox

# Fixed names from the schema (VACUUM takes no parameters), the busiest first.
HOT_TABLES = tuple(t.name for t in (outbox, local_messages, jobs, job_events, effects_ledger))


async def autovacuum_on(engine: AsyncEngine) -> bool:
    """The server's ``autovacuum`` setting; True on SQLite (nothing to do there)."""
    if not capabilities_of(engine).vacuums:
        return True
    async with engine.connect() as conn:
        value = (await conn.execute(text("SELECT current_setting('autovacuum')"))).scalar_one()
    return str(value).lower() in {"on", "true", "1"}


async def may_vacuum(engine: AsyncEngine) -> bool:
    """Whether this role may VACUUM the hot tables: their owner, the database's owner or a
    superuser. For anyone else (the least-privileged role of ``jobrelay db grant``)
    PostgreSQL skips each table with only a warning, so it is checked, not tried."""
    if not capabilities_of(engine).vacuums:
        return True
    query = text(
        "SELECT (SELECT rolsuper FROM pg_roles WHERE rolname = current_user)"
        " OR pg_has_role(current_user, (SELECT datdba FROM pg_database"
        "                               WHERE datname = current_database()), 'USAGE')"
        " OR coalesce((SELECT bool_and(pg_has_role(current_user, c.relowner, 'USAGE'))"
        "              FROM pg_class c WHERE c.relname = ANY(:names) AND c.relkind = 'r'"
        "              AND pg_table_is_visible(c.oid)), false)"
    )
    async with engine.connect() as conn:
        allowed = (await conn.execute(query, {"names": list(HOT_TABLES)})).scalar_one()
    return bool(allowed)


# A hot table whose statistics say it holds far fewer rows than it does: PostgreSQL then
# plans its statements for a table of one row. It is what a ``VACUUM`` (this module's, or
# autovacuum's) leaves behind when it saw the table with pages and no live row, a queue
# between two bursts: ``reltuples`` = 0 over ``relpages`` > 0 means a density of zero rows
# a page, whatever the table grows to, until the next ``ANALYZE``. Measured on the bench: the
# relay's claim read every outbox row through the primary key instead of the few unpublished
# ones through ``ix_outbox_unpublished``, and a drain of 5,000 jobs fell from ~1,200 to
# ~360 jobs/s. ``n_live_tup`` is PostgreSQL's running count, kept at each commit.
STALE_AT_ROWS = 1_000
STALE_FACTOR = 4
_STALE = text(
    "SELECT s.relname FROM pg_stat_user_tables s JOIN pg_class c ON c.oid = s.relid"
    " WHERE s.relname = ANY(:names) AND pg_table_is_visible(c.oid)"
    " AND s.n_live_tup >= :least AND s.n_live_tup > :factor * greatest(c.reltuples, 0)"
    " ORDER BY s.relname"
)


async def analyze_stale(engine: AsyncEngine) -> list[str]:
    """``ANALYZE`` the hot tables that hold ``STALE_FACTOR`` times more rows than their
    statistics say (at least ``STALE_AT_ROWS``); the tables analyzed. An ``ANALYZE`` reads
    a sample (30,000 rows at most) and takes no lock that blocks reads or writes; a table
    that keeps its size is never picked twice, one that grows is picked once per factor."""
    if not capabilities_of(engine).vacuums:
        return []
    async with engine.connect() as conn:
        auto = await conn.execution_options(isolation_level="AUTOCOMMIT")
        stale = [
            str(name)
            for name in (
                await auto.execute(
                    _STALE,
                    {"names": list(HOT_TABLES), "least": STALE_AT_ROWS, "factor": STALE_FACTOR},
                )
            ).scalars()
        ]
        for name in stale:
            await auto.execute(text(f'ANALYZE "{name}"'))
    return stale


async def vacuum_hot_tables(engine: AsyncEngine) -> list[str]:
    """VACUUM (ANALYZE) each hot table, outside a transaction as VACUUM requires."""
    async with engine.connect() as conn:
        auto = await conn.execution_options(isolation_level="AUTOCOMMIT")
        for name in HOT_TABLES:
            await auto.execute(text(f'VACUUM (ANALYZE) "{name}"'))
    return list(HOT_TABLES)
