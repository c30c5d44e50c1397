"""Every error jobrelay raises on purpose, in one tree.

    JobrelayError
    ├── ConfigError            a setting is malformed or points at nothing (names the variable)
    ├── StoreError             the database failed or is unreachable
    ├── TransportError         the broker failed or is unreachable
    │   └── PublishError       a message was not confirmed (nack, basic.return, timeout)
    ├── IdempotencyConflict    the same Idempotency-Key came with a different body
    ├── JobNotFound            no such job (or not visible to the caller)
    └── OperationError         raised by an operation while it runs
        ├── TransientError     worth retrying later (timeouts, unreachable services)
        │   └── EffectOutcomeUnknown  an external effect may or may not have happened
        └── PermanentError     retrying cannot help (invalid parameters, unknown type)

Adapters translate library exceptions into this tree at their boundary, so the relay,
worker and API never need to know which database driver or AMQP client is underneath.
"""

from __future__ import annotations


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


class JobNotFound(JobrelayError):
    """No job with that id, or one the caller may not see."""


class OperationError(JobrelayError):
    """Raised by an operation while it runs; the subclass decides retry or quarantine."""

    code = "operation_error"


class TransientError(OperationError):
    """Retrying later may succeed."""

    code = "transient"


class EffectOutcomeUnknown(TransientError):
    """The connection broke while an external effect was being handed over (an SMTP session
    dropped mid-DATA, a read timeout): the other side may have accepted it. Retried like any
    transient failure, but the effects ledger keeps its doubt instead of recording a refusal.
    """

    code = "effect_outcome_unknown"


class PermanentError(OperationError):
    """Retrying cannot succeed; the job is quarantined with this reason."""

    code = "permanent"
