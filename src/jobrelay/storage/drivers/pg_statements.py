"""The PostgreSQL driver's statements: each transition of ``transitions`` compiled once, over
arrays (``unnest``), so one prepared statement serves a batch of 1 and of 100.

Each is a data-modifying CTE: the guarded ``UPDATE … RETURNING`` and its ``job_events`` rows
in one statement, sent in autocommit on the held asyncpg connections (``pg_pool``) or, where a
completion must do more inside its transaction, on a SQLAlchemy connection in that
transaction: the same text either way.

Rows are locked in id order (``ORDER BY id FOR NO KEY UPDATE``): two batches never wait on
each other in a cycle, and the key-share locks taken for state-less events never conflict
with them (a plain ``FOR UPDATE`` would, and deadlocked the relay when its ``published``
events still had a foreign key).
"""

from __future__ import annotations

from sqlalchemy import (
    ARRAY,
    BigInteger,
    Boolean,
    Column,
    Integer,
    Interval,
    String,
    Text,
    bindparam,
    literal_column,
    text,
)

from jobrelay.storage.delayed import outbox_due
from jobrelay.storage.drivers.pg_pool import pg_statement
from jobrelay.storage.records import DONE_CHANNEL, NOTIFY_CHANNEL
from jobrelay.storage.tables import OUTBOX_CLAIMED, UTCDateTime, jobs
from jobrelay.storage.transitions import (
    CLAIM,
    COMPLETE,
    RENEW,
    Inputs,
    guard_sql,
    outbox_admissible,
    set_sql,
)

# The request's fields that are JSON text in the array, for columns of type ``json``.
_JSON_FIELDS = frozenset({"meta", "value"})


def _req(name: str) -> object:
    return literal_column(f"CAST(req.{name} AS json)" if name in _JSON_FIELDS else f"req.{name}")


def _by_id(guard: str) -> str:
    """The guard with ``jobs.state`` kept out of index choice (as SQLite's ``+jobs.state``).

    Without statistics (a fresh database; autovacuum late, or off as on the bench machine)
    the planner takes the guard's ``state IN (…)`` for a match of the partial index
    ``ix_jobs_account_unfinished`` and scans every unfinished job once per batch: the no-op
    drain fell from 3,150 to 1,742 jobs/s with 20,000 queued (measured). With the state out
    of play, and the batch's ids an index condition (``= ANY``), each statement looks its
    jobs up by primary key, whatever the statistics say."""
    return guard.replace("jobs.state", "(jobs.state || '')")


_BATCH = Inputs(
    now=literal_column(":b_now"),
    clock=literal_column("clock.now", UTCDateTime()),
    due_by=literal_column("clock.now + :b_slack", UTCDateTime()),
    lease_ends=literal_column("clock.now + :b_lease", UTCDateTime()),
    req=_req,
)


def _record_events(own: str = "") -> str:
    """State-less events (a worker's ``ack_sent``, ``rejected``, ``settle_lost``), unknown
    jobs' skipped: a statement of their own (``RECORD_MANY``), or riding on a worker's next
    claim.

    Their jobs are key-share locked as they are found (what the foreign key's trigger did):
    retention, which locks a job FOR UPDATE before it deletes it with its events, skips a job
    locked so, and a job it locked first is gone when the lock is granted; either way no
    event outlives its job (``job_events`` has no foreign key, ``storage.tables``). ``own``:
    the ids of the jobs the statement itself locks (a claim's, a completion's). Those are
    held from retention already, and the key-share lock would skip one the statement has
    updated before it (PostgreSQL skips a row its own command changed), dropping its event.
    """
    held = f" OR r.job_id IN ({own})" if own else ""
    return f"""
INSERT INTO job_events (job_id, at, kind, detail)
SELECT r.job_id, r.at, r.kind, CAST(r.detail AS json)
FROM unnest(CAST(:e_jobs AS text[]), CAST(:e_ats AS timestamptz[]),
            CAST(:e_kinds AS text[]), CAST(:e_details AS text[])) AS r(job_id, at, kind, detail)
WHERE r.job_id IN (
    SELECT jobs.id FROM jobs WHERE jobs.id = ANY(CAST(:e_jobs AS text[])) FOR KEY SHARE OF jobs
){held}
"""


