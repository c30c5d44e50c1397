"""delayed jobs: jobs.run_at and outbox.available_at (issue 24, item 2)

A delayed job (``enqueue(..., delay=...)``, ``run_at=...``) is a queued job whose outbox row
the relay does not take before ``available_at``: nothing is published, so nothing waits in a
worker or the broker. ``jobs.run_at`` is the same due time as the job's views read it.

The relay's partial index is split in two: ``ix_outbox_unpublished`` now holds only the rows
that were due when written (``available_at IS NULL``: every row before this revision, and
every job not delayed), and ``ix_outbox_delayed`` the held ones by due time, so the relay
finds what is due, and when the next one is, without reading the rows still waiting.

Both columns are nullable with no default: adding them rewrites no row on either database.

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-02 15:00:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

import jobrelay.storage.tables

revision: str = "0013"
down_revision: str | None = "0012"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_WAITING = "published_at IS NULL"
_DUE_NOW = "published_at IS NULL AND available_at IS NULL"
_HELD = "published_at IS NULL AND available_at IS NOT NULL"


def upgrade() -> None:
    utc = jobrelay.storage.tables.UTCDateTime
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("run_at", utc(timezone=True), nullable=True))
    with op.batch_alter_table("outbox") as batch:
        batch.add_column(sa.Column("available_at", utc(timezone=True), nullable=True))
    op.drop_index("ix_outbox_unpublished", table_name="outbox")
    op.create_index(
        "ix_outbox_unpublished",
        "outbox",
        ["id"],
        postgresql_where=sa.text(_DUE_NOW),
        sqlite_where=sa.text(_DUE_NOW),
    )
    op.create_index(
        "ix_outbox_delayed",
        "outbox",
        ["available_at"],
        postgresql_where=sa.text(_HELD),
        sqlite_where=sa.text(_HELD),
    )


def downgrade() -> None:
    op.drop_index("ix_outbox_delayed", table_name="outbox")
    op.drop_index("ix_outbox_unpublished", table_name="outbox")
    with op.batch_alter_table("outbox") as batch:
        batch.drop_column("available_at")
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("run_at")
    op.create_index(
        "ix_outbox_unpublished",
        "outbox",
        ["id"],
        postgresql_where=sa.text(_WAITING),
        sqlite_where=sa.text(_WAITING),
    )
