"""retention: tombstones of pruned jobs; autovacuum tuned for the churning tables (PostgreSQL)

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01 15:00:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

import jobrelay.storage.tables

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# PostgreSQL's defaults vacuum a table once 20% of it is dead (and, for inserts, 20% new).
# These tables are queues: every row is inserted, updated a few times and deleted (by an ack,
# or by retention in batches), so at 20% a table of millions of rows carries hundreds of
# thousands of dead tuples the relay's and the consumers' index scans step over. A vacuum
# after 1-2% keeps them small; the insert threshold also keeps the visibility map fresh for
# the index-only scans. docs/how-to/retention.md says what an operator may tune further.
_AUTOVACUUM = {
    "outbox": {
        "autovacuum_vacuum_scale_factor": "0.01",
        "autovacuum_analyze_scale_factor": "0.02",
        "autovacuum_vacuum_insert_scale_factor": "0.02",
    },
    "local_messages": {
        "autovacuum_vacuum_scale_factor": "0.01",
        "autovacuum_analyze_scale_factor": "0.02",
        "autovacuum_vacuum_insert_scale_factor": "0.02",
    },
    "jobs": {
        "autovacuum_vacuum_scale_factor": "0.02",
        "autovacuum_analyze_scale_factor": "0.02",
        "autovacuum_vacuum_insert_scale_factor": "0.05",
    },
    "job_events": {
        "autovacuum_vacuum_scale_factor": "0.02",
        "autovacuum_analyze_scale_factor": "0.05",
        "autovacuum_vacuum_insert_scale_factor": "0.05",
    },
}


def upgrade() -> None:
    op.create_table(
        "pruned_jobs",
        sa.Column("id", sa.String(length=36), nullable=False),
        sa.Column("account_id", sa.String(length=64), nullable=True),
        sa.Column("created_at", jobrelay.storage.tables.UTCDateTime(timezone=True), nullable=False),
        sa.Column("pruned_at", jobrelay.storage.tables.UTCDateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_pruned_jobs")),
    )
    op.create_index(op.f("ix_pruned_jobs_pruned_at"), "pruned_jobs", ["pruned_at"], unique=False)
    if op.get_bind().dialect.name == "postgresql":
        for table, params in _AUTOVACUUM.items():
            settings = ", ".join(f"{name} = {value}" for name, value in params.items())
            op.execute(f"ALTER TABLE {table} SET ({settings})")


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        for table, params in _AUTOVACUUM.items():
            op.execute(f"ALTER TABLE {table} RESET ({', '.join(params)})")
    op.drop_index(op.f("ix_pruned_jobs_pruned_at"), table_name="pruned_jobs")
    op.drop_table("pruned_jobs")
