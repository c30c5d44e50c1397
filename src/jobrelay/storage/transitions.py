"""Every state change of a job stated once: its guards, the columns it sets, its event.

A transition is written over ``Inputs``: the store's clock, the caller's recorded time, the
lease's end and the request's own values. Each driver spells those its own way (PostgreSQL's
batch statements read ``clock.now`` and ``unnest`` columns, SQLite's read bound times and
``json_each`` columns, the portable SQLAlchemy statements bind Python values) and compiles the
SAME declaration into its statements (``guard_sql``, ``set_sql``). So a column reset at claim,
or set at completion, is one edit here, and no driver can forget it.

The guards are the policy's (``domain.policy``), as SQL:
- ``claimable``: exactly the policy's ``ReadyToRun``, so a claim guarded on it needs no read;
- ``fenced``: the claim token (job, ``running``, attempt, lease owner, no cancel asked): an
  outcome of a run lands only while that claim holds the job;
- ``holds``: the token without the cancel (a renewal or a progress report is no outcome).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import ColumnElement, and_, func, literal_column, not_, null, or_
from sqlalchemy.dialects import postgresql
from sqlalchemy.engine import Dialect

from jobrelay.domain.disclosure import WORKER_LOST
from jobrelay.domain.states import JobState, sources_for
from jobrelay.storage.records import Claim, jsonable
from jobrelay.storage.tables import jobs, outbox

COMPLETABLE = sources_for(JobState.SUCCEEDED)


def state_in(states: Iterable[JobState]) -> ColumnElement[bool]:
    """``state IN ('a', 'b')`` written out: the states are our own constants, and a bound
    list would be re-expanded (compiled again) on every execution."""
    return jobs.c.state.in_([literal_column(f"'{s.value}'") for s in sorted(states)])


def unfinished() -> ColumnElement[bool]:
    """The job has not ended (``finished_at``, held to the state): the terms of the partial
    index of unfinished jobs, which a query over them names to be answered from it (no index
    holds ``state``: every transition writes it)."""
    return jobs.c.finished_at.is_(None)


def in_states(states: Iterable[JobState]) -> list[ColumnElement[bool]]:
    """``state IN (…)``, and where every state named is unfinished (or every one finished)
    the term that lets an index answer: ``finished_at IS NULL`` (or ``IS NOT NULL``)."""
    named = set(states)
    terms = [state_in(named)]
    if named and not any(s.is_terminal for s in named):
        terms.append(unfinished())
    elif named and all(s.is_terminal for s in named):
        terms.append(jobs.c.finished_at.is_not(None))
    return terms


def _state(state: JobState) -> Any:
    return literal_column(f"'{state.value}'")


def holds(claim: Claim) -> list[Any]:
    """The claim holds the job: running, at its attempt, under its lease owner.

    What a lease renewal, a progress report and the end of a cancelled run are guarded on:
    they are no outcome of the work, so an operator's cancel request does not refuse them.
    """
    return [
        jobs.c.state == JobState.RUNNING.value,
        jobs.c.attempt == claim.attempt,
        jobs.c.lease_owner == claim.worker_id,
    ]


def fenced(claim: Claim) -> list[Any]:
    """The claim token: an outcome of this run lands only while this claim holds the job
    and no operator has asked to cancel it (``storage.cancels``). A run that finishes after
    a cancel was requested therefore cannot become ``succeeded`` (nor ``retry_wait``): its
    worker ends the job ``cancelled`` instead (``end_cancelled``)."""
    return [*holds(claim), jobs.c.cancel_requested_at.is_(None)]


_WAITING_STATES = (JobState.QUEUED.value, JobState.RETRY_WAIT.value)


def awaiting_admission() -> ColumnElement[bool]:
    """The job (``jobs``) is under limits and waits for its admission."""
    return and_(
        jobs.c.limits.is_not(None),
        jobs.c.admitted_at.is_(None),
        jobs.c.state.in_(_WAITING_STATES),
    )


def outbox_admissible() -> ColumnElement[bool]:
    """The relay's guard on an outbox row: its job needs no admission, or has it (the flag
    the row is written with and the admission clears, ``tables.outbox``): no lookup of the
    job, and the relay's partial index holds only such rows."""
    return outbox.c.awaiting_admission.is_(False)