_EVENT_PARAMS = (
    bindparam("e_jobs", type_=ARRAY(String())),
    bindparam("e_ats", type_=ARRAY(UTCDateTime())),
    bindparam("e_kinds", type_=ARRAY(String())),
    bindparam("e_details", type_=ARRAY(Text())),
)

_CLOCK = "clock AS (SELECT COALESCE(:b_clock, now()) AS now)"


def _claim(own: str) -> str:
    """The claim's CTEs (after ``clock``): its rows are those of ``claimed``. ``own``: the
    jobs the whole statement locks (``_record_events``)."""
    return f"""
asked AS (
    SELECT * FROM unnest(CAST(:b_ids AS text[]), CAST(:b_types AS text[]),
                         CAST(:b_workers AS text[]), CAST(:b_details AS text[]),
                         CAST(:b_seen_states AS text[]), CAST(:b_seen_attempts AS integer[]),
                         CAST(:b_alone AS integer[]))
        AS r(id, type, worker, detail, seen_state, seen_attempt, alone)
),
req AS (
    SELECT j.id, j.state AS from_state, asked.type, asked.worker, asked.detail,
           asked.seen_state, asked.seen_attempt, asked.alone
    FROM jobs j JOIN asked ON j.id = asked.id
    WHERE j.id = ANY(CAST(:b_ids AS text[]))
    ORDER BY j.id
    FOR NO KEY UPDATE OF j
),
claimed AS (
    UPDATE jobs SET
    {set_sql(CLAIM.sets(_BATCH))}
    FROM req, clock
    WHERE jobs.id = ANY(CAST(:b_ids AS text[])) AND jobs.id = req.id
      AND {_by_id(guard_sql(CLAIM.guards(_BATCH)))}
    RETURNING jobs.*, req.from_state AS claimed_from_state, req.detail AS claim_detail
),
event AS (
    INSERT INTO job_events (job_id, at, kind, detail)
    SELECT id, :b_now, '{CLAIM.event}',
           CAST(CAST(claim_detail AS jsonb) || jsonb_build_object('attempt', attempt) AS json)
    FROM claimed
),
noted AS ({_record_events(own)})
"""


_CLAIM_PARAMS = (
    *_EVENT_PARAMS,
    bindparam("b_ids", type_=ARRAY(String())),
    bindparam("b_types", type_=ARRAY(String())),
    bindparam("b_workers", type_=ARRAY(String())),
    bindparam("b_details", type_=ARRAY(Text())),
    bindparam("b_seen_states", type_=ARRAY(String())),
    bindparam("b_seen_attempts", type_=ARRAY(Integer())),
    bindparam("b_alone", type_=ARRAY(Integer())),
    bindparam("b_now", type_=UTCDateTime()),
    bindparam("b_lease", type_=Interval()),
    bindparam("b_slack", type_=Interval()),
    bindparam("b_clock", type_=UTCDateTime()),
)
_CLAIMED_COLUMNS = (
    *(Column(c.name, c.type) for c in jobs.c),
    Column("claimed_from_state", String()),
    Column("claim_detail", Text()),
)

CLAIM_MANY = pg_statement(
    text(f"WITH {_CLOCK}, {_claim('SELECT id FROM req')} SELECT * FROM claimed")
    .bindparams(*_CLAIM_PARAMS)
    .columns(*_CLAIMED_COLUMNS)
)

