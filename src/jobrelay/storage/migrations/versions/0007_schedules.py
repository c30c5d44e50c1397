"""schedules: periodic jobs, their cursor and pause state, and a timeline per schedule

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-01 17:45:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

import jobrelay.storage.tables

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    utc = jobrelay.storage.tables.UTCDateTime
    op.create_table(
        "schedules",
        sa.Column("name", sa.String(length=128), nullable=False),
        sa.Column("job_type", sa.String(length=64), nullable=False),
        sa.Column("cron", sa.String(length=128), nullable=False),
        sa.Column("timezone", sa.String(length=64), nullable=False),
        sa.Column("cursor_at", utc(timezone=True), nullable=False),
        sa.Column("last_tick_at", utc(timezone=True), nullable=True),
        sa.Column("last_job_id", sa.String(length=36), nullable=True),
        sa.Column("paused", sa.Boolean(), server_default=sa.text("false"), nullable=False),
        sa.Column("paused_at", utc(timezone=True), nullable=True),
        sa.Column("paused_by", sa.String(length=255), nullable=True),
        sa.Column("paused_reason", sa.Text(), nullable=True),
        sa.Column("paused_skipped", sa.JSON(), nullable=True),
        sa.Column("created_at", utc(timezone=True), nullable=False),
        sa.Column("updated_at", utc(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_schedules")),
    )
    op.create_table(
        "schedule_events",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            autoincrement=True,
            nullable=False,
        ),
        sa.Column("schedule", sa.String(length=128), nullable=False),
        sa.Column("at", utc(timezone=True), nullable=False),
        sa.Column("kind", sa.String(length=32), nullable=False),
        sa.Column("detail", sa.JSON(), nullable=False),
        sa.ForeignKeyConstraint(
            ["schedule"],
            ["schedules.name"],
            name=op.f("fk_schedule_events_schedule_schedules"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_schedule_events")),
    )
    op.create_index(
        op.f("ix_schedule_events_schedule"), "schedule_events", ["schedule", "id"], unique=False
    )


def downgrade() -> None:
    op.drop_index(op.f("ix_schedule_events_schedule"), table_name="schedule_events")
    op.drop_table("schedule_events")
    op.drop_table("schedules")
