"""token lifecycle: API tokens can expire and be revoked, and remember when they were last used

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-01 16:15:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

import jobrelay.storage.tables

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_COLUMNS = ("expires_at", "revoked_at", "last_used_at")


def upgrade() -> None:
    # Batch mode for SQLite. Existing tokens never expire and are not revoked.
    with op.batch_alter_table("api_tokens") as batch:
        for name in _COLUMNS:
            batch.add_column(sa.Column(name, jobrelay.storage.tables.UTCDateTime(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("api_tokens") as batch:
        for name in reversed(_COLUMNS):
            batch.drop_column(name)
