"""The delivery policy: what the worker saw -> the job's new state + what to do with the delivery.

This is ARCHITECTURE.md's decision table written as code. The worker gathers facts (the job
row, the clock, the outcome of the operation), turns them into an ``Observation`` and asks
``decide`` what to do; it never decides on its own. Keeping the table pure means every row,
and every illegal combination, is a plain unit test.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from enum import StrEnum

from jobrelay.domain.backoff import Backoff
from jobrelay.domain.disclosure import (
    FAILED,
    INVALID_MESSAGE,
    WORKER_LOST,
    exhausted,
    public_error,
)
from jobrelay.domain.states import JobState, can_transition


class Action(StrEnum):
    RUN = "run"  # claim the job and run the operation
    ACK = "ack"  # done with this delivery
    REJECT = "reject"  # reject without requeue: dead-letter exchange -> quarantine queue
    DEFER = "defer"  # re-check later through the delay route, then ack this delivery


@dataclass(frozen=True)
class JobView:
    """The facts about a job that the policy needs; read from the store, never written."""

    state: JobState
    attempt: int
    max_attempts: int
    lease_owner: str | None = None
    lease_expires_at: datetime | None = None
    next_attempt_at: datetime | None = None
    result_key: str | None = None
    # Under limits and waiting for its admission (``domain.limits``): not its turn yet.
    awaiting_admission: bool = False


# --- observations: what the worker saw ---------------------------------------------------


@dataclass(frozen=True)
class ReadyToRun:
    """The job may be claimed now."""

    state: JobState


@dataclass(frozen=True)
class AwaitingAdmission:
    """A copy of a job that waits for its limits' room (its own message is not sent yet)."""


@dataclass(frozen=True)
class AwaitingDependencies:
    """A copy of a job written with ``after=`` whose dependencies have not all ended (a
    re-sent message of it): it is queued, with a message of its own, when they have."""


@dataclass(frozen=True)
class ResultSaved:
    result_key: str | None


@dataclass(frozen=True)
class TransientFailure:
    error: str  # the raw text, for operators
    attempt: int
    max_attempts: int
    retry_delays: tuple[int, ...]
    public: str = FAILED  # what the job's account reads instead (domain.disclosure)
    # This attempt's own next delay (``Retry(delay=...)``, as the topology can wait it),
    # instead of ``retry_delays`` or ``backoff``.
    delay: float | None = None
    asked_delay: float | None = None  # what the job asked, kept in the event
    traceback: str | None = None  # where the job raised, for operators (observe.tracebacks)
    # The type's back-off instead of ``retry_delays``, and the worker's random draw in
    # [-1, 1] for its jitter (drawn outside, so this table stays pure).
    backoff: Backoff | None = None
    draw: float = 0.0


@dataclass(frozen=True)
class PermanentFailure:
    error: str
    public: str = FAILED
    traceback: str | None = None


@dataclass(frozen=True)
class InvalidPayload:
    reason: str
    job_state: JobState | None  # None: the job is unknown or its id unreadable
    # A well-formed message no worker knew (type or version) after every deferral: the
    # payload was fine, and the reason says what was unknown.
    unknown: bool = False


@dataclass(frozen=True)
class AttemptsExhausted:
    """Every attempt was consumed before this delivery (a worker died mid-run, repeatedly)."""

    attempt: int
    state: JobState
    # Why the last attempt's delivery went back, when a worker said so (its ``released``
    # event): then the attempts were not lost to crashes, and the reason must not say so.
    last_release: str | None = None


@dataclass(frozen=True)
class DeliveryForFinished:
    state: JobState
    result_key: str | None


@dataclass(frozen=True)
class LeaseHeld:
    owner: str


@dataclass(frozen=True)
class EarlyRetryDelivery:
    """A copy of an older message for a job whose retry is scheduled but not yet due.

    The scheduled retry already sits in the outbox or the delay route, so this copy is
    redundant; running it would spend an attempt before the back-off elapsed.
    """

    next_attempt_at: datetime


Observation = (
    ReadyToRun
    | ResultSaved
    | TransientFailure
    | PermanentFailure
    | InvalidPayload
    | AttemptsExhausted
    | DeliveryForFinished
    | LeaseHeld
    | EarlyRetryDelivery
    | AwaitingAdmission
    | AwaitingDependencies
)


@dataclass(frozen=True)
class Decision:
    new_state: JobState | None  # None: the job row is not changed
    action: Action
    event: str  # the job_events kind that records this decision
    reason: str | None = None
    # The reason as the job's account reads it: a code and a message written for customers,
    # never the raw text of ``reason`` (domain.disclosure).
    public: str | None = None
    retry_delay: float | None = None  # seconds until the retry (a delay tier's, or ``held``)
    # The retry waits in the database until due, then goes to its work queue: a back-off's
    # delay is any number of seconds, which no fixed delay queue holds.
    held: bool = False


# Slack for clocks: a retry delivered by the broker a moment before the database clock says
# it is due is still treated as due.
RETRY_SLACK = timedelta(seconds=1)


