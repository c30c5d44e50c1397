"""A new job, written on a connection someone else owns: the application's own transaction.

This is the seed's one transaction: the application's change, the job row, its outbox row
and its ``accepted`` event commit together or not at all. The statements are written once,
as a generator that yields each statement and receives its result, and run either on an
asynchronous SQLAlchemy connection (asyncpg, aiosqlite) or a synchronous one (psycopg,
sqlite3). Nothing here commits, begins, or opens a connection: a rollback of the caller's
transaction leaves no trace, and on PostgreSQL the relay's wake-up (``pg_notify``) is
delivered only at the caller's commit.

On PostgreSQL the four writes are ONE statement (a data-modifying CTE, built once with bound
parameters), so it is all or nothing even in autocommit mode: the API sends it alone, one
round trip per accepted job. SQLite gets the same writes as four statements. While the
installation's previous id secret still counts (a rotation's window, ``installation.py``),
one read comes first: the job under the id the previous secret gives, if there is one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import (
    ColumnElement,
    Connection,
    Executable,
    String,
    bindparam,
    func,
    insert,
    literal,
    select,
    update,
)
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncConnection

from jobrelay.domain.dependencies import AFTER_FAILURE
from jobrelay.domain.limits import turn_key
from jobrelay.domain.messages import JobMessage
from jobrelay.domain.states import UNFINISHED_VALUES, JobState
from jobrelay.errors import ConfigError, IdempotencyConflict, InvalidDependencies
from jobrelay.observe import tracing
from jobrelay.observe.tracing import trace_headers
from jobrelay.storage.dependencies import CHUNK, chunks, settle_steps
from jobrelay.storage.drivers.pg_new_job import pg_due, pg_new_job_statement
from jobrelay.storage.records import NOTIFY_CHANNEL, NewJob, work_destination
from jobrelay.storage.steps import Steps
from jobrelay.storage.tables import job_dependencies, job_events, jobs, outbox

_EXISTING_HASH = select(jobs.c.request_hash).where(jobs.c.id == bindparam("nj_id", type_=String()))


def queued_job_row(job: NewJob, now: datetime) -> dict[str, Any]:
    """The ``jobs`` row of a job just accepted (also a follow-up's, written by ``claims``)."""
    return {
        "id": job.job_id,
        "type": job.type,
        "account_id": job.account_id,
        "params": job.params,
        "idempotency_key": job.idempotency_key,
        "request_hash": job.request_hash,
        "state": JobState.QUEUED.value,
        "attempt": 0,
        "max_attempts": job.max_attempts,
        "queue": job.queue,
        "created_at": now,
        "updated_at": now,
        # Only when set: a job due at once is written as before delays existed.
        **({"run_at": job.run_at} if job.run_at is not None else {}),
        # The same for limits: a job under none is written as before limits existed.
        **(limit_columns(job) if job.limits else {}),
        # And for a trace: a job enqueued under none is written as before traces were kept.
        **({"trace_context": trace} if (trace := trace_headers(job.headers)) else {}),
    }


def limits_json(job: NewJob) -> list[dict[str, object]]:
    """The job's limits as its ``limits`` column holds them."""
    return [limit.to_json() for limit in job.limits]


def limit_columns(job: NewJob) -> dict[str, Any]:
    """The columns written with a job's limits: they decide its admission's turn."""
    return {"limits": limits_json(job), "turn_key": turn_key(job.limits), "priority": job.priority}


def accepted_detail(job: NewJob, run_at: datetime | None) -> dict[str, Any]:
    """The ``accepted`` event's detail: the type, a follow-up's parent, a delayed job's run
    time."""
    detail: dict[str, Any] = {"type": job.type}
    if job.parent_job_id is not None:
        detail["parentJobId"] = job.parent_job_id
    if run_at is not None:
        detail["runAt"] = run_at.isoformat()
    return detail


def sqlite_due(seconds: float) -> ColumnElement[Any]:
    """SQLite's clock plus ``seconds``, as the text ``UTCDateTime`` stores (microseconds:
    SQLite's clock has milliseconds), so it compares with every other stored time."""
    modifier = literal(f"{seconds:+.6f} seconds")
    return func.strftime(literal("%Y-%m-%d %H:%M:%f"), literal("now"), modifier).op("||")(
        literal("000")
    )


def new_job_steps(dialect: str, job: NewJob, now: datetime) -> Steps[tuple[str, bool]]:
    """Insert the job unless its id exists; then its outbox row and ``accepted`` event,
    under its ``enqueue`` span, carrying that span's trace context (``observe.tracing``).
    """
    with tracing.enqueuing([job]) as (traced,):
        return (yield from untraced_new_job_steps(dialect, traced, now))


def untraced_new_job_steps(dialect: str, job: NewJob, now: datetime) -> Steps[tuple[str, bool]]:
    """``new_job_steps`` for a job that carries its trace context already (one of a batch
    under the batch's ``enqueue`` span).

    Insert the job unless its id exists; then its outbox row and ``accepted`` event.

    Returns ``(job_id, created)``. An existing job with the same request hash is the same
    request again: nothing is written. Another hash under the same id raises
    ``IdempotencyConflict``. With a ``previous_job_id`` (an id secret was rotated and the
    previous one still counts) a job under that id is looked for first, by the same rules:
    one more statement, only while a previous secret counts.
    """
    if dialect not in ("postgresql", "sqlite"):
        raise ConfigError("connection", f"jobrelay supports PostgreSQL and SQLite, not {dialect}")
    if job.previous_job_id is not None:
        earlier = (yield (_EXISTING_HASH, {"nj_id": job.previous_job_id})).first()
        if earlier is not None:
            return same_request(job.previous_job_id, job, earlier.request_hash)
    if job.after:
        return (yield from _waiting_job_steps(dialect, job, now))
    body = JobMessage(job_id=job.job_id, type=job.type).encode().decode()
    destination = job.destination or work_destination(job.queue)
    if dialect == "postgresql":
        row = (
            yield (
                pg_new_job_statement(job),
                {
                    "nj_id": job.job_id,
                    "nj_type": job.type,
                    "nj_account": job.account_id,
                    "nj_params": job.params,
                    "nj_key": job.idempotency_key,
                    "nj_hash": job.request_hash,
                    "nj_state": JobState.QUEUED.value,
                    "nj_max_attempts": job.max_attempts,
                    "nj_queue": job.queue,
                    "nj_now": now,
                    **({"nj_run_at": job.run_at} if job.run_at is not None else {}),
                    **({"nj_delay": job.delay} if job.delay is not None else {}),
                    **(
                        {
                            "nj_limits": limits_json(job),
                            "nj_turn": turn_key(job.limits),
                            "nj_priority": job.priority,
                        }
                        if job.limits
                        else {}
                    ),
                    "nj_destination": destination,
                    "nj_body": body,
                    "nj_headers": dict(job.headers or {}),
                    **(
                        {"nj_trace": trace_headers(job.headers)}
                        if trace_headers(job.headers)
                        else {}
                    ),
                    # (A delayed job's is written in SQL, with the database's time.)
                    **(
                        {"nj_detail": accepted_detail(job, job.run_at)} if job.delay is None else {}
                    ),
                    # Delivered at commit, to listening relays only: a hint, never the only path.
                    "nj_channel": NOTIFY_CHANNEL,
                },
            )
        ).one()
        if row.inserted is not None:
            return job.job_id, True
        existing = row.existing_hash
        if existing is None:
            # The id was inserted by a transaction that committed after this statement began
            # (ON CONFLICT waited for it): read it again, with a snapshot that sees it.
            existing = (yield (_EXISTING_HASH, {"nj_id": job.job_id})).scalar_one()
        return same_request(job.job_id, job, existing)
    due = {} if job.delay is None else {"run_at": sqlite_due(job.delay)}
    inserted = yield (
        sqlite.insert(jobs)
        .values(**queued_job_row(job, now), **due)
        .on_conflict_do_nothing(index_elements=[jobs.c.id])
        # A job due at once reads back only its id: its statement stays the one it was
        # before delays existed (a schema without ``run_at`` still takes it).
        .returning(jobs.c.id, *([jobs.c.run_at] if due else [])),
        None,
    )
    # RETURNING, not rowcount: psycopg reports -1 for an INSERT … ON CONFLICT here.
    row = inserted.first()
    if row is None:
        existing = (yield (_EXISTING_HASH, {"nj_id": job.job_id})).scalar_one()
        return same_request(job.job_id, job, existing)
    run_at = row.run_at if due else job.run_at  # the database's, for a delay
    yield (
        insert(outbox).values(
            job_id=job.job_id,
            destination=destination,
            body=body,
            headers=dict(job.headers or {}),
            created_at=now,
            **({"available_at": run_at} if run_at is not None else {}),
            # Under limits: it waits for its admission (a job under none is written as
            # before limits existed).
            **({"awaiting_admission": True} if job.limits else {}),
        ),
        None,
    )
    yield (
        insert(job_events).values(
            job_id=job.job_id, at=now, kind="accepted", detail=accepted_detail(job, run_at)
        ),
        None,
    )
    return job.job_id, True


def _waiting_job_steps(dialect: str, job: NewJob, now: datetime) -> Steps[tuple[str, bool]]:
    """A job with ``after=`` (``storage.dependencies``): ``waiting``, its edges, its
    ``accepted`` event; ``queued`` at once (or ``cancelled``) when its dependencies have all
    ended already.

    The same request again writes nothing, whatever became of its dependencies since.
    Every dependency is read first, and one that does not exist, or that the job's account
    may not read, refuses the job before anything is written. Then the unfinished ones are
    locked and marked ``has_dependants`` (on SQLite that write takes the one write lock
    first, so the states read after it are the latest): an end that commits after this
    transaction sees its edges, one that committed before is read as ended. Locked in the
    order every end takes its locks (``dependencies.finish_steps``): the jobs that wait for
    nothing first, then the ``waiting`` ones, each in id order, so that this never holds a
    waiting job that an end holding one of its dependencies still has to count down.
    """
    if job.after_failure not in AFTER_FAILURE:
        raise InvalidDependencies(
            f"after_failure must be one of {', '.join(AFTER_FAILURE)}, not {job.after_failure!r}"
        )
    earlier = (yield (_EXISTING_HASH, {"nj_id": job.job_id})).first()
    if earlier is not None:
        return same_request(job.job_id, job, earlier.request_hash)
    after = list(dict.fromkeys(job.after))  # each once, in the order first named
    seen: dict[str, Any] = {}
    for chunk in chunks(sorted(after)):
        rows = yield (
            select(jobs.c.id, jobs.c.account_id, jobs.c.state).where(jobs.c.id.in_(chunk)),
            None,
        )
        seen.update((r.id, r) for r in rows.all())
    _refuse_unreadable(job, after, {i: r.account_id for i, r in seen.items()}, owners=True)
    waiting = JobState.WAITING.value
    ordered = sorted(after, key=lambda i: (seen[i].state == waiting, i))
    states: dict[str, str] = {}
    if dialect == "sqlite":
        # The write lock first: every read after it sees the latest commit.
        for chunk in chunks(ordered):
            yield (_mark_dependants(chunk), None)
    for chunk in chunks(ordered):
        # One statement per class, as a lock in id order is taken per statement.
        for waits in (False, True):
            ids = [i for i in chunk if (seen[i].state == waiting) is waits]
            if not ids:
                continue
            rows = yield (
                select(jobs.c.id, jobs.c.state)
                .where(jobs.c.id.in_(ids))
                .order_by(jobs.c.id)
                .with_for_update(key_share=True),
                None,
            )
            states.update((r.id, r.state) for r in rows.all())
    _refuse_unreadable(job, after, states, owners=False)  # pruned since it was read
    unfinished = sorted(i for i in ordered if not JobState(states[i]).is_terminal)
    open_ = set(unfinished)
    if dialect != "sqlite":
        for chunk in chunks(unfinished):
            yield (_mark_dependants(chunk), None)
    due: dict[str, Any] = {}
    if job.delay is not None:
        due = {"run_at": sqlite_due(job.delay) if dialect == "sqlite" else pg_due(job.delay)}
    row = {
        **queued_job_row(job, now),
        **due,
        "state": JobState.WAITING.value,
        "waiting_for": len(unfinished),
        "after_failure": job.after_failure,
    }
    upsert = postgresql.insert(jobs) if dialect == "postgresql" else sqlite.insert(jobs)
    inserted = (
        yield (
            upsert.values(**row)
            .on_conflict_do_nothing(index_elements=[jobs.c.id])
            .returning(jobs.c.id, jobs.c.run_at),
            None,
        )
    ).first()
    if inserted is None:
        existing = (yield (_EXISTING_HASH, {"nj_id": job.job_id})).scalar_one()
        return same_request(job.job_id, job, existing)
    for start in range(0, len(after), CHUNK):
        yield (
            insert(job_dependencies).values(
                [
                    {
                        "job_id": job.job_id,
                        "position": position,
                        "depends_on": dependency,
                        # Ended already: counted as ended, once, now.
                        "finished_state": None if dependency in open_ else states[dependency],
                    }
                    for position, dependency in enumerate(after[start : start + CHUNK], start)
                ]
            ),
            None,
        )
    detail = accepted_detail(job, inserted.run_at)
    detail["after"] = len(after)
    if job.after_failure != "cancel":
        detail["afterFailure"] = job.after_failure
    yield (
        insert(job_events).values(job_id=job.job_id, at=now, kind="accepted", detail=detail),
        None,
    )
    if len(unfinished) < len(after):
        # Ended dependencies: the job may be due now, or cancelled by one that failed.
        yield from settle_steps(dialect == "postgresql", [job.job_id], now)
    return job.job_id, True


def _mark_dependants(ids: Sequence[str]) -> Executable:
    """Tell the unfinished dependencies ``ids`` that a job waits for them: their end then
    settles it, in its own transaction (``storage.dependencies``)."""
    return (
        update(jobs)
        .where(
            jobs.c.id.in_(ids),
            jobs.c.state.in_(UNFINISHED_VALUES),
            jobs.c.has_dependants.is_not(True),
        )
        .values(has_dependants=True)
    )


def _refuse_unreadable(
    job: NewJob, after: Sequence[str], found: Mapping[str, Any], *, owners: bool
) -> None:
    """``InvalidDependencies`` naming the ids of ``after`` not ``found``, or (``owners``:
    ``found`` maps ids to accounts) of another account than the job's. A job on no account's
    behalf (the application's own code, an admin) may name any job. Both read the same, so
    that the answer says nothing of another account's jobs."""
    missing = tuple(
        i
        for i in after
        if i not in found or (owners and job.account_id is not None and found[i] != job.account_id)
    )
    if missing:
        shown = ", ".join(missing[:5]) + (
            f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        )
        raise InvalidDependencies(
            f"after= names {len(missing)} job(s) that do not exist or that this account may"
            f" not read: {shown}",
            missing,
        )


def steps_on(
    bind: AsyncConnection | Connection, job: NewJob, now: datetime
) -> Steps[tuple[str, bool]]:
    """``new_job_steps`` for the database ``bind`` is a connection to."""
    return new_job_steps(bind.dialect.name, job, now)


def same_request(job_id: str, job: NewJob, existing_hash: str) -> tuple[str, bool]:
    """An existing job under ``job_id``: the same request again, or a reused key."""
    if existing_hash != job.request_hash:
        raise IdempotencyConflict(
            "this Idempotency-Key was already used with a different request body"
        )
    return job_id, False
