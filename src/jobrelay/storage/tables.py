"""The schema as SQLAlchemy Core tables; Alembic migrations are written to match it.

Times are stored as UTC. On SQLite, which has no time zone type, ``UTCDateTime`` writes naive
UTC text in one fixed format so comparisons in SQL stay correct; every value read back is
timezone-aware again.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    CheckConstraint,
    Column,
    DateTime,
    Dialect,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    PrimaryKeyConstraint,
    SmallInteger,
    String,
    Table,
    Text,
    and_,
    text,
)
from sqlalchemy.types import TypeDecorator

from jobrelay.domain.states import TERMINAL_STATES

# The terminal states as SQL literals, in a stable order (the check on ``jobs.finished_at``).
TERMINAL_SQL = ", ".join(f"'{s.value}'" for s in sorted(TERMINAL_STATES))

# BIGINT on PostgreSQL, but INTEGER on SQLite so the column is an alias for ROWID and
# autoincrements.
BigId = BigInteger().with_variant(Integer(), "sqlite")

# A job's id (its canonical UUID text) wherever a column holds one, with PostgreSQL's "C"
# collation (migration 0024): these columns are compared for equality and looked up in
# btrees on every hand-off, and under the database's default libc collation (C.UTF-8 here)
# PostgreSQL 15 compares text through strcoll, not memcmp: measured on 300,000 ids, 1.4 µs
# more per index insert and 1.9 µs more per lookup. An id's bytes are ASCII, so the order
# is all that changes. Every job-id column has it, so a join between two of them never
# meets two collations (which PostgreSQL refuses); a parameter takes the column's.
JobId = String(36).with_variant(String(36, collation="C"), "postgresql")


class UTCDateTime(TypeDecorator[datetime]):
    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetime given to the database; use an aware UTC datetime")
        value = value.astimezone(UTC)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: Any, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if isinstance(value, str):
            value = datetime.fromisoformat(value)
        assert isinstance(value, datetime)
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


metadata = MetaData(
    naming_convention={
        "ix": "ix_%(table_name)s_%(column_0_N_name)s",
        "uq": "uq_%(table_name)s_%(column_0_N_name)s",
        "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
        "pk": "pk_%(table_name)s",
    }
)

jobs = Table(
    "jobs",
    metadata,
    Column("id", JobId, primary_key=True),
    Column("type", String(64), nullable=False),
    Column("account_id", String(64)),  # None: enqueued on no account's behalf
    Column("params", JSON, nullable=False),
    Column("idempotency_key", String(255)),
    Column("request_hash", String(64), nullable=False),
    Column("state", String(16), nullable=False),
    Column("attempt", Integer, nullable=False, server_default=text("0")),
    Column("max_attempts", Integer, nullable=False),
    Column("result_key", Text),
    Column("result_meta", JSON),
    Column("last_error", Text),
    Column("quarantine_reason", Text),
    Column("next_attempt_at", UTCDateTime()),
    Column("lease_owner", String(128)),
    Column("lease_expires_at", UTCDateTime()),
    Column("progress_done", BigInteger),
    Column("progress_total", BigInteger),
    Column("created_at", UTCDateTime(), nullable=False),
    Column("updated_at", UTCDateTime(), nullable=False),
    # The job type's queue (``@app.job(queue=...)``): its work, retry and re-sent messages
    # go there. Kept on the row because operators and the reconciler have no registry.
    Column("queue", String(32), nullable=False, server_default=text("'default'")),
    # The error as the job's account reads it, ``code: message`` (domain.disclosure), beside
    # the operators' raw text in last_error and quarantine_reason (migration 0010). Last, as
    # the migration adds it: the claim's ``RETURNING jobs.*`` is read by position.
    Column("public_error", Text),
    # Where the last failed attempt raised: its traceback, scrubbed and cut to 8 KiB
    # (worker.failures), for operators only (migration 0012). Kept after a later success.
    Column("last_traceback", Text),
    # When a delayed job may first run (``enqueue(delay=…, run_at=…)``, migration 0013): its
    # outbox row is held until then. None: it ran as soon as it was published. Kept after the
    # job ran, as its history. Last, as the migration adds it (see above).
    Column("run_at", UTCDateTime()),
    # An operator's cancel of a running job (migration 0014): recorded here, learnt by the
    # worker with its lease renewal; the outcome fences refuse a claim once it is set.
    Column("cancel_requested_at", UTCDateTime()),
    Column("cancel_requested_by", String(255)),
    Column("cancel_reason", Text),
    # Limits per key (migration 0016, ``domain.limits``): the limits the job is under, as its
    # definition gave them at enqueue (None: none); since when it holds its admission (its
    # slots, a token spent), handed to the broker; and since when it has been held back.
    Column("limits", JSON),
    # Whose turn the job takes at admission (its fairness key, else its first limit's id):
    # each round reads the oldest waiting jobs of every key, not the oldest of all.
    Column("turn_key", String(300)),
    Column("admitted_at", UTCDateTime()),
    Column("throttled_at", UTCDateTime()),
    # The JSON value the job returned (migration 0018), committed with ``succeeded``: None
    # when it returned nothing (or None). Apart from ``result_meta``, the operation's facts.
    Column("result_value", JSON(none_as_null=True)),
    # Jobs that run after others (``after=``, migration 0019, ``storage.dependencies``): how
    # many of a ``waiting`` job's dependencies have not ended yet, what a failed one does to
    # it (``cancel`` or ``run``), and, on a dependency, whether any job waits for it (its
    # completion then runs in a transaction that settles those jobs).
    Column("waiting_for", Integer),
    Column("after_failure", String(8)),
    Column("has_dependants", Boolean),
    # The trace context of the job's ``enqueue`` (migration 0020, ``observe.tracing``): the
    # W3C ``traceparent``/``tracestate`` and ``baggage`` headers, which every message of the
    # job carries, so each attempt's span finds the enqueue it links to. None: no trace.
    Column("trace_context", JSON(none_as_null=True)),
    # Its priority in its queue, 0..9, higher first (migration 0021): written with the limits
    # of a job of a prioritized queue, whose admission it orders. None reads as 0.
    Column("priority", SmallInteger),
    # When the job last reached a terminal state (migration 0022): written once, by the
    # transition that ends it, and cleared by the replay that re-opens it; the database holds
    # it to the state (``ck_jobs_finished_when_terminal``). Retention and the unfinished jobs'
    # index read it, so no index holds a column that every transition writes (``state``,
    # ``updated_at``): a claim, a renewal, a retry is a HOT update, with no index entry.
    Column("finished_at", UTCDateTime()),
    CheckConstraint(
        f"(finished_at IS NULL) = (state NOT IN ({TERMINAL_SQL}))",
        name="ck_jobs_finished_when_terminal",
    ).ddl_if(dialect="postgresql"),  # SQLite would rebuild the table to add it (0022)
)
# The finished jobs by when they finished: retention's range (``storage.retention``).
FINISHED = "finished_at IS NOT NULL"
Index(
    "ix_jobs_finished",
    jobs.c.finished_at,
    postgresql_where=text(FINISHED),
    sqlite_where=text(FINISHED),
)
# The jobs held back by their limits now (migration 0017): a completion that gives slots back
# wakes the relays only when one is (an index with no entry while no limit binds).
HELD = "throttled_at IS NOT NULL AND admitted_at IS NULL"
Index("ix_jobs_held", jobs.c.id, postgresql_where=text(HELD), sqlite_where=text(HELD))
Index("ix_jobs_account_created", jobs.c.account_id, jobs.c.created_at)
# The account's unfinished jobs, for its quota (JOBRELAY_ACCOUNT_MAX_UNFINISHED_JOBS, migration
# 0015): a count on each accept reads only these entries, never the finished history. The
# condition is spelled as the quota's query spells it (SQLite matches it by its terms).
# ``waiting`` (migration 0019): a job written with ``after=`` holds its place too. By
# ``finished_at`` (migration 0022), not ``state``: a transition between unfinished states
# then changes no column of an index, and is a HOT update.
UNFINISHED = "finished_at IS NULL"
Index(
    "ix_jobs_account_unfinished",
    jobs.c.account_id,
    postgresql_where=text(UNFINISHED),
    sqlite_where=text(UNFINISHED),
)

# A ``waiting`` job's dependencies, in the order ``after=`` named them (``position``): each
# counted once, when it first ends (``finished_state``), so a replayed dependency re-opens
# nothing. ``depends_on`` has no foreign key: the job it names may be pruned once every job
# that needed it has ended (``storage.retention``).
job_dependencies = Table(
    "job_dependencies",
    metadata,
    Column("job_id", JobId, ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True),
    Column("position", Integer, primary_key=True),
    Column("depends_on", JobId, nullable=False),
    Column("finished_state", String(16)),
)
Index("ix_job_dependencies_depends_on", job_dependencies.c.depends_on)

outbox = Table(
    "outbox",
    metadata,
    Column("id", BigId, primary_key=True, autoincrement=True),
    # No foreign key, as ``job_events.job_id`` (below): a row is written with its job, and
    # retention deletes it in the job's own transaction.
    Column("job_id", JobId, nullable=False),
    # Logical destination ("work", "retry.5s"); the topology module maps it to the broker.
    Column("destination", String(64), nullable=False),
    Column("body", Text, nullable=False),
    Column("headers", JSON, nullable=False),
    Column("created_at", UTCDateTime(), nullable=False),
    Column("published_at", UTCDateTime()),
    # A relay owns a claimed row until claimed_until; after that another relay may take it.
    Column("claimed_by", String(128)),
    Column("claimed_until", UTCDateTime()),
    Column("publish_attempts", Integer, nullable=False, server_default=text("0")),
    Column("last_error", Text),
    # Not to be published before this (a delayed job's first message, migration 0013).
    # None: publish at once. The relay's one guard on it is ``outbox_due``.
    Column("available_at", UTCDateTime()),
    # The job is under limits and not yet admitted (migration 0017): no relay claims the row
    # until the admission that gives the job its slots clears it (``storage.admission``).
    # Written with the row, from the job's own columns; a job under no limits never sets it.
    Column("awaiting_admission", Boolean, nullable=False, server_default=text("false")),
)
Index("ix_outbox_job", outbox.c.job_id)
# What a relay's claim of a row returns (with the claim's ``taken_at``): the relay's claim
# and the admission that claims the rows it admits (``storage/admission.py``).
OUTBOX_CLAIMED = (
    outbox.c.id,
    outbox.c.job_id,
    outbox.c.destination,
    outbox.c.body,
    outbox.c.headers,
    outbox.c.publish_attempts,
)
# Partial indexes: the relay only ever scans rows that still wait, those due when written by
# id (and admitted, or under no limits), those held for a due time by that time (it also
# tells the relay when to wake), and those awaiting their admission, for the admission.
_due_when_written = and_(
    outbox.c.published_at.is_(None),
    outbox.c.available_at.is_(None),
    outbox.c.awaiting_admission.is_(False),
)
_held = and_(outbox.c.published_at.is_(None), outbox.c.available_at.is_not(None))
_awaiting = and_(outbox.c.published_at.is_(None), outbox.c.awaiting_admission.is_(True))
Index(
    "ix_outbox_unpublished",
    outbox.c.id,
    postgresql_where=_due_when_written,
    sqlite_where=_due_when_written,
)
Index(
    "ix_outbox_awaiting",
    outbox.c.id,
    postgresql_where=_awaiting,
    sqlite_where=_awaiting,
)
Index(
    "ix_outbox_delayed",
    outbox.c.available_at,
    postgresql_where=_held,
    sqlite_where=_held,
)

# ``job_id`` has no foreign key (migration 0023): PostgreSQL checks one with a trigger that
# looks the job up and key-share locks it for every row, about a third of an event row's
# cost, and five event rows are written per job. The writes hold the reference instead: a
# transition's event comes from the row its statement updated (locked); a state-less event
# (``ack_sent``) key-share locks its job as it checks that it exists, and a ``published``
# event comes from the outbox row its mark holds, which retention deletes first; retention
# deletes a job's events with it, under its lock (``storage.retention``).
job_events = Table(
    "job_events",
    metadata,
    Column("id", BigId, primary_key=True, autoincrement=True),
    Column("job_id", JobId, nullable=False),
    Column("at", UTCDateTime(), nullable=False),
    Column("kind", String(32), nullable=False),
    Column("detail", JSON, nullable=False),
)
Index("ix_job_events_job", job_events.c.job_id, job_events.c.id)
# The overview's throughput reads the last hour of events by time (migration 0008).
Index("ix_job_events_at", job_events.c.at)

api_tokens = Table(
    "api_tokens",
    metadata,
    Column("id", BigId, primary_key=True, autoincrement=True),
    Column("token_hash", String(64), nullable=False, unique=True),
    Column("account_id", String(64)),
    Column("is_admin", Boolean, nullable=False, server_default=text("false")),
    Column("label", String(255)),
    Column("created_at", UTCDateTime(), nullable=False),
    # Unset: never expires / not revoked. A token is valid while both are unset or ahead.
    Column("expires_at", UTCDateTime()),
    Column("revoked_at", UTCDateTime()),
    # Refreshed at most once a minute per API process (never a write per request).
    Column("last_used_at", UTCDateTime()),
)

# The database-backed local transport (embedded default). One row per message in flight.
local_messages = Table(
    "local_messages",
    metadata,
    Column("id", BigId, primary_key=True, autoincrement=True),
    Column("queue", String(64), nullable=False),
    Column("body", Text, nullable=False),
    Column("headers", JSON, nullable=False),
    Column("available_at", UTCDateTime(), nullable=False),
    Column("delivery_count", Integer, nullable=False, server_default=text("0")),
    Column("consumer", String(128)),
    Column("invisible_until", UTCDateTime()),
    Column("created_at", UTCDateTime(), nullable=False),
    # When it reached the quarantine queue (a reject, the delivery limit): retention counts
    # a dead letter's age from here, not from its first publish (migration 0009).
    Column("dead_lettered_at", UTCDateTime()),
)
Index(
    "ix_local_messages_ready",
    local_messages.c.queue,
    local_messages.c.available_at,
    local_messages.c.id,
)

# One row per external effect of a job (kind "email": the notification it sends), so a retry
# decides from a recorded fact whether the effect already happened. See domain/effects.py.
effects_ledger = Table(
    "effects_ledger",
    metadata,
    Column("job_id", JobId, ForeignKey("jobs.id", ondelete="CASCADE"), nullable=False),
    Column("kind", String(32), nullable=False),
    Column("state", String(24), nullable=False),  # sending | sent | failed | possible_duplicate
    # The effect's own stable identity (an e-mail's Message-ID): the same on every attempt.
    Column("message_id", Text, nullable=False),
    Column("attempts", Integer, nullable=False, server_default=text("0")),
    Column("last_error", Text),
    Column("sent_at", UTCDateTime()),  # when the other side first accepted it (this ledger knows)
    Column("created_at", UTCDateTime(), nullable=False),
    Column("updated_at", UTCDateTime(), nullable=False),
    PrimaryKeyConstraint("job_id", "kind"),
)

# One row per job deleted by retention (storage/retention.py): enough to answer "410 Gone,
# pruned" instead of 404 to whoever could see the job, for one more retention period.
# Account kept so another account still gets the 404 it would have got for the job itself.
pruned_jobs = Table(
    "pruned_jobs",
    metadata,
    Column("id", JobId, primary_key=True),
    Column("account_id", String(64)),
    Column("created_at", UTCDateTime(), nullable=False),  # the job's
    Column("pruned_at", UTCDateTime(), nullable=False),
)
Index("ix_pruned_jobs_pruned_at", pruned_jobs.c.pruned_at)

# One row per periodic job schedule (issue 14), written by the schedulers that run it (every
# relay and `up`): its definition as the running app states it, and how far it got. Every tick
# at or before ``cursor_at`` is handled: enqueued as a job, or skipped and recorded.
schedules = Table(
    "schedules",
    metadata,
    Column("name", String(128), primary_key=True),
    Column("job_type", String(64), nullable=False),
    Column("cron", String(128), nullable=False),
    Column("timezone", String(64), nullable=False),
    Column("cursor_at", UTCDateTime(), nullable=False),
    Column("last_tick_at", UTCDateTime()),  # the latest tick enqueued, and its job
    Column("last_job_id", JobId),
    Column("paused", Boolean, nullable=False, server_default=text("false")),
    Column("paused_at", UTCDateTime()),
    Column("paused_by", String(255)),
    Column("paused_reason", Text),
    # The ticks skipped during the current pause (Skipped.detail()), written at resume.
    Column("paused_skipped", JSON),
    Column("created_at", UTCDateTime(), nullable=False),
    Column("updated_at", UTCDateTime(), nullable=False),
)

# A schedule's own timeline: ticks skipped (catch-up, pause), paused, resumed.
schedule_events = Table(
    "schedule_events",
    metadata,
    Column("id", BigId, primary_key=True, autoincrement=True),
    Column(
        "schedule",
        String(128),
        ForeignKey("schedules.name", ondelete="CASCADE"),
        nullable=False,
    ),
    Column("at", UTCDateTime(), nullable=False),
    Column("kind", String(32), nullable=False),
    Column("detail", JSON, nullable=False),
)
Index("ix_schedule_events_schedule", schedule_events.c.schedule, schedule_events.c.id)

# One row per work queue an operator has paused or resumed (issue 15): workers poll it and
# stop consuming a paused queue. Absent: never paused, so consumed.
queue_pauses = Table(
    "queue_pauses",
    metadata,
    Column("queue", String(32), primary_key=True),
    Column("paused", Boolean, nullable=False),
    Column("changed_at", UTCDateTime(), nullable=False),
    Column("changed_by", String(255), nullable=False),
    Column("reason", Text, nullable=False),
)

# Limits per key (migration 0016): one row per slot an admitted job holds, one per
# concurrency limit it is under; written at its admission, deleted in the transaction that
# ends its run (``transitions``: a transition that ``releases``). Counted per limit id.
job_slots = Table(
    "job_slots",
    metadata,
    Column("limit_id", String(300), primary_key=True),
    Column("job_id", JobId, ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True),
)
Index("ix_job_slots_job", job_slots.c.job_id)

# A rate limit's token bucket per limit id: its tokens at ``at`` (the store's clock).
limit_buckets = Table(
    "limit_buckets",
    metadata,
    Column("limit_id", String(300), primary_key=True),
    Column("tokens", Float, nullable=False),
    Column("at", UTCDateTime(), nullable=False),
)

# An operator's runtime value for a limit (a whole limit name, or one key's id), replacing
# the declared one until cleared (``jobrelay limits set``); audited in ``limit_events``.
limit_overrides = Table(
    "limit_overrides",
    metadata,
    Column("limit_id", String(300), primary_key=True),
    Column("max", Integer),
    Column("per_second", Float),
    Column("burst", Float),
    Column("changed_at", UTCDateTime(), nullable=False),
    Column("changed_by", String(255), nullable=False),
    Column("reason", Text, nullable=False),
)
limit_events = Table(
    "limit_events",
    metadata,
    Column("id", BigId, primary_key=True, autoincrement=True),
    Column("limit_id", String(300), nullable=False),
    Column("at", UTCDateTime(), nullable=False),
    Column("kind", String(16), nullable=False),  # set | cleared
    Column("detail", JSON, nullable=False),
    Column("actor", String(255), nullable=False),
    Column("reason", Text, nullable=False),
)
Index("ix_limit_events_limit", limit_events.c.limit_id, limit_events.c.id)

# The audit trail of queue pauses: who paused or resumed which queue, when and why.
queue_events = Table(
    "queue_events",
    metadata,
    Column("id", BigId, primary_key=True, autoincrement=True),
    Column("queue", String(32), nullable=False),
    Column("at", UTCDateTime(), nullable=False),
    Column("kind", String(16), nullable=False),  # paused | resumed
    Column("actor", String(255), nullable=False),
    Column("reason", Text, nullable=False),
)
Index("ix_queue_events_queue", queue_events.c.queue, queue_events.c.id)

# One row per worker or relay process, upserted every few seconds while it runs (issue 15):
# the overview's "processes seen lately". Rows not seen for a while are pruned by the beats.
process_heartbeats = Table(
    "process_heartbeats",
    metadata,
    Column("id", String(128), primary_key=True),  # the worker or relay id
    Column("role", String(16), nullable=False),  # worker | relay
    Column("host", String(255), nullable=False),
    Column("pid", Integer, nullable=False),
    Column("queues", JSON, nullable=False),  # a worker's queues; [] for a relay
    Column("started_at", UTCDateTime(), nullable=False),
    Column("last_seen_at", UTCDateTime(), nullable=False),
)
Index("ix_process_heartbeats_last_seen", process_heartbeats.c.last_seen_at)

# The installation's one row (migration 0011, storage/installation.py): the secret job ids
# are keyed with (hex), and the previous one (hex, or 'legacy-uuid5' for the ids before
# 0011) with the end of its window, plus who last rotated it and when.
installation = Table(
    "installation",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=False),
    Column("id_secret", String(64), nullable=False),
    Column("previous_id_secret", String(64)),
    Column("previous_until", UTCDateTime()),
    Column("created_at", UTCDateTime(), nullable=False),
    Column("rotated_at", UTCDateTime()),
    Column("rotated_by", String(255)),
    CheckConstraint("id = 1", name="ck_installation_one_row"),
)
