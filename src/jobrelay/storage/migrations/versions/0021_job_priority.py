"""priority inside a queue (issue 40, item 5): jobs.priority

A job of a prioritized queue (a type on it declared ``priority=``) waits for its admission
like a job under limits, and the relay admits the waiting jobs of that queue highest
priority first (``storage.admission.waiting_ranked``). The column is written with the
job's limits; NULL (every job before this revision, every job of a queue without
priorities) reads as 0.

Revision ID: 0021
Revises: 0020
Create Date: 2026-12-06 13:00:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0021"
down_revision: str | None = "0020"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # Nullable, no default: adding it rewrites no row. Last, as the claims' ``RETURNING
    # jobs.*`` reads the columns by position.
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("priority", sa.SmallInteger(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("priority")