# The completion's CTEs; its arrays are ``d_`` (a turn sends a claim's ``b_`` beside them),
# its instant the claim's ``:b_now``. ``COMPLETED`` is its answer, a row per job.
_COMPLETE = f"""
d_req AS (
    SELECT * FROM unnest(CAST(:d_ids AS text[]), CAST(:d_attempts AS integer[]),
                         CAST(:d_workers AS text[]), CAST(:d_keys AS text[]),
                         CAST(:d_metas AS text[]), CAST(:d_values AS text[]),
                         CAST(:d_details AS text[]), CAST(:d_dones AS bigint[]),
                         CAST(:d_totals AS bigint[]))
        AS r(id, attempt, worker, result_key, meta, value, detail, done, total)
),
locked AS (
    -- The row as locked is its latest version: ``has_dependants`` set by an enqueue that
    -- committed while this waited is seen here (``storage.dependencies``).
    SELECT j.id, j.has_dependants IS TRUE AS has_dependants
    FROM jobs j JOIN d_req ON j.id = d_req.id
    WHERE j.id = ANY(CAST(:d_ids AS text[]))
    ORDER BY j.id FOR NO KEY UPDATE OF j
),
done AS (
    UPDATE jobs SET
    {set_sql(COMPLETE.sets(_BATCH))}
    FROM d_req AS req JOIN locked ON locked.id = req.id
    WHERE jobs.id = ANY(CAST(:d_ids AS text[])) AND jobs.id = req.id
      AND {_by_id(guard_sql(COMPLETE.guards(_BATCH)))}
      -- A job others wait for ends only where the transaction then settles them (its next
      -- statement, a snapshot that sees every edge): in autocommit it is left alone.
      AND (CAST(:d_settles AS boolean) OR NOT locked.has_dependants)
    RETURNING jobs.id, req.detail, jobs.turn_key, locked.has_dependants
),
released AS (
    -- Only a job under limits holds slots (its turn key is set at enqueue): the others'
    -- completions look nothing up.
    DELETE FROM job_slots USING done
    WHERE done.turn_key IS NOT NULL AND job_slots.job_id = done.id
    RETURNING job_slots.job_id
),
held AS (
    -- Whether a job is held back by its limits now (``ix_jobs_held``): only then does a
    -- freed slot wake the relays. Read only when this batch gave slots back.
    SELECT 1 FROM jobs
    WHERE jobs.throttled_at IS NOT NULL AND jobs.admitted_at IS NULL
      AND EXISTS (SELECT 1 FROM released)
    LIMIT 1
),
woken AS (
    -- A freed slot wakes every listening relay at this commit while a job is held: the
    -- key's next job is admitted now, not at their next poll. One NOTIFY a statement.
    SELECT pg_notify('{NOTIFY_CHANNEL}', '') FROM held
),
told AS (
    -- The waiters of these jobs (``App.wait``) re-read them at this commit: one NOTIFY a
    -- statement, whatever the number of jobs it ended.
    SELECT pg_notify('{DONE_CHANNEL}', '') WHERE EXISTS (SELECT 1 FROM done)
),
d_event AS (
    INSERT INTO job_events (job_id, at, kind, detail)
    SELECT id, :b_now, '{COMPLETE.event}', CAST(detail AS json) FROM done
)
"""
_COMPLETED = """
SELECT id, (SELECT count(*) FROM woken) > 0 AS wakes, (SELECT count(*) FROM told) AS told,
       has_dependants, false AS deferred
FROM done
UNION ALL
SELECT id, false, 0, true, true FROM locked
WHERE has_dependants AND NOT CAST(:d_settles AS boolean)
"""
_COMPLETE_PARAMS = (
    bindparam("d_ids", type_=ARRAY(String())),
    bindparam("d_attempts", type_=ARRAY(Integer())),
    bindparam("d_workers", type_=ARRAY(String())),
    bindparam("d_keys", type_=ARRAY(Text())),
    bindparam("d_metas", type_=ARRAY(Text())),
    bindparam("d_values", type_=ARRAY(Text())),
    bindparam("d_details", type_=ARRAY(Text())),
    bindparam("d_dones", type_=ARRAY(BigInteger())),
    bindparam("d_totals", type_=ARRAY(BigInteger())),
    bindparam("d_settles", type_=Boolean()),
)

