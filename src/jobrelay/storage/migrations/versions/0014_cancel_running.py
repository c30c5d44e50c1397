"""cancel_running: jobs.cancel_requested_at, cancel_requested_by, cancel_reason (issue 24)

A running job cannot be moved to ``cancelled`` by an operator at once: its worker holds the
claim and may be about to commit. The request is recorded here instead; the worker learns it
with its lease renewal, and the fences refuse any outcome of a claim whose cancel was
requested, so the job ends ``cancelled`` with this reason.

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-02 15:00:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

import jobrelay.storage.tables

revision: str = "0014"
down_revision: str | None = "0013"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # Nullable, no default: adding them rewrites no row on either database. Last, as the
    # claims' ``RETURNING jobs.*`` reads them by position.
    utc = jobrelay.storage.tables.UTCDateTime
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("cancel_requested_at", utc(timezone=True), nullable=True))
        batch.add_column(sa.Column("cancel_requested_by", sa.String(length=255), nullable=True))
        batch.add_column(sa.Column("cancel_reason", sa.Text(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("cancel_reason")
        batch.drop_column("cancel_requested_by")
        batch.drop_column("cancel_requested_at")
