"""limits per key: jobs.limits, admitted_at, throttled_at; job_slots, limit_buckets,
limit_overrides, limit_events (issue 36)

A job of a limited type carries its limits from its enqueue; the relay hands it to the broker
only once each has room (its admission: ``admitted_at``, a slot per concurrency limit in
``job_slots``, a token from each rate limit's bucket), and the transaction that ends its run
gives the slots back. The columns are added last, as every later column of ``jobs`` is (the
claim's ``RETURNING jobs.*`` is read by position).

Revision ID: 0016
Revises: 0015
Create Date: 2026-12-05 00:30:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from jobrelay.storage.tables import UTCDateTime

revision: str = "0016"
down_revision: str | None = "0015"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("limits", sa.JSON()))
        batch.add_column(sa.Column("turn_key", sa.String(300)))
        batch.add_column(sa.Column("admitted_at", UTCDateTime()))
        batch.add_column(sa.Column("throttled_at", UTCDateTime()))
    op.create_table(
        "job_slots",
        sa.Column("limit_id", sa.String(300), primary_key=True),
        sa.Column(
            "job_id",
            sa.String(36),
            sa.ForeignKey("jobs.id", ondelete="CASCADE"),
            primary_key=True,
        ),
    )
    op.create_index("ix_job_slots_job", "job_slots", ["job_id"])
    op.create_table(
        "limit_buckets",
        sa.Column("limit_id", sa.String(300), primary_key=True),
        sa.Column("tokens", sa.Float(), nullable=False),
        sa.Column("at", UTCDateTime(), nullable=False),
    )
    op.create_table(
        "limit_overrides",
        sa.Column("limit_id", sa.String(300), primary_key=True),
        sa.Column("max", sa.Integer()),
        sa.Column("per_second", sa.Float()),
        sa.Column("burst", sa.Float()),
        sa.Column("changed_at", UTCDateTime(), nullable=False),
        sa.Column("changed_by", sa.String(255), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
    )
    op.create_table(
        "limit_events",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), primary_key=True),
        sa.Column("limit_id", sa.String(300), nullable=False),
        sa.Column("at", UTCDateTime(), nullable=False),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("detail", sa.JSON(), nullable=False),
        sa.Column("actor", sa.String(255), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
    )
    op.create_index("ix_limit_events_limit", "limit_events", ["limit_id", "id"])


def downgrade() -> None:
    op.drop_index("ix_limit_events_limit", table_name="limit_events")
    op.drop_table("limit_events")
    op.drop_table("limit_overrides")
    op.drop_table("limit_buckets")
    op.drop_index("ix_job_slots_job", table_name="job_slots")
    op.drop_table("job_slots")
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("throttled_at")
        batch.drop_column("admitted_at")
        batch.drop_column("turn_key")
        batch.drop_column("limits")
