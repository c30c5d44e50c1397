"""result value: jobs.result_value, the JSON value a job returned (issue 37, item 1)

A job may return any JSON value (a dict, a list, a string, a number, a bool, None) or a
``jobrelay.Result`` with ``value=``: it is committed with ``succeeded``, in the same fenced
statement as the rest of the outcome, and read back as ``jobrelay.Job.result``. Kept apart
from ``result_meta`` (the operation's facts beside a stored object) so that nothing is mixed
into the application's own value.

Revision ID: 0018
Revises: 0017
Create Date: 2026-12-06 04:00:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0018"
down_revision: str | None = "0017"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # Nullable, no default: adding it rewrites no row on either database. Last, as the
    # claims' ``RETURNING jobs.*`` reads the columns by position.
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("result_value", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("result_value")
