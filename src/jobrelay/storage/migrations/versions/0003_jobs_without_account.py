"""jobs without an account: a job enqueued by an application on no account's behalf

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01 09:30:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # Batch mode: SQLite cannot ALTER a column in place, so the table is copied.
    with op.batch_alter_table("jobs") as batch:
        batch.alter_column("account_id", existing_type=sa.String(length=64), nullable=True)


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.alter_column("account_id", existing_type=sa.String(length=64), nullable=False)