COMPLETE_MANY = pg_statement(
    text(f"WITH {_COMPLETE} {_COMPLETED}")
    .bindparams(*_COMPLETE_PARAMS, bindparam("b_now", type_=UTCDateTime()))
    .columns(
        Column("id", String()),
        Column("wakes", Boolean()),
        Column("told", Integer()),
        Column("has_dependants", Boolean()),
        Column("deferred", Boolean()),
    )
)

# A worker's turn: the completions of the jobs it has finished and the claims of those it
# starts next, ONE statement (one round trip, one commit) where they were two. The halves
# never share a job (the worker's batcher keeps a job's claim and its completion in
# different turns): a row is updated by one of them at most, as PostgreSQL requires of one
# statement. The claims' rows come first, then a row per completion with the claim's
# columns null (``(NULL::jobs).*``) and ``done_id`` set.
TURN = pg_statement(
    text(
        f"""
WITH {_CLOCK}, {_COMPLETE}, {_claim("SELECT id FROM req UNION ALL SELECT id FROM locked")}
SELECT claimed.*, CAST(NULL AS text) AS done_id, CAST(NULL AS boolean) AS wakes,
       CAST(NULL AS bigint) AS told, CAST(NULL AS boolean) AS done_has_dependants,
       CAST(NULL AS boolean) AS deferred
FROM claimed
UNION ALL
SELECT (CAST(NULL AS jobs)).*, NULL, NULL, c.id, c.wakes, c.told, c.has_dependants, c.deferred
FROM ({_COMPLETED}) AS c
"""
    )
    .bindparams(*_CLAIM_PARAMS, *_COMPLETE_PARAMS)
    .columns(
        *_CLAIMED_COLUMNS,
        Column("done_id", String()),
        Column("wakes", Boolean()),
        # Read, so that ``told``'s NOTIFY can never be planned away (a CTE that writes
        # nothing runs only when something reads it).
        Column("told", BigInteger()),
        Column("done_has_dependants", Boolean()),
        Column("deferred", Boolean()),
    )
)

_RENEW_HOLDS = _by_id(guard_sql(RENEW.guards(_BATCH)))

# Every running claim of a worker renewed at once (its one lease renewer), fenced per row as
# a completion is, rows locked in id order as the completions lock them. A row another
# transaction holds locked (its own completion, an upload once made under it) is SKIPPED,
# never waited on: one locked row must not hold up the renewal of its neighbours. A skipped
# row whose last committed state still shows the claim holding it is answered ``skipped``
# (not renewed, not lost: nobody can take it over while the lock is held either).
RENEW_MANY = pg_statement(
    text(
        f"""
WITH clock AS (SELECT COALESCE(:b_clock, now()) AS now),
req AS (
    SELECT * FROM unnest(CAST(:b_ids AS text[]), CAST(:b_attempts AS integer[]),
                         CAST(:b_workers AS text[]))
        AS r(id, attempt, worker)
),
locked AS (
    SELECT j.id FROM jobs j JOIN req ON j.id = req.id
    WHERE j.id = ANY(CAST(:b_ids AS text[]))
    ORDER BY j.id FOR NO KEY UPDATE OF j SKIP LOCKED
),
renewed AS (
    UPDATE jobs SET
    {set_sql(RENEW.sets(_BATCH))}
    FROM req JOIN locked ON locked.id = req.id, clock
    WHERE jobs.id = ANY(CAST(:b_ids AS text[])) AND jobs.id = req.id AND {_RENEW_HOLDS}
    RETURNING jobs.id, req.attempt, jobs.cancel_requested_at IS NOT NULL AS cancel_requested
)
SELECT id, attempt, cancel_requested, false AS skipped FROM renewed
UNION ALL
SELECT jobs.id, req.attempt, false, true FROM jobs JOIN req ON jobs.id = req.id
WHERE jobs.id = ANY(CAST(:b_ids AS text[])) AND {_RENEW_HOLDS}
  AND NOT EXISTS (SELECT 1 FROM locked WHERE locked.id = req.id)
"""
    ).bindparams(
        bindparam("b_ids", type_=ARRAY(String())),
        bindparam("b_attempts", type_=ARRAY(Integer())),
        bindparam("b_workers", type_=ARRAY(String())),
        bindparam("b_lease", type_=Interval()),
        bindparam("b_now", type_=UTCDateTime()),
        bindparam("b_clock", type_=UTCDateTime()),
    )
)

