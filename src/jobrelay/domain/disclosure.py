"""What an account token may read of its own job: the job's story, not the operators'.

A customer reading ``/events`` or ``/explain`` needs the states, the attempts and why they
failed. They must not learn who operated on it (``token#5 (support-alice)``,
``cli:root@host``), what an operator wrote as a reason, which worker or relay host did what,
or anything an infrastructure error quotes. Admin tokens see everything; this module is only
the account view.

Deny by default, twice. An event kind that is not listed here is shown with an empty detail,
and a detail key that is not listed is left out, so a key added to an event later is private
until someone decides otherwise here. And no raw error text ever reaches an account: an
earlier version showed it with URLs, addresses and host names replaced by patterns, and the
patterns leaked (``mailhub.internal``, a server path, unbracketed IPv6, ``MINIO``, S3's
``AccessDenied`` with its ARN). Instead, when a job fails, the worker writes next to the raw
text (kept for operators) a *public error*: a code and a message written for customers,
either by jobrelay (``temporary_failure: a temporary failure; it is retried``) or by the job
itself, through the message of ``jobrelay.Retry`` / ``jobrelay.Permanent`` (code ``retry`` /
``refused``). The account view shows only that; where there is none (a row from before
migration 0010, an event without one) it shows a fixed message per kind.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# Codes of the public error. The job's own words: RETRY and REFUSED; jobrelay's: the rest.
RETRY = "retry"
REFUSED = "refused"
TEMPORARY = "temporary_failure"
UNEXPECTED = "unexpected_error"
INTERRUPTED = "interrupted"
ATTEMPTS_EXHAUSTED = "attempts_exhausted"
INVALID_MESSAGE = "invalid_message"
WORKER_LOST = "worker_lost"
EFFECT_REFUSED = "effect_refused"
DUPLICATE = "duplicate"
DEPENDENCY_FAILED = "dependency_failed"
UNKNOWN = "failed"
MESSAGES: Mapping[str, str] = {
    TEMPORARY: "a temporary failure; it is retried while attempts remain",
    UNEXPECTED: "an unexpected error in the job; it is retried while attempts remain",
    INTERRUPTED: "the run was interrupted; it is retried while attempts remain",
    INVALID_MESSAGE: "the job's message could not be read",
    WORKER_LOST: "the worker running the job stopped before it finished",
    EFFECT_REFUSED: "the receiving side refused it",
    DUPLICATE: "a second copy of the job's message, settled without running it",
    REFUSED: "the job cannot succeed",
    DEPENDENCY_FAILED: "a job it was to run after did not succeed",
    UNKNOWN: "the job failed; the operators have the details",
}
MAX_PUBLIC = 500  # characters of a public error (the job's message is cut there)


def public_error(code: str, message: str | None = None) -> str:
    """``code: message`` as an account reads it; jobrelay's message for ``code`` by default."""
    # One line, no control characters (a NUL cannot be stored on PostgreSQL).
    text = " ".join("".join(c if c.isprintable() else " " for c in message or "").split())
    return f"{code}: {text or MESSAGES.get(code, MESSAGES[UNKNOWN])}"[:MAX_PUBLIC]


def exhausted(attempt: int, max_attempts: int, last: str) -> str:
    """The public error of a job quarantined after its last attempt failed with ``last``."""
    return public_error(
        ATTEMPTS_EXHAUSTED, f"{attempt} of {max_attempts} attempts failed; the last: {last}"
    )


FAILED = public_error(UNKNOWN)

# Free text that may quote an error from the database, the broker or the result store:
# shown as the event's public error (``publicError``) or the kind's fixed message.
_TEXT = "text"
_VALUE = "value"

