"""What the store reads and writes, as plain records; and the one mapping from a jobs row.

No I/O here: the store modules build these from rows, and the roles pass them around.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import Row, Select, select

from jobrelay.domain.limits import JobLimit
from jobrelay.domain.policy import JobView
from jobrelay.domain.queues import DEFAULT_QUEUE, destination
from jobrelay.domain.states import JobState
from jobrelay.storage.tables import UTCDateTime, jobs

NOTIFY_CHANNEL = "jobrelay_outbox"
# A job ended (succeeded, quarantined, cancelled): ``App.wait``'s listeners re-read the jobs
# they wait on. One NOTIFY a statement, not a job (a completion batch sends one).
DONE_CHANNEL = "jobrelay_done"
WORK_DESTINATION = destination(DEFAULT_QUEUE)


def work_destination(queue: str = DEFAULT_QUEUE) -> str:
    """Where a job of ``queue`` is sent to run now (the topology's one mapping)."""
    return destination(queue)


def retry_destination(seconds: int, queue: str = DEFAULT_QUEUE) -> str:
    """Where a job of ``queue`` is sent to run again after ``seconds``."""
    return destination(queue, seconds)


@dataclass(frozen=True)
class NewJob:
    job_id: str
    type: str
    account_id: str | None  # None: a job enqueued on no account's behalf
    params: dict[str, Any]
    request_hash: str
    max_attempts: int
    idempotency_key: str | None = None
    headers: Mapping[str, str] | None = None  # message headers (trace context)
    destination: str | None = None  # the outbox destination of its first message (a queue)
    queue: str = DEFAULT_QUEUE  # the job's queue: where its retries and re-sends go
    # The id the same request had under the installation's previous id secret, while that
    # one still counts (a rotation's window): a job there is this request's job.
    previous_job_id: str | None = None
    # A delayed job's due time (``domain.delays``): its outbox row is held until then.
    run_at: datetime | None = None
    # Or its delay in seconds: the write adds it to the database's clock (``enqueue``).
    delay: float | None = None
    # The job whose success created it (a follow-up): named in its ``accepted`` event.
    parent_job_id: str | None = None
    # The limits per key it is under (``domain.limits``): admitted to the broker only once
    # each has room.
    limits: tuple[JobLimit, ...] = ()
    # The jobs it runs after (``after=``, ``storage.dependencies``): written ``waiting`` until
    # they have all ended; ``after_failure`` says what one that did not succeed does to it.
    after: tuple[str, ...] = ()
    after_failure: str = "cancel"
    # Its priority in its queue (0..9, higher first): stored with its limits, it orders the
    # admission of a prioritized queue's jobs (``storage.admission``).
    priority: int = 0


Clock = Callable[[], datetime]


def utc_now() -> datetime:
    return datetime.now(UTC)


@dataclass(frozen=True)
class Claim:
    """One claim of a job: the token every later write of that run is fenced on."""

    job_id: str
    attempt: int
    worker_id: str


class Won(frozenset[str]):
    """The job ids whose completion won, and ``wakes``: whether one of them gave back
    slots of its limits while a job is held back by its limits, so that the relays admit
    the next one now, not at their next poll (``OutcomesStore.complete_many`` wakes them;
    while no limit binds, completions wake nobody).

    ``dependants``: those that won and have jobs waiting for them (``storage.dependencies``),
    which the transaction must settle before its commit. ``deferred``: completions the hot
    statement (no transaction of the caller's) left alone because their job has dependants:
    they are to be sent again in a transaction that settles them."""

    wakes: bool
    dependants: frozenset[str]
    deferred: frozenset[str]

    def __new__(
        cls,
        won: Iterable[str] = (),
        wakes: bool = False,
        dependants: Iterable[str] = (),
        deferred: Iterable[str] = (),
    ) -> Won:
        ids = super().__new__(cls, won)
        ids.wakes = wakes
        ids.dependants = frozenset(dependants)
        ids.deferred = frozenset(deferred)
        return ids


class Renewed(frozenset[Claim]):
    """The claims a lease renewal found holding their job (so renewed), and among them
    ``cancel_requested``: those an operator has asked to cancel (``storage.cancels``).

    ``skipped``: claims not renewed because another transaction held their row locked (on
    PostgreSQL, typically their own completion): neither renewed nor lost, to be asked again.
    """

    cancel_requested: frozenset[Claim]
    skipped: frozenset[Claim]

    def __new__(
        cls,
        held: Iterable[Claim] = (),
        cancel_requested: Iterable[Claim] = (),
        skipped: Iterable[Claim] = (),
    ) -> Renewed:
        renewed = super().__new__(cls, held)
        renewed.cancel_requested = frozenset(cancel_requested)
        renewed.skipped = frozenset(skipped)
        return renewed


@dataclass(frozen=True)
class ClaimRequest:
    """A claim to make: of ``job_id`` for ``worker_id``, in a batch or alone.

    ``job_type``: the type the delivery names (None: any). ``seen_state``/``seen_attempt``:
    what the policy read, when it read the job first (a racing copy loses on them).
    ``alone``: made by a worker running nothing else (a suspect may be claimed only so).
    ``detail``: more of the ``claimed`` event.
    """

    job_id: str
    job_type: str | None
    worker_id: str
    detail: dict[str, Any]
    seen_state: str | None = None
    seen_attempt: int | None = None
    alone: bool = False


@dataclass(frozen=True)
class CompleteRequest:
    """A fenced completion. ``publish`` (make the staged result visible) and ``follow_ups``
    (jobs this success creates) run inside the completion's transaction, before its commit,
    only for a completion that won."""

    claim: Claim
    result_key: str | None
    result_meta: dict[str, Any]
    publish: Callable[[], Awaitable[None]] | None = None
    follow_ups: tuple[NewJob, ...] = ()
    # The value the job returned, as the JSON text stored (``storable.value_json``).
    result_value: str | None = None
    # The job's last progress (done, total) not yet written (``worker.progress``): the
    # success's statement writes it, no commit of its own. None: the job's stays.
    progress: tuple[int, int] | None = None

    @property
    def in_transaction(self) -> bool:
        """Whether it has a step of its own inside the completion's transaction."""
        return self.publish is not None or bool(self.follow_ups)


@dataclass(frozen=True)
class Fenced:
    """What a fenced write found: ``won``, or the attempt that holds the job now."""

    won: bool
    current_attempt: int | None = None
    current_state: JobState | None = None


@dataclass(frozen=True)
class JobRecord:
    id: str
    type: str
    account_id: str | None
    params: dict[str, Any]
    idempotency_key: str | None
    state: JobState
    attempt: int
    max_attempts: int
    result_key: str | None
    result_meta: dict[str, Any] | None
    last_error: str | None
    quarantine_reason: str | None
    next_attempt_at: datetime | None
    lease_owner: str | None
    lease_expires_at: datetime | None
    progress_done: int | None
    progress_total: int | None
    created_at: datetime
    updated_at: datetime
    published: bool
    unpublished_since: datetime | None  # oldest outbox row of this job still waiting
    last_publish_error: str | None
    # The store's clock when this row was read: what the policy judges leases and due times by.
    observed_at: datetime | None = None
    queue: str = DEFAULT_QUEUE  # the queue its messages go to (retries and re-sends too)
    public_error: str | None = None  # last_error as the account reads it (domain.disclosure)
    # The last failed attempt's traceback (worker.failures): operators' only, never an account's.
    last_traceback: str | None = None
    run_at: datetime | None = None  # a delayed job's due time (kept after it ran)

    def waiting_for_run_at(self, now: datetime) -> bool:
        """Queued, and its run time not reached: waiting on purpose, not stuck."""
        return self.state is JobState.QUEUED and self.run_at is not None and self.run_at > now

    # An operator asked to cancel it while it ran (``storage.cancels``): when, who, why.
    cancel_requested_at: datetime | None = None
    cancel_requested_by: str | None = None
    cancel_reason: str | None = None
    # Limits per key (``domain.limits``): the job's, and since when it holds its admission
    # (None: waiting for it, or none needed) and since when it has been held back.
    limits: tuple[JobLimit, ...] = ()
    admitted_at: datetime | None = None
    throttled_at: datetime | None = None
    # The JSON value the job returned, committed with ``succeeded`` (None: none).
    result: Any = None
    # Written with ``after=`` (``storage.dependencies``): how many of the jobs it runs after
    # have not ended (None: it runs after none), and what one that failed does to it.
    waiting_for: int | None = None
    after_failure: str | None = None
    priority: int = 0  # in its queue, higher first (``NewJob.priority``)

    @property
    def awaiting_admission(self) -> bool:
        """Under limits, not finished, and not (or no longer) admitted: its next message
        waits in the outbox for its limits to have room."""
        return bool(self.limits) and self.admitted_at is None and not self.state.is_terminal

    def view(self) -> JobView:
        return JobView(
            state=self.state,
            attempt=self.attempt,
            max_attempts=self.max_attempts,
            lease_owner=self.lease_owner,
            lease_expires_at=self.lease_expires_at,
            next_attempt_at=self.next_attempt_at,
            result_key=self.result_key,
            awaiting_admission=self.awaiting_admission,
        )


# A completion's answer: whether it won, or what its own step (the publication of its staged
# result) raised, in which case nothing of it was committed.
Completion = bool | Exception
# A claim's answer: the claim, the job as claimed, and the state it left; None if it lost.
Claimed = tuple[Claim, JobRecord, JobState] | None


@dataclass(frozen=True)
class LinkedJob:
    """A job another one runs after, or that runs after it: its id and state (None: pruned)."""

    job_id: str
    state: JobState | None


@dataclass(frozen=True)
class JobLinks:
    """What ``after=`` ties a job to, for the people reading it: the first jobs it runs
    after (in the order given) and how many in all, how many of those have not ended, and
    the first jobs waiting for it and how many."""

    dependencies: tuple[LinkedJob, ...]
    dependency_count: int
    dependants: tuple[LinkedJob, ...]
    dependant_count: int

    def after_json(self, job: JobRecord) -> dict[str, Any] | None:
        if not self.dependency_count:
            return None
        return {
            "total": self.dependency_count,
            "waitingFor": job.waiting_for if job.state is JobState.WAITING else 0,
            "afterFailure": job.after_failure,
            "jobs": [_linked_json(j) for j in self.dependencies],
        }

    def dependants_json(self) -> dict[str, Any] | None:
        if not self.dependant_count:
            return None
        return {"total": self.dependant_count, "jobs": [_linked_json(j) for j in self.dependants]}


def _linked_json(job: LinkedJob) -> dict[str, Any]:
    return {"jobId": job.job_id, "state": None if job.state is None else job.state.value}


@dataclass(frozen=True)
class PendingEvent:
    """An event to write later, in a batch (what happened after an outcome, e.g. ``ack_sent``)."""

    job_id: str
    kind: str
    at: datetime
    detail: dict[str, Any]


@dataclass(frozen=True)
class EventRecord:
    at: datetime
    kind: str
    detail: dict[str, Any]
    # Its row's id (``job_events.id``): what a stream of the timeline resumes after.
    id: int | None = None


@dataclass(frozen=True)
class OutboxRow:
    id: int
    job_id: str
    destination: str
    body: bytes
    headers: dict[str, Any]
    publish_attempts: int
    # When the relay took the row to send it, by the store's clock: before any worker could
    # receive the message, so its ``published`` event is stamped with this, not the confirm.
    taken_at: datetime


@dataclass(frozen=True)
class TokenRecord:
    account_id: str | None
    is_admin: bool
    expires_at: datetime | None = None


@dataclass(frozen=True)
class TokenInfo:
    """What ``jobrelay token list`` shows of a token: everything but the secret."""

    id: int
    account_id: str | None
    is_admin: bool
    label: str | None
    created_at: datetime
    last_used_at: datetime | None
    expires_at: datetime | None
    revoked_at: datetime | None

    def state(self, now: datetime) -> str:
        if self.revoked_at is not None:
            return "revoked"
        if self.expires_at is not None and self.expires_at <= now:
            return "expired"
        return "active"


def job_record(row: Row[Any] | Mapping[str, Any]) -> JobRecord:
    """A job from a row: SQLAlchemy's, or any mapping by column name (an asyncpg record)."""
    m = row._mapping if isinstance(row, Row) else row
    return JobRecord(
        id=m["id"],
        type=m["type"],
        account_id=m["account_id"],
        params=m["params"] or {},
        idempotency_key=m["idempotency_key"],
        state=JobState(m["state"]),
        attempt=m["attempt"],
        max_attempts=m["max_attempts"],
        result_key=m["result_key"],
        result_meta=m["result_meta"],
        last_error=m["last_error"],
        quarantine_reason=m["quarantine_reason"],
        next_attempt_at=m["next_attempt_at"],
        lease_owner=m["lease_owner"],
        lease_expires_at=m["lease_expires_at"],
        progress_done=m["progress_done"],
        progress_total=m["progress_total"],
        created_at=m["created_at"],
        updated_at=m["updated_at"],
        # A row read without the outbox columns (a claim's RETURNING) says nothing of them.
        published=m.get("unpublished_since") is None and (m.get("published_count") or 0) > 0,
        unpublished_since=aware_time(m.get("unpublished_since")),
        last_publish_error=m.get("last_publish_error"),
        observed_at=aware_time(m.get("observed_at")),
        queue=m.get("queue") or DEFAULT_QUEUE,
        public_error=m.get("public_error"),
        last_traceback=m.get("last_traceback"),
        run_at=aware_time(m.get("run_at")),
        cancel_requested_at=aware_time(m.get("cancel_requested_at")),
        cancel_requested_by=m.get("cancel_requested_by"),
        cancel_reason=m.get("cancel_reason"),
        limits=tuple(JobLimit.from_json(limit) for limit in m.get("limits") or ()),
        admitted_at=aware_time(m.get("admitted_at")),
        throttled_at=aware_time(m.get("throttled_at")),
        result=m.get("result_value"),
        waiting_for=m.get("waiting_for"),
        priority=m.get("priority") or 0,
        after_failure=m.get("after_failure"),
    )


# One instance: a SQLAlchemy type's constructor costs about a microsecond, and a job read
# from a row converts six of its times (``job_record``, per claimed job in a worker).
_UTC_TIME = UTCDateTime()


def aware_time(value: Any) -> datetime | None:
    # Aggregates (min) bypass the column type on SQLite and come back as text.
    return _UTC_TIME.process_result_value(value, None)  # type: ignore[arg-type]


def event_job(job_id: str) -> Select[tuple[str]]:
    """The job a state-less event is for, key-share locked as it is found: the hold its
    foreign key's trigger took, which keeps retention from deleting the job under the event
    (``storage.tables``; ``RECORD_MANY`` is the same on PostgreSQL's hot path). No row: no
    such job, and no event."""
    return select(jobs.c.id).where(jobs.c.id == job_id).with_for_update(key_share=True)


def jsonable(detail: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in detail.items():
        out[key] = value.isoformat() if isinstance(value, datetime) else value
    return out


def claimed_in_order(
    requests: Sequence[ClaimRequest],
    won: Mapping[str, Mapping[Any, Any]],
    left: Mapping[str, str],
) -> list[Claimed]:
    """A batch's claims answered in request order: for each request, the claim, the job as
    its statement returned it (``won``, by id) and the state it left (``left``); or None."""
    results: list[Claimed] = []
    for request in requests:
        row = won.get(request.job_id)
        if row is None:
            results.append(None)
            continue
        job = job_record(row)
        claim = Claim(job.id, job.attempt, request.worker_id)
        results.append((claim, job, JobState(left[request.job_id])))
    return results


def outbox_row(r: Mapping[Any, Any], publish_attempts: int) -> OutboxRow:
    """An outbox row as a relay claimed it (``publish_attempts`` counting this claim)."""
    return OutboxRow(
        id=r["id"],
        job_id=r["job_id"],
        destination=r["destination"],
        body=r["body"].encode(),
        headers=dict(r["headers"] or {}),
        publish_attempts=publish_attempts,
        taken_at=r["taken_at"],
    )
