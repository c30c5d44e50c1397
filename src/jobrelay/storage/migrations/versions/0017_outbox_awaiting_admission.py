"""outbox.awaiting_admission: a row that waits for its job's admission, flagged on the row

The relay's claim judged each waiting row by a lookup of its job (``NOT EXISTS`` over
``jobs``): a cost paid per row by every job, limited or not, and with a backlog held for its
limits a scan that grew with the backlog (measured: 240 ms per claim over 1,000 held rows,
the planner's estimate of a fresh table choosing a scan of the unfinished jobs per row). The
flag is written with the row from the job's own columns and cleared by the admission; the
relay's partial index leaves the rows awaiting admission out, and a partial index of their
own serves the admission. ``ix_jobs_held`` holds the jobs held back now: a completion that
gives slots back wakes the relays only when there is one.

Revision ID: 0017
Revises: 0016
Create Date: 2026-12-06 00:10:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0017"
down_revision: str | None = "0016"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_DUE_NOW = "published_at IS NULL AND available_at IS NULL"


def _awaiting(dialect: str, value: bool) -> str:
    # As SQLAlchemy writes ``awaiting_admission.is_(value)`` for each database, so that a
    # query's own term matches the index's predicate.
    literal = {"postgresql": "true" if value else "false", "sqlite": "1" if value else "0"}
    return f"awaiting_admission IS {literal[dialect]}"


def upgrade() -> None:
    dialect = op.get_bind().dialect.name
    with op.batch_alter_table("outbox") as batch:
        batch.add_column(
            sa.Column("awaiting_admission", sa.Boolean(), nullable=False, server_default=sa.false())
        )
    # Rows written before the flag: those whose job waits for its admission now.
    op.execute(
        """
        UPDATE outbox SET awaiting_admission = true
        WHERE published_at IS NULL AND EXISTS (
            SELECT 1 FROM jobs WHERE jobs.id = outbox.job_id AND jobs.limits IS NOT NULL
              AND jobs.admitted_at IS NULL AND jobs.state IN ('queued', 'retry_wait'))
        """
    )
    op.drop_index("ix_outbox_unpublished", table_name="outbox")
    due = f"{_DUE_NOW} AND {_awaiting(dialect, False)}"
    op.create_index(
        "ix_outbox_unpublished",
        "outbox",
        ["id"],
        postgresql_where=sa.text(due),
        sqlite_where=sa.text(due),
    )
    held = "throttled_at IS NOT NULL AND admitted_at IS NULL"
    op.create_index(
        "ix_jobs_held", "jobs", ["id"], postgresql_where=sa.text(held), sqlite_where=sa.text(held)
    )
    awaiting = f"published_at IS NULL AND {_awaiting(dialect, True)}"
    op.create_index(
        "ix_outbox_awaiting",
        "outbox",
        ["id"],
        postgresql_where=sa.text(awaiting),
        sqlite_where=sa.text(awaiting),
    )


def downgrade() -> None:
    op.drop_index("ix_outbox_awaiting", table_name="outbox")
    op.drop_index("ix_jobs_held", table_name="jobs")
    op.drop_index("ix_outbox_unpublished", table_name="outbox")
    op.create_index(
        "ix_outbox_unpublished",
        "outbox",
        ["id"],
        postgresql_where=sa.text(_DUE_NOW),
        sqlite_where=sa.text(_DUE_NOW),
    )
    with op.batch_alter_table("outbox") as batch:
        batch.drop_column("awaiting_admission")