# kind -> {detail key: _VALUE (shown as is) | _TEXT (shown redacted)}
ACCOUNT_EVENT_FIELDS: Mapping[str, Mapping[str, str]] = {
    "accepted": {
        "type": _VALUE,
        "parentJobId": _VALUE,
        "runAt": _VALUE,
        "after": _VALUE,  # how many jobs it runs after (``after=``)
        "afterFailure": _VALUE,
    },
    "dependencies_met": {"dependencies": _VALUE, "failed": _VALUE},
    "published": {},  # destination, outbox id and relay are the operators' business
    # Limits per key (``domain.limits``): held back first (which limit, which key, why), and
    # let through; the keys are the account's own values (its params).
    "throttled": {"limit": _VALUE, "key": _VALUE, "reason": _TEXT},
    "admitted": {"limits": _VALUE, "keys": _VALUE, "rate": _VALUE},
    "claimed": {"attempt": _VALUE, "redelivered": _VALUE},
    # result_saved also carries the operation's own metadata (Result.meta): see below.
    "result_saved": {"resultKey": _VALUE, "attempt": _VALUE, "meta": _VALUE},
    "follow_up_accepted": {"jobId": _VALUE, "type": _VALUE},
    "retry_scheduled": {
        "error": _TEXT,
        "delaySeconds": _VALUE,
        "askedDelaySeconds": _VALUE,  # the job's own Retry(delay=...)
        "nextAttemptAt": _VALUE,
        "attempt": _VALUE,
    },
    "quarantined": {"reason": _TEXT, "attempt": _VALUE},
    "deferred": {"delaySeconds": _VALUE},  # the reason names the worker holding the lease
    "duplicate_acked": {"reason": _TEXT},
    "duplicate_rejected": {"reason": _TEXT},
    "invalid_message": {"reason": _TEXT},
    "lease_lost": {"attempt": _VALUE, "currentAttempt": _VALUE, "currentState": _VALUE},
    "ack_sent": {"attempt": _VALUE},
    "rejected": {"attempt": _VALUE},
    "settle_lost": {"attempt": _VALUE},
    "released": {"reason": _TEXT},
    "dead_lettered": {
        "reason": _VALUE,
        "deliveries": _VALUE,
        "limit": _VALUE,
    },  # jobrelay's  # which worker, and its delivery count, are operators'
    "replayed": {"previousReason": _TEXT, "attempt": _VALUE, "maxAttempts": _VALUE},
    # Not who, not why, nor which worker: the operator's note and the operators' machines.
    "cancel_requested": {"attempt": _VALUE},
    "cancelled": {
        "previousState": _VALUE,
        "attempt": _VALUE,
        "leaseExpired": _VALUE,
        # Cancelled because a job it was to run after did not succeed (the account's own).
        "dependency": _VALUE,
        "dependencyState": _VALUE,
    },
    "resent": {},  # not who, not why: that is the operator's note
    "reconciled_lease_expired": {"leaseExpiredAt": _VALUE, "attempt": _VALUE},
    "reconciled_retry_overdue": {"nextAttemptAt": _VALUE, "attempt": _VALUE},
    "reconciled_queued_unclaimed": {},
    "effect_sending": {"effect": _VALUE, "messageId": _VALUE, "attempt": _VALUE},
    "effect_sent": {"effect": _VALUE, "messageId": _VALUE, "state": _VALUE},
    "effect_refused": {"effect": _VALUE, "state": _VALUE, "error": _TEXT},
    "possible_duplicate": {
        "effect": _VALUE,
        "messageId": _VALUE,
        "attempt": _VALUE,
        "previous": _VALUE,
    },
    "effect_skipped": {"effect": _VALUE, "state": _VALUE, "messageId": _VALUE, "attempt": _VALUE},
    "effect_fenced": {  # not the worker
        "effect": _VALUE,
        "attempt": _VALUE,
        "currentAttempt": _VALUE,
        "currentState": _VALUE,
    },
    # On a periodic tick's job (which is on no account today, so only admins read it).
    "scheduled": {"schedule": _VALUE, "tick": _VALUE, "delaySeconds": _VALUE},  # not the host
    "ticks_skipped": {
        "schedule": _VALUE,
        "reason": _VALUE,
        "count": _VALUE,
        "countComplete": _VALUE,
        "first": _VALUE,
        "last": _VALUE,
        "ticks": _VALUE,
    },
}
# result_saved: jobrelay's own keys are resultKey, worker and attempt; ``meta`` is the metadata
# the job returned about its result (rows, bytes, sha256 for report.export), which is the
# customer's. The worker is not. Events written before ``meta`` had the metadata beside
# jobrelay's keys: every other key of those is the customer's too.
_RESULT_PRIVATE = frozenset({"worker"})

# What a _TEXT field of an event shows when the event carries no public error.
_FALLBACK: Mapping[str, str] = {
    "duplicate_acked": public_error(DUPLICATE),
    "duplicate_rejected": public_error(DUPLICATE),
    "invalid_message": public_error(INVALID_MESSAGE),
    "effect_refused": public_error(EFFECT_REFUSED),
}
PUBLIC_KEY = "publicError"  # the event detail key the worker writes it under


def public_detail(public: str | None) -> dict[str, str]:
    """The event detail that carries ``public`` (none without one)."""
    return {} if public is None else {PUBLIC_KEY: public}


def account_error(raw: str | None, public: str | None) -> str | None:
    """The account's view of a job row's ``last_error`` / ``quarantine_reason``: its public
    error, never ``raw``; None when there is no error at all."""
    if raw is None:
        return None
    return public or FAILED


def account_detail(kind: str, detail: Mapping[str, Any]) -> dict[str, Any]:
    """The part of one event's detail an account token may see."""
    fields = ACCOUNT_EVENT_FIELDS.get(kind, {})
    shown: dict[str, Any] = {}
    for key, value in detail.items():
        how = fields.get(key)
        if how is None and kind == "result_saved" and key not in _RESULT_PRIVATE:
            how = _VALUE
        if how is None:
            continue
        if how == _TEXT:
            public = detail.get(PUBLIC_KEY)
            value = public if isinstance(public, str) else _FALLBACK.get(kind, FAILED)
        shown[key] = value
    return shown
