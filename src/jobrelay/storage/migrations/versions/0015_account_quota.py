"""account quota: ix_jobs_account_unfinished, a partial index of the unfinished jobs (issue 34)

Each job an account's token asks the API for counts its account's unfinished jobs against
``JOBRELAY_ACCOUNT_MAX_UNFINISHED_JOBS``. Over the existing ``(account_id, created_at)``
index that count would read every job the account kept for the retention period; this one
holds only the queued, running and retry-waiting ones, so it reads at most the quota.

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-04 21:00:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0015"
down_revision: str | None = "0014"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# As storage/tables.py spells it (SQLite uses a partial index only for the same terms).
_UNFINISHED = "state IN ('queued', 'running', 'retry_wait')"


def upgrade() -> None:
    op.create_index(
        "ix_jobs_account_unfinished",
        "jobs",
        ["account_id"],
        postgresql_where=sa.text(_UNFINISHED),
        sqlite_where=sa.text(_UNFINISHED),
    )


def downgrade() -> None:
    op.drop_index("ix_jobs_account_unfinished", table_name="jobs")
