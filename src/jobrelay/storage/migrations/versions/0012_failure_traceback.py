"""failure traceback: jobs.last_traceback, where the last failed attempt raised

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-02 15:30:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0012"
down_revision: str | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # Nullable, no default: adding it rewrites no row on either database. Jobs that failed
    # before this revision have none (their reason is still in last_error). Last among the
    # jobs columns: the claims read ``RETURNING jobs.*`` in the order the migrations made.
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("last_traceback", sa.Text(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("last_traceback")
