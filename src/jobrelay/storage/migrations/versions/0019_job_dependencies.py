"""job dependencies: jobs that run after others (``after=``, issue 37, item 2)

A job written with ``after=[ids]`` is ``waiting`` (no outbox row, no message) and counts its
dependencies that have not ended (``jobs.waiting_for``); the transaction that commits the
last one's outcome makes it ``queued`` with its outbox row. ``job_dependencies`` keeps the
edges in the order given, each counted once (``finished_state``); ``jobs.has_dependants``
tells a dependency's completion that it has jobs to settle. ``ix_jobs_account_unfinished``
(the account quota's count, migration 0015) counts ``waiting`` jobs too: else an account
could keep any number of jobs waiting on one of its own.

Revision ID: 0019
Revises: 0018
Create Date: 2026-12-06 06:00:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0019"
down_revision: str | None = "0018"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# As storage/tables.py spells them (SQLite uses a partial index only for the same terms).
_UNFINISHED_BEFORE = "state IN ('queued', 'running', 'retry_wait')"
_UNFINISHED = "state IN ('waiting', 'queued', 'running', 'retry_wait')"


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
    # Nullable, no default: adding them rewrites no row on either database. Last, as the
    # claims' ``RETURNING jobs.*`` reads the columns by position.
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("waiting_for", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("after_failure", sa.String(length=8), nullable=True))
        batch.add_column(sa.Column("has_dependants", sa.Boolean(), nullable=True))
    op.create_table(
        "job_dependencies",
        sa.Column("job_id", sa.String(length=36), nullable=False),
        sa.Column("position", sa.Integer(), nullable=False),
        sa.Column("depends_on", sa.String(length=36), nullable=False),
        sa.Column("finished_state", sa.String(length=16), nullable=True),
        sa.ForeignKeyConstraint(
            ["job_id"],
            ["jobs.id"],
            name="fk_job_dependencies_job_id_jobs",
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("job_id", "position", name="pk_job_dependencies"),
    )
    op.create_index("ix_job_dependencies_depends_on", "job_dependencies", ["depends_on"])
    _quota_index(_UNFINISHED)


def downgrade() -> None:
    _quota_index(_UNFINISHED_BEFORE)
    op.drop_index("ix_job_dependencies_depends_on", table_name="job_dependencies")
    op.drop_table("job_dependencies")
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("has_dependants")
        batch.drop_column("after_failure")
        batch.drop_column("waiting_for")