# The events of a batch as arrays, one statement whatever their number; unknown jobs' skipped.
RECORD_MANY = pg_statement(text(_record_events()).bindparams(*_EVENT_PARAMS))

# The relay's claim: rows waiting and not claimed by a live relay, skipped when another claim
# holds them, taken for ``o_claim_for`` by the store's clock, which is also their ``taken_at``.
# Only rows due by then (``delayed.outbox_due``: a delayed job's row is held until its time).
CLAIM_OUTBOX = pg_statement(
    text(
        f"""
WITH clock AS (SELECT COALESCE(:o_clock, now()) AS now),
picked AS (
    SELECT outbox.id FROM outbox, clock
    WHERE outbox.published_at IS NULL
      AND (outbox.claimed_until IS NULL OR outbox.claimed_until < clock.now)
      AND ({guard_sql([outbox_due(literal_column("clock.now")), outbox_admissible()])})
    ORDER BY outbox.id
    LIMIT :o_limit
    FOR UPDATE OF outbox SKIP LOCKED
)
UPDATE outbox SET
    claimed_by = :o_relay, claimed_until = clock.now + :o_claim_for,
    publish_attempts = outbox.publish_attempts + 1
FROM picked, clock
WHERE outbox.id = picked.id
RETURNING outbox.id, outbox.job_id, outbox.destination, outbox.body, outbox.headers,
          outbox.publish_attempts, clock.now AS taken_at
"""
    )
    .bindparams(
        bindparam("o_relay", type_=String()),
        bindparam("o_limit", type_=Integer()),
        bindparam("o_claim_for", type_=Interval()),
        bindparam("o_clock", type_=UTCDateTime()),
    )
    .columns(*OUTBOX_CLAIMED, Column("taken_at", UTCDateTime()))
)

# The relay's mark: confirmed rows not yet marked, and a ``published`` event each, stamped
# with the instant the row was taken (``OutboxStore.mark_published``).
MARK_PUBLISHED = pg_statement(
    text(
        """
WITH req AS (
    SELECT * FROM unnest(CAST(:m_ids AS bigint[]), CAST(:m_taken AS timestamptz[]))
        AS r(id, taken_at)
),
marked AS (
    UPDATE outbox SET
        published_at = COALESCE(:m_clock, now()), claimed_until = NULL, last_error = NULL
    FROM req
    WHERE outbox.id = req.id AND outbox.published_at IS NULL
    RETURNING outbox.id, outbox.job_id, outbox.destination, req.taken_at
),
event AS (
    INSERT INTO job_events (job_id, at, kind, detail)
    SELECT job_id, taken_at, 'published',
           json_build_object('destination', destination, 'outboxId', id,
                             'relay', CAST(:m_relay AS text))
    FROM marked
)
SELECT count(*) AS marked FROM marked
"""
    ).bindparams(
        bindparam("m_ids", type_=ARRAY(BigInteger())),
        bindparam("m_taken", type_=ARRAY(UTCDateTime())),
        bindparam("m_relay", type_=String()),
        bindparam("m_clock", type_=UTCDateTime()),
    )
)
