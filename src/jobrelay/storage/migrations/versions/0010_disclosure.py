"""disclosure: jobs.public_error, the error as the job's account reads it

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-01 23:00:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # Nullable, no default: adding it rewrites no row on either database. Rows failed before
    # this revision have none, and the account view shows a fixed message for them.
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("public_error", sa.Text(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("public_error")
