"""job_events.at index: the overview's per-minute throughput reads the last hour by time

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-01 18:30:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_index("ix_job_events_at", "job_events", ["at"], unique=False)


def downgrade() -> None:
    op.drop_index("ix_job_events_at", table_name="job_events")
