"""PostgreSQL's statement for a new job: the job row, its outbox row, its ``accepted`` event
and the relay's NOTIFY in ONE data-modifying CTE, in its variants (due now, at a time, after
a delay; with or without limits; with or without a trace context), each built once.
``new_job`` runs it; SQLite's four statements are there.
"""

from __future__ import annotations

import functools
from typing import Any

from sqlalchemy import (
    JSON,
    BindParameter,
    ColumnElement,
    Executable,
    Float,
    Integer,
    String,
    bindparam,
    func,
    text,
)

from jobrelay.observe.tracing import trace_headers
from jobrelay.storage.records import NewJob
from jobrelay.storage.tables import jobs

# PostgreSQL: job, outbox row, ``accepted`` event and NOTIFY in one statement. The sibling
# INSERTs see ``nj_job`` (empty when the id exists: nothing else is written then); the outer
# SELECT reads the table as it was before the statement, so ``existing_hash`` is the hash of
# a job that was already there. NOTIFY is a scalar subquery of the outer SELECT, which is
# what makes it run. Parameters are ``nj_*``, never a column's name; those in a SELECT list
# are cast, as a driver binding them untyped (psycopg) would otherwise send text.
# A delayed job adds ``run_at`` to the job and ``available_at`` to its outbox row; a job due
# at once writes neither, so its statement is the one it was before delays existed. A delay
# (seconds) is added to the database's clock here, in SQL: the relay judges the held row by
# that clock, so the enqueuing host's clock (skewed or not) has no say in when it runs.
_PG_NEW_JOB_TEXT = """WITH nj_job AS (
    INSERT INTO jobs (id, type, account_id, params, idempotency_key, request_hash, state,
                      attempt, max_attempts, queue, created_at, updated_at{job_cols})
    VALUES (:nj_id, :nj_type, :nj_account, :nj_params, :nj_key, :nj_hash, :nj_state,
            0, :nj_max_attempts, :nj_queue, :nj_now, :nj_now{job_vals})
    ON CONFLICT (id) DO NOTHING
    RETURNING id{job_returning}
), nj_outbox AS (
    INSERT INTO outbox (job_id, destination, body, headers, created_at{outbox_cols})
    SELECT id, CAST(:nj_destination AS varchar), CAST(:nj_body AS text),
           CAST(:nj_headers AS json), CAST(:nj_now AS timestamptz){outbox_vals} FROM nj_job
), nj_event AS (
    INSERT INTO job_events (job_id, at, kind, detail)
    SELECT id, CAST(:nj_now AS timestamptz), 'accepted', {detail} FROM nj_job
)
SELECT (SELECT id FROM nj_job) AS inserted,
       (SELECT count(*) FROM (SELECT pg_notify(:nj_channel, '') FROM nj_job) AS n) AS notified,
       (SELECT request_hash FROM jobs WHERE id = :nj_id) AS existing_hash"""
_PG_BINDS: tuple[BindParameter[Any], ...] = (
    bindparam("nj_id", type_=String()),
    bindparam("nj_type", type_=String()),
    bindparam("nj_account", type_=String()),
    bindparam("nj_params", type_=jobs.c.params.type),
    bindparam("nj_key", type_=String()),
    bindparam("nj_hash", type_=String()),
    bindparam("nj_state", type_=String()),
    bindparam("nj_max_attempts", type_=Integer()),
    bindparam("nj_queue", type_=String()),
    bindparam("nj_now", type_=jobs.c.created_at.type),
    bindparam("nj_destination", type_=String()),
    bindparam("nj_body", type_=String()),
    bindparam("nj_headers", type_=JSON()),
    bindparam("nj_detail", type_=JSON()),
    bindparam("nj_channel", type_=String()),
)