def lease_expired(now: ColumnElement[datetime]) -> ColumnElement[bool]:
    """The job's lease has ended by the clock ``now`` (or it has none): whoever held it is
    presumed lost. A claim takes such a job over; the reconciler ends an abandoned cancel."""
    return or_(jobs.c.lease_expires_at.is_(None), jobs.c.lease_expires_at <= now)


def claimable(now: ColumnElement[datetime], due_by: ColumnElement[datetime]) -> list[Any]:
    """Exactly the policy's ``ReadyToRun``, judged by the clock ``now``.

    Not finished, not held by a live lease, not a retry before it is due (``due_by``: ``now``
    plus the policy's slack), attempts left: a claim guarded on this needs no earlier read of
    the job to be right.
    """
    return [
        state_in(sources_for(JobState.RUNNING)),
        jobs.c.attempt < jobs.c.max_attempts,
        # A job an operator asked to cancel is never claimed again (the reconciler ends it).
        jobs.c.cancel_requested_at.is_(None),
        # A job under limits runs only once admitted (``domain.limits``): a copy of it met
        # while it waits for its admission is not its turn.
        or_(jobs.c.limits.is_(None), jobs.c.admitted_at.is_not(None)),
        or_(
            jobs.c.state == JobState.QUEUED.value,
            and_(
                jobs.c.state == JobState.RETRY_WAIT.value,
                or_(jobs.c.next_attempt_at.is_(None), jobs.c.next_attempt_at <= due_by),
            ),
            and_(jobs.c.state == JobState.RUNNING.value, lease_expired(now)),
        ),
    ]


_LOST_PREFIX = f"{WORKER_LOST}:"


def suspect() -> ColumnElement[bool]:
    """The job's last attempt ended with its worker lost: it may be what killed the worker.

    Among claimable jobs: ``running`` (claimable only once its lease has expired, so its
    worker died or froze) or ``retry_wait`` after the reconciler ended such an attempt
    (``worker_lost``). A worker claims a suspect alone (``worker.isolation``), never in a
    batch beside healthy jobs, so a job that kills its worker takes no neighbour with it.
    """
    return or_(
        jobs.c.state == JobState.RUNNING.value,
        and_(
            jobs.c.state == JobState.RETRY_WAIT.value,
            # A prefix compared without LIKE (no ``%`` to escape in the statements' text), and
            # never NULL: ``NOT`` of an unknown would refuse every claim of such a row.
            func.coalesce(func.substr(jobs.c.public_error, 1, len(_LOST_PREFIX)), "")
            == _LOST_PREFIX,
        ),
    )


@dataclass(frozen=True)
class Inputs:
    """What a transition is written over, as one driver's statement spells it."""

    now: Any
    """The time recorded (``updated_at``): the caller's."""
    clock: Any
    """The store's clock, which judges (a lease, a due retry)."""
    due_by: Any = None
    """``clock`` plus the policy's slack: a retry due by then may be claimed."""
    lease_ends: Any = None
    """``clock`` plus the lease: when a claim's (or a renewal's) lease ends."""
    req: Callable[[str], Any] = lambda name: literal_column(f"req.{name}")
    """A value of the request: a column of the batch's rows, or a bound value."""

    def token(self) -> Claim:
        """The request's claim token (job, attempt, worker) as the statement reads it."""
        return Claim(self.req("id"), self.req("attempt"), self.req("worker"))


@dataclass(frozen=True)
class Transition:
    """One state change: where it may come from, what it writes, the event it records, and
    whether it ends the run (``releases``: the job gives back the slots its admission took,
    ``domain.limits``, in the same transaction; every driver and store method writing it
    deletes its ``job_slots`` rows: ``StoreBase.release_slots``, the drivers' completion)."""

    target: JobState | None
    event: str | None
    guards: Callable[[Inputs], list[Any]]
    writes: Callable[[Inputs], dict[str, Any]]
    releases: bool = False

    def sets(self, i: Inputs) -> dict[str, Any]:
        """The SET list: its writes, and an end of the job's admission where it releases."""
        values = self.writes(i)
        if self.target is not None:
            # Stamped by the transition that ends the job, cleared by one that re-opens it
            # (a replay): the check ``ck_jobs_finished_when_terminal`` holds every writer to
            # it. NULL over NULL changes no index column, so a claim stays a HOT update.
            values["finished_at"] = i.now if self.target.is_terminal else null()
        if self.releases:
            # The admission ends, and with it the wait it closed: a later wait (a retry held
            # again) gets a ``throttled`` event of its own.
            values["admitted_at"] = null()
            values["throttled_at"] = null()
        return values