def observe_delivery(job: JobView, now: datetime) -> Observation:
    """Classify a well-formed delivery for an existing job, before any work happens."""
    if job.state.is_terminal:
        return DeliveryForFinished(job.state, job.result_key)
    if job.state is JobState.WAITING:
        return AwaitingDependencies()
    lease = job.lease_expires_at
    if job.state is JobState.RUNNING and lease is not None and lease > now:
        return LeaseHeld(job.lease_owner or "unknown")
    due = job.next_attempt_at
    if job.state is JobState.RETRY_WAIT and due is not None and due - RETRY_SLACK > now:
        return EarlyRetryDelivery(due)
    if job.awaiting_admission:
        return AwaitingAdmission()
    if job.attempt >= job.max_attempts:
        return AttemptsExhausted(job.attempt, job.state)
    return ReadyToRun(job.state)


def retry_delay_for(attempt: int, delays: tuple[int, ...]) -> int:
    """The back-off after attempt ``attempt`` (1-based) failed; the last tier repeats."""
    if not delays:
        raise ValueError("retry delays must not be empty")
    return delays[min(attempt, len(delays)) - 1]


def decide(observation: Observation) -> Decision:
    """The decision table. Exhaustive over Observation; mypy checks the match."""
    match observation:
        case ReadyToRun(state):
            _require(state, JobState.RUNNING)
            return Decision(JobState.RUNNING, Action.RUN, "claimed")
        case ResultSaved(result_key):
            return Decision(JobState.SUCCEEDED, Action.ACK, "result_saved", reason=result_key)
        case TransientFailure(
            error, attempt, max_attempts, delays, public, delay, backoff=backoff, draw=draw
        ):
            if attempt >= max_attempts:
                return Decision(
                    JobState.QUARANTINED,
                    Action.REJECT,
                    "quarantined",
                    reason=f"attempts exhausted ({attempt}/{max_attempts}): {error}",
                    public=exhausted(attempt, max_attempts, public),
                )
            if delay is None:
                delay = (
                    retry_delay_for(attempt, delays)
                    if backoff is None
                    else backoff.delay(attempt, draw)
                )
            return Decision(
                JobState.RETRY_WAIT,
                Action.ACK,
                "retry_scheduled",
                reason=error,
                retry_delay=delay,
                public=public,
                held=backoff is not None,
            )
        case PermanentFailure(error, public):
            return Decision(
                JobState.QUARANTINED, Action.REJECT, "quarantined", reason=error, public=public
            )
        case InvalidPayload(reason, job_state, unknown):
            if job_state is None or job_state.is_terminal or job_state in _HELD_ELSEWHERE:
                # A bad message never changes a finished job, nor one a worker is running from
                # a good copy; the bad copy itself still goes to the quarantine queue.
                return Decision(None, Action.REJECT, "invalid_message", reason=reason)
            _require(job_state, JobState.QUARANTINED)
            return Decision(
                JobState.QUARANTINED,
                Action.REJECT,
                "quarantined",
                reason=reason if unknown else f"invalid payload: {reason}",
                public=public_error(INVALID_MESSAGE),
            )
        case AttemptsExhausted(attempt, state, last_release):
            _require(state, JobState.QUARANTINED)
            lost = (
                "worker lost before an outcome"
                if last_release is None
                else f"no outcome: the last delivery was released after {last_release}"
            )
            return Decision(
                JobState.QUARANTINED,
                Action.REJECT,
                "quarantined",
                reason=f"attempts exhausted ({attempt} claimed, {lost})",
                public=public_error(WORKER_LOST),
            )
        case DeliveryForFinished(state, result_key):
            if state is JobState.QUARANTINED:
                # The worker that quarantined the job may have died before its reject: send
                # this copy to the quarantine queue too, so the broker-side surface matches.
                return Decision(None, Action.REJECT, "duplicate_rejected", reason=state.value)
            return Decision(None, Action.ACK, "duplicate_acked", reason=result_key or state.value)
        case LeaseHeld(owner):
            return Decision(None, Action.DEFER, "deferred", reason=f"lease held by {owner}")
        case AwaitingAdmission():
            # A copy from before its admission ended (a retry, a re-send): its own message
            # waits in the outbox and is published when its limits have room.
            return Decision(None, Action.ACK, "duplicate_acked", reason="waiting for its limits")
        case AwaitingDependencies():
            return Decision(
                None, Action.ACK, "duplicate_acked", reason="waiting for its dependencies"
            )
        case EarlyRetryDelivery(next_attempt_at):
            return Decision(
                None,
                Action.ACK,
                "duplicate_acked",
                reason=f"retry due {next_attempt_at.isoformat()}",
            )


# A bad copy never changes these: a worker runs the job from a good copy, or its
# dependencies have not all ended (it has no message of its own yet).
_HELD_ELSEWHERE = frozenset({JobState.RUNNING, JobState.WAITING})


def _require(source: JobState, target: JobState) -> None:
    if not can_transition(source, target):
        raise ValueError(f"illegal transition {source} -> {target}")
