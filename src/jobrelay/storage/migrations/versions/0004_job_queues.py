"""job queues: each job row names the queue its messages (and retries) go to

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-01 10:00:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # Batch mode for SQLite; existing jobs are on the default queue.
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(
            sa.Column(
                "queue", sa.String(length=32), nullable=False, server_default=sa.text("'default'")
            )
        )


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("queue")