def _claim_guards(i: Inputs) -> list[Any]:
    return [
        *claimable(i.clock, i.due_by),
        # Where the request names them: the type the delivery says, the state and attempt
        # the policy read (a racing copy, or a retry not yet due, loses here).
        or_(i.req("type").is_(None), jobs.c.type == i.req("type")),
        or_(i.req("seen_state").is_(None), jobs.c.state == i.req("seen_state")),
        or_(i.req("seen_attempt").is_(None), jobs.c.attempt == i.req("seen_attempt")),
        # A suspect only where the claim is made alone (``worker.isolation``), never in a
        # delivery's claim unread: it loses there, is read, and is claimed by itself.
        or_(i.req("alone") == 1, not_(suspect())),
    ]


CLAIM = Transition(
    target=JobState.RUNNING,
    event="claimed",
    guards=_claim_guards,
    writes=lambda i: {
        "state": _state(JobState.RUNNING),
        "updated_at": i.now,
        "attempt": jobs.c.attempt + 1,
        "lease_owner": i.req("worker"),
        "lease_expires_at": i.lease_ends,
        "next_attempt_at": null(),
        "progress_done": null(),
        "progress_total": null(),
    },
)

# The progress is the job's own (``ctx.progress``), kept as it last reported it: the
# request's figures where it has some not yet written (``CompleteRequest.progress``).
COMPLETE = Transition(
    target=JobState.SUCCEEDED,
    event="result_saved",
    releases=True,
    guards=lambda i: [state_in(COMPLETABLE), *fenced(i.token())],
    writes=lambda i: {
        "state": _state(JobState.SUCCEEDED),
        "updated_at": i.now,
        "result_key": i.req("result_key"),
        "result_meta": i.req("meta"),
        "result_value": i.req("value"),
        "progress_done": func.coalesce(i.req("done"), jobs.c.progress_done),
        "progress_total": func.coalesce(i.req("total"), jobs.c.progress_total),
        "lease_owner": null(),
        "lease_expires_at": null(),
        "last_error": null(),
    },
)

# No outcome: guarded on the claim holding the job, so a cancel asked does not refuse it.
RENEW = Transition(
    target=None,
    event=None,
    guards=lambda i: holds(i.token()),
    writes=lambda i: {"lease_expires_at": i.lease_ends, "updated_at": i.now},
)

PROGRESS = Transition(
    target=None,
    event=None,
    guards=lambda i: holds(i.token()),
    writes=lambda i: {
        "progress_done": i.req("done"),
        "progress_total": i.req("total"),
        "updated_at": i.now,
    },
)

# ``due`` (the store's clock + the delay) is the driver's: ``lease_ends`` stands for it.
RETRY = Transition(
    target=JobState.RETRY_WAIT,
    event="retry_scheduled",
    releases=True,
    guards=lambda i: fenced(i.token()),
    writes=lambda i: {
        "state": _state(JobState.RETRY_WAIT),
        "updated_at": i.now,
        "last_error": i.req("error"),
        "public_error": i.req("public"),
        "last_traceback": i.req("traceback"),
        "next_attempt_at": i.lease_ends,
        "lease_owner": null(),
        "lease_expires_at": null(),
    },
)

# Its guard is the caller's (the worker's claim token, or what a delivery's policy saw).
QUARANTINE = Transition(
    target=JobState.QUARANTINED,
    event="quarantined",
    releases=True,
    guards=lambda i: [state_in(sources_for(JobState.QUARANTINED))],
    writes=lambda i: {
        "state": _state(JobState.QUARANTINED),
        "updated_at": i.now,
        "quarantine_reason": i.req("reason"),
        "last_error": i.req("reason"),
        "public_error": i.req("public"),
        "lease_owner": null(),
        "lease_expires_at": null(),
        "next_attempt_at": null(),
    },
)


