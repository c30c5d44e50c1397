"""Alembic environment: runs migrations over the async engine jobrelay itself uses."""

from __future__ import annotations

import asyncio

from alembic import context
from sqlalchemy.engine import Connection

from jobrelay.storage.engine import create_engine
from jobrelay.storage.tables import metadata

config = context.config
target_metadata = metadata


def _run(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=connection.dialect.name == "sqlite",
        transaction_per_migration=True,
    )
    with context.begin_transaction():
        context.run_migrations()


async def _main() -> None:
    url = config.get_main_option("sqlalchemy.url")
    assert url is not None
    engine = create_engine(url)
    try:
        async with engine.connect() as conn:
            if conn.dialect.name == "sqlite":
                # Batch migrations copy a table and drop the old one; with foreign keys on,
                # that drop would cascade into every row that references it. The pragma
                # only works outside a transaction, so it goes to the driver first.
                raw = await conn.get_raw_connection()
                await raw.driver_connection.execute("PRAGMA foreign_keys=OFF")  # type: ignore[union-attr]
            await conn.run_sync(_run)
            await conn.commit()
    finally:
        await engine.dispose()


if context.is_offline_mode():
    raise SystemExit("offline migrations are not supported; run `jobrelay db upgrade`")
asyncio.run(_main())
