"""``jobrelay db grant ROLE``: what a least-privileged PostgreSQL role needs, and nothing more.

The API, relays and workers only read and write rows. Run as the schema's owner, they could
also drop a table; run as a role that owns nothing and holds only DML grants, a compromised
process cannot change the schema or read another database. Migrations stay with the owner
(``jobrelay db upgrade``, which also creates the application's own tables), and this module
gives the runtime role exactly:

- ``USAGE`` on the schema;
- ``SELECT, INSERT, UPDATE, DELETE`` on jobrelay's tables and the application's
  (``App.tables``), nothing on any other table;
- ``USAGE, SELECT`` on the sequences behind their auto-increment keys;
- ``SELECT`` on ``alembic_version``, so a process can check the schema is at its revision.

GRANT takes no bind parameters: the role is looked up in ``pg_roles`` first and every name
is quoted by SQLAlchemy's identifier preparer; the sequence names come from the server.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sqlalchemy import Integer, MetaData, Table, text
from sqlalchemy.ext.asyncio import AsyncEngine

from jobrelay.errors import ConfigError
from jobrelay.storage.capabilities import capabilities_of
from jobrelay.storage.tables import metadata as jobrelay_metadata

DML = "SELECT, INSERT, UPDATE, DELETE"
VERSION_TABLE = "alembic_version"


@dataclass(frozen=True)
class Granted:
    role: str
    schema: str
    tables: list[str]
    sequences: list[str]
    superuser: bool  # the grants change nothing for a superuser; said, not refused


async def grant_runtime_role(
    engine: AsyncEngine, role: str, app_metadata: Sequence[MetaData] = ()
) -> Granted:
    if not capabilities_of(engine).grants:
        raise ConfigError(
            "JOBRELAY_DATABASE_URL", "db grant is for PostgreSQL (SQLite has no roles)"
        )
    tables = [*jobrelay_metadata.sorted_tables]
    for meta in app_metadata:
        tables.extend(meta.sorted_tables)
    quote = engine.dialect.identifier_preparer.quote
    async with engine.begin() as conn:
        found = (
            await conn.execute(
                text("SELECT rolsuper FROM pg_roles WHERE rolname = :role"), {"role": role}
            )
        ).first()
        if found is None:
            raise ConfigError(
                "ROLE", f"no PostgreSQL role {role!r}: create it first (CREATE ROLE … LOGIN)"
            )
        schema = str((await conn.execute(text("SELECT current_schema()"))).scalar_one())
        existing = set(
            (
                await conn.execute(
                    text("SELECT tablename FROM pg_tables WHERE schemaname = :schema"),
                    {"schema": schema},
                )
            ).scalars()
        )
        missing = [t.name for t in tables if t.name not in existing] + (
            [] if VERSION_TABLE in existing else [VERSION_TABLE]
        )
        if missing:
            raise ConfigError(
                "JOBRELAY_DATABASE_URL",
                f"table(s) {', '.join(missing)} missing: run `jobrelay db upgrade` first",
            )
        grantee = quote(role)
        names = ", ".join(quote(t.name) for t in tables)
        await conn.execute(text(f"GRANT USAGE ON SCHEMA {quote(schema)} TO {grantee}"))
        await conn.execute(text(f"GRANT {DML} ON TABLE {names} TO {grantee}"))
        await conn.execute(text(f"GRANT SELECT ON TABLE {quote(VERSION_TABLE)} TO {grantee}"))
        sequences = []
        for table, column in _serial_columns(tables):
            name = (
                await conn.execute(
                    text("SELECT pg_get_serial_sequence(:table, :column)"),
                    {"table": quote(table), "column": column},
                )
            ).scalar_one_or_none()
            if name is not None:
                await conn.execute(text(f"GRANT USAGE, SELECT ON SEQUENCE {name} TO {grantee}"))
                sequences.append(str(name))
    return Granted(role, schema, [t.name for t in tables], sequences, bool(found.rolsuper))


def _serial_columns(tables: Sequence[Table]) -> list[tuple[str, str]]:
    out = []
    for table in tables:
        for column in table.primary_key.columns:
            if column.autoincrement in (True, "auto") and isinstance(column.type, Integer):
                out.append((table.name, column.name))
    return out
