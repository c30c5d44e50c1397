"""local dead letters: when each message reached the quarantine queue (dead_lettered_at)

Retention pruned the local quarantine queue by ``created_at``, when the message was first
published, so a message published long ago and dead-lettered a minute ago went at the next
prune. Rows already in the quarantine queue get the migration's time: when they were
dead-lettered is not known, and this keeps each for one full retention period.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-01 23:00:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime

import sqlalchemy as sa
from alembic import op

import jobrelay.storage.tables

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    utc = jobrelay.storage.tables.UTCDateTime
    op.add_column("local_messages", sa.Column("dead_lettered_at", utc(timezone=True)))
    messages = sa.table(
        "local_messages", sa.column("queue"), sa.column("dead_lettered_at", utc(timezone=True))
    )
    op.execute(
        messages.update()
        .where(messages.c.queue == "quarantine")
        .values(dead_lettered_at=datetime.now(UTC))
    )


def downgrade() -> None:
    with op.batch_alter_table("local_messages") as batch:
        batch.drop_column("dead_lettered_at")
