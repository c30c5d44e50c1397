"""The SQLite driver's statements: each transition of ``transitions`` compiled once, over
the batch as ONE bound JSON array read by ``json_each`` (SQLite's ``unnest``).

The text of each statement is the same for 1 and for 100 jobs, so it is compiled once and a
batch costs no Python per row beyond its JSON (a statement built per batch, with a fence and
a ``CASE`` arm per row, was about half the embedded default's CPU). SQLite has no interval
arithmetic on the text it stores times as: the store's clock and the lease's end are bound
values, computed by the driver.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import Boolean, Column, Integer, String, Text, bindparam, literal_column, text

from jobrelay.storage.drivers.sqlite_conn import DIALECT, Statement
from jobrelay.storage.tables import UTCDateTime, jobs
from jobrelay.storage.transitions import CLAIM, COMPLETE, RENEW, Inputs, guard_sql, set_sql


def _req(*fields: str) -> str:
    """The request array as rows: ``json_each`` of ``:reqs``, element i named ``fields[i]``."""
    columns = ", ".join(f"json_extract(value, '$[{i}]') AS {f}" for i, f in enumerate(fields))
    return f"(SELECT {columns} FROM json_each(:reqs)) AS req"


def _by_id(guard: str) -> str:
    """The guard with ``jobs.state`` kept out of index choice (SQLite's unary ``+``).

    Without statistics SQLite's planner takes ``state IN (…)`` as more selective than the
    join on the primary key with ``json_each``, and scans every queued job once per request
    (19 ms a batch of 15 at 3,000 queued, measured); so the batch's ids drive the lookup."""
    return guard.replace("jobs.state", "+jobs.state")


_BATCH = Inputs(
    now=literal_column(":updated_at"),
    clock=literal_column(":now", UTCDateTime()),
    due_by=literal_column(":due_by", UTCDateTime()),
    lease_ends=literal_column(":lease_ends", UTCDateTime()),
)


def _compiled(transition: Any) -> tuple[str, str]:
    return (
        set_sql(transition.sets(_BATCH), DIALECT),
        _by_id(guard_sql(transition.guards(_BATCH), DIALECT)),
    )


_JOB_COLUMNS = ", ".join(f"jobs.{c.name}" for c in jobs.c)
_TIMES = (
    bindparam("updated_at", type_=UTCDateTime()),
    bindparam("lease_ends", type_=UTCDateTime()),
    bindparam("now", type_=UTCDateTime()),
    bindparam("due_by", type_=UTCDateTime()),
)

# The state each asked job is in before the claim (under BEGIN IMMEDIATE nothing writes
# between this read and the update).
STATES = text(f"SELECT jobs.id, jobs.state FROM jobs, {_req('id')} WHERE jobs.id = req.id").columns(
    Column("id", String()), Column("state", String())
)

_CLAIM_SETS, _CLAIM_GUARDS = _compiled(CLAIM)
CLAIM_MANY = (
    text(
        f"""
UPDATE jobs SET
    {_CLAIM_SETS}
FROM {_req("id", "type", "worker", "seen_state", "seen_attempt", "alone")}
WHERE jobs.id = req.id AND {_CLAIM_GUARDS}
RETURNING {_JOB_COLUMNS}
"""
    )
    .bindparams(*_TIMES)
    .columns(*(Column(c.name, c.type) for c in jobs.c))
)

_COMPLETE_SETS, _COMPLETE_GUARDS = _compiled(COMPLETE)
COMPLETE_MANY = (
    text(
        f"""
UPDATE jobs SET
    {_COMPLETE_SETS}
FROM {_req("id", "attempt", "worker", "result_key", "meta", "value", "done", "total")}
WHERE jobs.id = req.id AND {_COMPLETE_GUARDS}
  -- A job others wait for ends only where the transaction then settles them
  -- (``storage.dependencies``): without that, it is left to one that does.
  AND (:settles OR jobs.has_dependants IS NOT 1)
RETURNING jobs.id, jobs.turn_key, jobs.has_dependants
"""
    )
    .bindparams(bindparam("updated_at", type_=UTCDateTime()), bindparam("settles", type_=Boolean()))
    .columns(
        Column("id", String()), Column("turn_key", String()), Column("has_dependants", Boolean())
    )
)

# Of a batch's completions that did not win, those left alone because others wait for
# their job (``COMPLETE_MANY``'s guard).
DEFERRED = text(
    "SELECT jobs.id FROM jobs WHERE jobs.id IN (SELECT value FROM json_each(:ids))"
    " AND jobs.has_dependants IS 1"
).columns(Column("id", String()))

_RENEW_SETS, _RENEW_GUARDS = _compiled(RENEW)
RENEW_MANY = (
    text(
        f"""
UPDATE jobs SET
    {_RENEW_SETS}
FROM {_req("id", "attempt", "worker")}
WHERE jobs.id = req.id AND {_RENEW_GUARDS}
RETURNING jobs.id, jobs.attempt, jobs.cancel_requested_at
"""
    )
    .bindparams(
        bindparam("updated_at", type_=UTCDateTime()), bindparam("lease_ends", type_=UTCDateTime())
    )
    .columns(
        Column("id", String()),
        Column("attempt", Integer()),
        Column("cancel_requested_at", UTCDateTime()),
    )
)

# The slots the batch's finished jobs give back (``transitions.Transition.releases``).
RELEASE = text("DELETE FROM job_slots WHERE job_id IN (SELECT value FROM json_each(:ids))")
# Whether a job is held back by its limits now (``ix_jobs_held``): only then does a freed
# slot wake the relay.
HELD = text(
    "SELECT 1 AS held FROM jobs WHERE throttled_at IS NOT NULL AND admitted_at IS NULL LIMIT 1"
).columns(Column("held", Integer()))

# The events of a batch: (job id, detail as JSON) pairs; the detail's text is stored as is,
# as the JSON column stores what it serialises. Unknown jobs' are skipped.
EVENTS = text(
    """
INSERT INTO job_events (job_id, at, kind, detail)
SELECT json_extract(value, '$[0]'), :at, :kind, json_extract(value, '$[1]')
FROM json_each(:reqs)
WHERE EXISTS (SELECT 1 FROM jobs WHERE jobs.id = json_extract(value, '$[0]'))
"""
).bindparams(bindparam("at", type_=UTCDateTime()), bindparam("kind", type_=Text()))


STATES_RUN = Statement(STATES)
CLAIM_RUN = Statement(CLAIM_MANY)
COMPLETE_RUN = Statement(COMPLETE_MANY)
RENEW_RUN = Statement(RENEW_MANY)
EVENTS_RUN = Statement(EVENTS)
RELEASE_RUN = Statement(RELEASE)
HELD_RUN = Statement(HELD)
DEFERRED_RUN = Statement(DEFERRED)
