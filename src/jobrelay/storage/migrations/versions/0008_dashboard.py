"""dashboard: job_events.at index, queue pauses and their audit, process heartbeats

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-01 18:30:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

import jobrelay.storage.tables

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    utc = jobrelay.storage.tables.UTCDateTime
    op.create_index(op.f("ix_job_events_at"), "job_events", ["at"], unique=False)
    op.create_table(
        "queue_pauses",
        sa.Column("queue", sa.String(length=32), nullable=False),
        sa.Column("paused", sa.Boolean(), nullable=False),
        sa.Column("changed_at", utc(timezone=True), nullable=False),
        sa.Column("changed_by", sa.String(length=255), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.PrimaryKeyConstraint("queue", name=op.f("pk_queue_pauses")),
    )
    op.create_table(
        "queue_events",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            autoincrement=True,
            nullable=False,
        ),
        sa.Column("queue", sa.String(length=32), nullable=False),
        sa.Column("at", utc(timezone=True), nullable=False),
        sa.Column("kind", sa.String(length=16), nullable=False),
        sa.Column("actor", sa.String(length=255), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_queue_events")),
    )
    op.create_index(op.f("ix_queue_events_queue"), "queue_events", ["queue", "id"], unique=False)
    op.create_table(
        "process_heartbeats",
        sa.Column("id", sa.String(length=128), nullable=False),
        sa.Column("role", sa.String(length=16), nullable=False),
        sa.Column("host", sa.String(length=255), nullable=False),
        sa.Column("pid", sa.Integer(), nullable=False),
        sa.Column("queues", sa.JSON(), nullable=False),
        sa.Column("started_at", utc(timezone=True), nullable=False),
        sa.Column("last_seen_at", utc(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_process_heartbeats")),
    )
    op.create_index(
        op.f("ix_process_heartbeats_last_seen"),
        "process_heartbeats",
        ["last_seen_at"],
        unique=False,
    )


def downgrade() -> None:
    op.drop_index(op.f("ix_process_heartbeats_last_seen"), table_name="process_heartbeats")
    op.drop_table("process_heartbeats")
    op.drop_index(op.f("ix_queue_events_queue"), table_name="queue_events")
    op.drop_table("queue_events")
    op.drop_table("queue_pauses")
    op.drop_index(op.f("ix_job_events_at"), table_name="job_events")
