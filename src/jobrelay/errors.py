"""Every error jobrelay raises on purpose, in one tree.

    JobrelayError
    ├── ConfigError            a setting is malformed or points at nothing (names the variable)
    ├── StoreError             the database failed or is unreachable
    │   ├── StoreDataError     the database refused the data itself: retrying it cannot help
    │   └── StoreBusy          SQLite's write lock stayed held by another past the busy timeout
    ├── TransportError         the broker failed or is unreachable
    │   └── PublishError       a message was not confirmed (nack, basic.return, timeout)
    ├── IdempotencyConflict    the same Idempotency-Key came with a different body
    ├── InvalidParams          a job's parameters do not validate (names each bad field)
    ├── JobNotFound            no such job (or not visible to the caller)
    └── OperationError         raised by an operation while it runs
        ├── TransientError     worth retrying later (timeouts, unreachable services)
        │   ├── Retry          raised by a job to ask for a retry, with its reason
        │   ├── EffectOutcomeUnknown  an external effect may or may not have happened
        │   └── AttemptSuperseded     this attempt's claim no longer holds the job: no effect
        └── PermanentError     retrying cannot help (invalid parameters, unknown type)
            └── Permanent      raised by a job to be quarantined at once, with its reason

Adapters translate library exceptions into this tree at their boundary, so the relay,
worker and API never need to know which database driver or AMQP client is underneath.
"""

from __future__ import annotations

import math
from datetime import timedelta


class JobrelayError(Exception):
    """Root of every error jobrelay raises deliberately."""


class ConfigError(JobrelayError):
    """A setting is malformed or unusable; the message names the variable."""

    def __init__(self, variable: str, problem: str) -> None:
        super().__init__(f"{variable}: {problem}")
        self.variable = variable
        self.problem = problem


class StoreError(JobrelayError):
    """The database failed; the caller's transaction did not commit."""


class StoreDataError(StoreError):
    """The database refused this write's data (a NUL byte in text, a value out of range, a
    constraint, a value that is not JSON): unlike an outage, the same write can never succeed,
    so it is not retried as it is. The caller stores something else (the reason) instead."""


class StoreBusy(StoreError):
    """SQLite answered that another connection still holds its one write lock (past the
    busy timeout). Not an outage: the database answers; it only cannot take this write yet,
    and no other write (a takeover of a claim included) can happen meanwhile either."""


class TransportError(JobrelayError):
    """The broker failed or could not be reached."""


class PublishError(TransportError):
    """A publish was not confirmed.

    ``unknown`` is true when we cannot tell whether the broker took the message (a
    confirm timeout or a dropped connection); the relay treats both cases the same way,
    by leaving the outbox row unpublished so it is sent again.
    """

    def __init__(self, message: str, *, unknown: bool = False) -> None:
        super().__init__(message)
        self.unknown = unknown


class IdempotencyConflict(JobrelayError):
    """The Idempotency-Key was used before with a different request body."""


class InvalidDependencies(JobrelayError):
    """``after=`` names jobs that do not exist or that the caller's account may not read,
    or more than ``JOBRELAY_MAX_DEPENDENCIES``, or an ``after_failure`` that is neither
    ``cancel`` nor ``run``; nothing was written. ``missing``: the ids refused, in the order
    given (the same for a job that does not exist and one of another account's, so that the
    answer says nothing of other accounts' jobs)."""

    def __init__(self, message: str, missing: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.missing = missing


class InvalidParams(JobrelayError):
    """A job's parameters do not validate; nothing was written.

    ``errors`` lists each bad field as ``{"field": "a.b", "message": "..."}``, and the
    message names them all, so a caller can show it as it is.
    """

    def __init__(self, job_type: str, errors: list[dict[str, str]]) -> None:
        fields = "; ".join(f"{e['field'] or '(params)'}: {e['message']}" for e in errors)
        super().__init__(f"invalid params for {job_type}: {fields}")
        self.job_type = job_type
        self.errors = errors


class InvalidRunTime(JobrelayError):
    """A job's ``delay`` or ``run_at`` is unusable (negative, naive, both given, too far
    ahead); nothing was written. ``field`` names the argument as the caller spelt it."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}")
        self.field = field
        self.problem = problem


class JobNotFound(JobrelayError):
    """No job with that id, or one the caller may not see."""


class JobFailed(JobrelayError):
    """``App.result``: the job ended without succeeding (``state``: ``quarantined`` or
    ``cancelled``), with ``reason`` (the quarantine's reason, or the cancel's)."""

    def __init__(self, job_id: str, state: str, reason: str | None) -> None:
        super().__init__(f"job {job_id} {state}: {reason or 'no reason recorded'}")
        self.job_id = job_id
        self.state = state
        self.reason = reason


class OperationError(JobrelayError):
    """Raised by an operation while it runs; the subclass decides retry or quarantine."""

    code = "operation_error"


class TransientError(OperationError):
    """Retrying later may succeed."""

    code = "transient"


class Retry(TransientError):
    """Raise from a job to fail this attempt and retry it later (while attempts remain).

    ``delay`` (seconds, or a ``timedelta``) sets this attempt's next delay instead of the job
    type's ``retry_delays``: exact to the second (rounded up) on the local transport, the
    smallest declared delay tier at or above it on RabbitMQ (the longest tier at most).
    """

    code = "retry"

    def __init__(self, reason: str, *, delay: float | timedelta | None = None) -> None:
        super().__init__(reason)
        seconds = delay.total_seconds() if isinstance(delay, timedelta) else delay
        if seconds is not None and not (math.isfinite(seconds) and seconds > 0):
            raise ValueError(f"Retry delay must be positive seconds, got {delay!r}")
        self.delay: float | None = None if seconds is None else float(seconds)


class EffectOutcomeUnknown(TransientError):
    """The connection broke while an external effect was being handed over (an SMTP session
    dropped mid-DATA, a read timeout): the other side may have accepted it. Retried like any
    transient failure, but the effects ledger keeps its doubt instead of recording a refusal.
    """

    code = "effect_outcome_unknown"


class AttemptSuperseded(TransientError):
    """The effects ledger refused to start an effect for an attempt whose claim no longer
    holds the job (a takeover after its lease lapsed): the live attempt owns the effect, and
    this one must stop before it sends anything."""

    code = "attempt_superseded"


class PermanentError(OperationError):
    """Retrying cannot succeed; the job is quarantined with this reason."""

    code = "permanent"


class Permanent(PermanentError):
    """Raise from a job to quarantine it at once, keeping ``reason`` for the operator."""

    code = "permanent"
