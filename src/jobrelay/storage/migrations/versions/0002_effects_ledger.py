"""effects ledger: one row per (job, kind) of external effect

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-29 20:10:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

import jobrelay.storage.tables

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "effects_ledger",
        sa.Column("job_id", sa.String(length=36), nullable=False),
        sa.Column("kind", sa.String(length=32), nullable=False),
        sa.Column("state", sa.String(length=24), nullable=False),
        sa.Column("message_id", sa.Text(), nullable=False),
        sa.Column("attempts", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column("last_error", sa.Text(), nullable=True),
        sa.Column("sent_at", jobrelay.storage.tables.UTCDateTime(timezone=True), nullable=True),
        sa.Column("created_at", jobrelay.storage.tables.UTCDateTime(timezone=True), nullable=False),
        sa.Column("updated_at", jobrelay.storage.tables.UTCDateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["job_id"],
            ["jobs.id"],
            name=op.f("fk_effects_ledger_job_id_jobs"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("job_id", "kind", name=op.f("pk_effects_ledger")),
    )


def downgrade() -> None:
    op.drop_table("effects_ledger")
