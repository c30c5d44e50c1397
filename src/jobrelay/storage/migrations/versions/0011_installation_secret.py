"""installation: the per-installation secret job ids are keyed with (issue 25, item 5)

Job ids were UUIDv5 under a namespace in the source, so anyone could compute them. From here
they are HMAC-SHA256 under a secret made here, at upgrade time, and kept in the one row of
``installation``. A database that already has jobs keeps the old scheme as the previous one
for 7 days (``previous_id_secret = 'legacy-uuid5'``), so a client retrying a request accepted
before the upgrade still lands on its job. Downgrading drops the table, and with it the
secret: ids derived under it cannot be derived again, so a retry after a downgrade and an
upgrade is a new job.

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-02 12:00:00.000000
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta

import sqlalchemy as sa
from alembic import op

import jobrelay.storage.tables

revision: str = "0011"
down_revision: str | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

LEGACY = "legacy-uuid5"  # domain.ids.Legacy.UUID5, spelt out: a migration does not change
LEGACY_WINDOW = timedelta(days=7)


def upgrade() -> None:
    utc = jobrelay.storage.tables.UTCDateTime
    table = op.create_table(
        "installation",
        sa.Column("id", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("id_secret", sa.String(length=64), nullable=False),
        sa.Column("previous_id_secret", sa.String(length=64), nullable=True),
        sa.Column("previous_until", utc(timezone=True), nullable=True),
        sa.Column("created_at", utc(timezone=True), nullable=False),
        sa.Column("rotated_at", utc(timezone=True), nullable=True),
        sa.Column("rotated_by", sa.String(length=255), nullable=True),
        sa.CheckConstraint("id = 1", name="ck_installation_one_row"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_installation")),
    )
    assert table is not None
    now = datetime.now(UTC)
    has_jobs = op.get_bind().execute(sa.text("SELECT 1 FROM jobs LIMIT 1")).first() is not None
    op.execute(
        table.insert().values(
            id=1,
            id_secret=secrets.token_hex(32),
            previous_id_secret=LEGACY if has_jobs else None,
            previous_until=now + LEGACY_WINDOW if has_jobs else None,
            created_at=now,
        )
    )


def downgrade() -> None:
    op.drop_table("installation")