def _pg_delayed(
    due: str, detail: str, cols: str = "", vals: str = "", limited: bool = False
) -> str:
    """The statement of a job held until ``due`` (SQL); its outbox row takes the job's."""
    ocols, ovals = _AWAITING if limited else ("", "")
    return _PG_NEW_JOB_TEXT.format(
        job_cols=f", run_at{cols}",
        job_vals=f", {due}{vals}",
        job_returning=", run_at",
        outbox_cols=f", available_at{ocols}",
        outbox_vals=f", run_at{ovals}",
        detail=detail,
    )


# ``runAt`` as Python's ``isoformat()`` writes a UTC time (no fraction when it is zero), so
# the event reads the same whichever clock made the time. The colons are escaped for text().
PG_ISO_RUN_AT = r"""to_char(run_at AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24\:MI\:SS')
        || CASE WHEN mod(CAST(date_part('microseconds', run_at) AS bigint), 1000000) = 0
                THEN '' ELSE to_char(run_at AT TIME ZONE 'UTC', '.US') END
        || '+00\:00'"""
_PG_DELAYED_DETAIL = f"json_build_object('type', CAST(:nj_type AS text), 'runAt', {PG_ISO_RUN_AT})"
_LIMITS = (
    ", limits, turn_key, priority",
    ", CAST(:nj_limits AS json), CAST(:nj_turn AS varchar), CAST(:nj_priority AS smallint)",
)
# A job under limits: its outbox row waits for the job's admission (``tables.outbox``).
_AWAITING = (", awaiting_admission", ", true")


@functools.cache
def _pg_new_job(due: str, limited: bool, traced: bool) -> Executable:
    """The statement of a job due ``now``, ``at`` a time or after a ``delay``, with its
    limits (``limited``) or without (then the statement it was before limits existed), with
    its trace context (``traced``) or without."""
    cols, vals = _LIMITS if limited else ("", "")
    if traced:
        cols, vals = f"{cols}, trace_context", f"{vals}, CAST(:nj_trace AS json)"
    ocols, ovals = _AWAITING if limited else ("", "")
    limit_binds: list[BindParameter[Any]] = [
        bindparam("nj_limits", type_=JSON()),
        bindparam("nj_turn", type_=String()),
        bindparam("nj_priority", type_=Integer()),
    ]
    binds: list[BindParameter[Any]] = [*_PG_BINDS, *(limit_binds if limited else [])]
    if traced:
        binds.append(bindparam("nj_trace", type_=JSON()))
    if due == "now":
        sql = _PG_NEW_JOB_TEXT.format(
            job_cols=cols,
            job_vals=vals,
            job_returning="",
            outbox_cols=ocols,
            outbox_vals=ovals,
            detail="CAST(:nj_detail AS json)",
        )
        return text(sql).bindparams(*binds)
    if due == "at":
        sql = _pg_delayed(
            "CAST(:nj_run_at AS timestamptz)", "CAST(:nj_detail AS json)", cols, vals, limited
        )
        return text(sql).bindparams(*binds, bindparam("nj_run_at", type_=jobs.c.run_at.type))
    # ``statement_timestamp()``: the database's clock when the enqueue ran, as the relay's
    # ``now()`` is when its claim runs.
    sql = _pg_delayed(
        "statement_timestamp() + make_interval(secs => CAST(:nj_delay AS double precision))",
        _PG_DELAYED_DETAIL,
        cols,
        vals,
        limited,
    )
    return text(sql).bindparams(
        *(b for b in binds if b.key != "nj_detail"), bindparam("nj_delay", type_=Float())
    )


def pg_due(seconds: float) -> ColumnElement[Any]:
    """The database's clock when the enqueue ran, plus ``seconds`` (as a delayed job's)."""
    return func.statement_timestamp() + func.make_interval(0, 0, 0, 0, 0, 0, seconds)


def pg_new_job_statement(job: NewJob) -> Executable:
    """The one statement that writes ``job`` on PostgreSQL, for how it is due."""
    due = "delay" if job.delay is not None else ("now" if job.run_at is None else "at")
    return _pg_new_job(due, bool(job.limits), bool(trace_headers(job.headers)))