# The job's end at an operator's request: by the operator's action (``admin``) from a state
# no worker holds, or by the worker whose claim holds it, or by the reconciler once its
# lease has expired (``cancels``); each caller adds its own guard.
CANCEL = Transition(
    target=JobState.CANCELLED,
    event="cancelled",
    releases=True,
    guards=lambda i: [],
    writes=lambda i: {
        "state": _state(JobState.CANCELLED),
        "updated_at": i.now,
        "lease_owner": null(),
        "lease_expires_at": null(),
        "next_attempt_at": null(),
    },
)

# quarantined -> queued by an operator, with ``granted`` more attempts: ``attempt`` keeps
# counting, the budget becomes ``attempt + granted``.
REPLAY = Transition(
    target=JobState.QUEUED,
    event="replayed",
    guards=lambda i: [],
    writes=lambda i: {
        "state": _state(JobState.QUEUED),
        "updated_at": i.now,
        "max_attempts": jobs.c.attempt + i.req("granted"),
        "quarantine_reason": null(),
        "next_attempt_at": null(),
        "lease_owner": null(),
        "lease_expires_at": null(),
        "progress_done": null(),
        "progress_total": null(),
    },
)

# running -> retry_wait, due now, by the reconciler: the lease expired, its worker presumed
# lost (the next delivery claims it, or quarantines it if no attempt is left).
LEASE_EXPIRED = Transition(
    target=JobState.RETRY_WAIT,
    event="reconciled_lease_expired",  # repairs.RECONCILED_LEASE
    releases=True,
    guards=lambda i: [],
    writes=lambda i: {
        "state": _state(JobState.RETRY_WAIT),
        "updated_at": i.now,
        "lease_owner": null(),
        "lease_expires_at": null(),
        "next_attempt_at": i.now,
        "last_error": i.req("error"),
        "public_error": i.req("public"),
    },
)


def claimed_detail(worker_id: str, detail: Mapping[str, Any]) -> dict[str, Any]:
    """A ``claimed`` event's detail before the attempt (which the statement adds)."""
    return jsonable({"worker": worker_id, **detail})


def result_saved_detail(
    claim: Claim, result_key: str | None, result_meta: Mapping[str, Any]
) -> dict[str, Any]:
    """jobrelay's own fields, and the operation's metadata under ``meta`` of its own, as
    the operation gave it, so a job returning ``{"worker": …}`` or ``{"attempt": …}`` cannot
    overwrite the event's (the claim's attempt is the one recorded)."""
    return jsonable(
        {
            "resultKey": result_key,
            "worker": claim.worker_id,
            "attempt": claim.attempt,
            "meta": dict(result_meta),
        }
    )


def values_of(params: Mapping[str, Any]) -> Callable[[str], Any]:
    """``Inputs.req`` for a statement of one job: the request's values, bound as given."""
    return lambda name: params.get(name)


_PG = postgresql.dialect()  # type: ignore[no-untyped-call]


def guard_sql(guards: list[Any], dialect: Dialect | None = None) -> str:
    """Guards as SQL text (PostgreSQL's unless ``dialect``), for statements written in SQL.

    The values (states) are inlined; column expressions (``literal_column``) stay as written,
    so a guard may name a CTE's columns and bind parameters (``:b_slack``).
    """
    clause = and_(*guards).compile(dialect=dialect or _PG, compile_kwargs={"literal_binds": True})
    return str(clause)


def set_sql(sets: Mapping[str, Any], dialect: Dialect | None = None) -> str:
    """A SET list as SQL text, compiled as ``guard_sql`` compiles guards."""
    parts = []
    for name, value in sets.items():
        compiled = value.compile(dialect=dialect or _PG, compile_kwargs={"literal_binds": True})
        parts.append(f"{name} = {compiled}")
    return ",\n    ".join(parts)


__all__ = [
    "CANCEL",
    "CLAIM",
    "COMPLETABLE",
    "COMPLETE",
    "LEASE_EXPIRED",
    "PROGRESS",
    "QUARANTINE",
    "RENEW",
    "REPLAY",
    "RETRY",
    "Inputs",
    "Transition",
    "awaiting_admission",
    "claimable",
    "claimed_detail",
    "fenced",
    "guard_sql",
    "holds",
    "lease_expired",
    "outbox_admissible",
    "result_saved_detail",
    "set_sql",
    "state_in",
    "suspect",
    "values_of",
]
