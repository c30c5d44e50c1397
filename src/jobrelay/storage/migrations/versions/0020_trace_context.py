"""trace context on the job row (issue 39): the enqueue's W3C headers, for every attempt

``jobs.trace_context`` holds the ``traceparent``/``tracestate``/``baggage`` a job was
enqueued under (``observe.tracing``). Its messages carry a copy in their headers; a retry or
a released dependant reads it from here. The jobs that have not ended take the trace their
newest outbox row carries (a ``waiting`` job, which has none yet: the one its ``accepted``
event kept), so an upgrade in the middle of their attempts keeps their trace.

Revision ID: 0020
Revises: 0019
Create Date: 2026-12-06 10:00:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0020"
down_revision: str | None = "0019"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_UNFINISHED = "('waiting', 'queued', 'running', 'retry_wait')"

_PG_BACKFILL = f"""
UPDATE jobs SET trace_context = json_build_object('traceparent', o.headers->>'traceparent')
FROM (SELECT DISTINCT ON (job_id) job_id, headers FROM outbox
      WHERE job_id IN (SELECT id FROM jobs WHERE state IN {_UNFINISHED})
      ORDER BY job_id, id DESC) AS o
WHERE o.job_id = jobs.id AND jobs.state IN {_UNFINISHED}
  AND o.headers->>'traceparent' IS NOT NULL;
UPDATE jobs SET trace_context = json_build_object('traceparent', e.detail->>'traceparent')
FROM job_events AS e
WHERE e.job_id = jobs.id AND e.kind = 'accepted' AND jobs.state = 'waiting'
  AND e.detail->>'traceparent' IS NOT NULL
"""
_SQLITE_BACKFILL = f"""
UPDATE jobs SET trace_context = json_object('traceparent', (
    SELECT json_extract(headers, '$.traceparent') FROM outbox
    WHERE outbox.job_id = jobs.id ORDER BY id DESC LIMIT 1))
WHERE state IN {_UNFINISHED} AND (
    SELECT json_extract(headers, '$.traceparent') FROM outbox
    WHERE outbox.job_id = jobs.id ORDER BY id DESC LIMIT 1) IS NOT NULL;
UPDATE jobs SET trace_context = json_object('traceparent', (
    SELECT json_extract(detail, '$.traceparent') FROM job_events
    WHERE job_events.job_id = jobs.id AND kind = 'accepted' LIMIT 1))
WHERE state = 'waiting' AND (
    SELECT json_extract(detail, '$.traceparent') FROM job_events
    WHERE job_events.job_id = jobs.id AND kind = 'accepted' LIMIT 1) IS NOT NULL
"""


def upgrade() -> None:
    # Only the unfinished jobs (a retry, a release still to come) are filled: their rows are
    # few beside the history, which keeps its trace in its outbox rows (read there when the
    # column is empty: ``storage.admin.AdminQueries.trace_id``).
    # Nullable, no default: adding it rewrites no row. Last, as the claims' ``RETURNING
    # jobs.*`` reads the columns by position.
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("trace_context", sa.JSON(), nullable=True))
    backfill = _PG_BACKFILL if op.get_bind().dialect.name == "postgresql" else _SQLITE_BACKFILL
    for statement in backfill.split(";"):
        op.execute(sa.text(statement))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("trace_context")
