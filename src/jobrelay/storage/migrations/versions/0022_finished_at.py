"""jobs.finished_at: no index on a column every transition writes (issue 41, item 1)

``ix_jobs_state_updated`` indexed ``state`` and ``updated_at``, and ``ix_jobs_account_unfinished``
was partial on ``state``: every claim, renewal and retry changed an indexed column, so no
update of a job was HOT (measured on the no-op drain: 0 of 44,256). The terminal
transition now stamps ``finished_at`` (a replay clears it); retention ranges over it
(``ix_jobs_finished``), the unfinished jobs' index is partial on it, and the state index
goes. On PostgreSQL a check holds ``finished_at`` to the state.

The backfill writes each finished job once (``finished_at = updated_at``: a finished job's
last change is when it finished, which is what retention read until now); on a large
history, run it at a quiet time.

Revision ID: 0022
Revises: 0021
Create Date: 2026-12-06 19:00:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0022"
down_revision: str | None = "0021"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# As storage/tables.py spells them (SQLite uses a partial index only for the same terms).
_TERMINAL = "'cancelled', 'quarantined', 'succeeded'"
_UNFINISHED_BEFORE = "state IN ('waiting', 'queued', 'running', 'retry_wait')"
_UNFINISHED = "finished_at IS NULL"
_FINISHED = "finished_at IS NOT NULL"
_CHECK = "ck_jobs_finished_when_terminal"


def _quota_index(where: str) -> None:
    op.drop_index("ix_jobs_account_unfinished", table_name="jobs")
    op.create_index(
        "ix_jobs_account_unfinished",
        "jobs",
        ["account_id"],
        postgresql_where=sa.text(where),
        sqlite_where=sa.text(where),
    )


def upgrade() -> None:
    # Nullable, no default: adding it rewrites no row. Last, as the claims' ``RETURNING
    # jobs.*`` reads the columns by position.
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True))
    op.execute(f"UPDATE jobs SET finished_at = updated_at WHERE state IN ({_TERMINAL})")
    op.create_index(
        "ix_jobs_finished",
        "jobs",
        ["finished_at"],
        postgresql_where=sa.text(_FINISHED),
        sqlite_where=sa.text(_FINISHED),
    )
    _quota_index(_UNFINISHED)
    op.drop_index("ix_jobs_state_updated", table_name="jobs")
    if op.get_bind().dialect.name == "postgresql":
        # NOT VALID, then VALIDATE: the scan of the existing rows takes no lock that stops
        # writers. SQLite would rebuild the table to add a check: there the transitions'
        # one declaration (``storage.transitions``) is the only guard.
        op.execute(
            f"ALTER TABLE jobs ADD CONSTRAINT {_CHECK} CHECK "
            f"((finished_at IS NULL) = (state NOT IN ({_TERMINAL}))) NOT VALID"
        )
        op.execute(f"ALTER TABLE jobs VALIDATE CONSTRAINT {_CHECK}")


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute(f"ALTER TABLE jobs DROP CONSTRAINT {_CHECK}")
    op.create_index("ix_jobs_state_updated", "jobs", ["state", "updated_at"])
    _quota_index(_UNFINISHED_BEFORE)
    op.drop_index("ix_jobs_finished", table_name="jobs")
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("finished_at")
