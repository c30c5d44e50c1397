"""What an account token may read of its own job: the job's story, not the operators'.

A customer reading ``/events`` or ``/explain`` needs the states, the attempts and the errors
of their job. They must not learn who operated on it (``token#5 (support-alice)``,
``cli:root@host``), what an operator wrote as a reason, which worker or relay host did what,
or the internal endpoints an infrastructure error quotes (an S3 error carries the endpoint's
URL, a database error its address). Admin tokens see everything; this module is only the
account view.

Deny by default: an event kind that is not listed here is shown with an empty detail, and a
detail key that is not listed is left out, so a key added to an event later is private
until someone decides otherwise here. Free text that may quote an infrastructure error is
shown with URLs, addresses, ``host:port`` pairs, host names and process ids replaced.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

# Free text that may quote an error from the database, the broker or the result store.
_TEXT = "text"
_VALUE = "value"

# kind -> {detail key: _VALUE (shown as is) | _TEXT (shown redacted)}
ACCOUNT_EVENT_FIELDS: Mapping[str, Mapping[str, str]] = {
    "accepted": {"type": _VALUE, "parentJobId": _VALUE},
    "published": {},  # destination, outbox id and relay are the operators' business
    "claimed": {"attempt": _VALUE, "redelivered": _VALUE},
    # result_saved also carries the operation's own metadata (Result.meta): see below.
    "result_saved": {"resultKey": _VALUE, "attempt": _VALUE, "meta": _VALUE},
    "follow_up_accepted": {"jobId": _VALUE, "type": _VALUE},
    "retry_scheduled": {
        "error": _TEXT,
        "delaySeconds": _VALUE,
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
    "released": {"reason": _TEXT},  # which worker, and its delivery count, are operators'
    "replayed": {"previousReason": _TEXT, "attempt": _VALUE, "maxAttempts": _VALUE},
    "cancelled": {"previousState": _VALUE},  # not who, not why: that is the operator's note
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

_REDACTIONS: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>()]+"), "<endpoint>"),  # URLs
    # Worker and relay ids: <host>:<pid>:<6 hex>, relay:<host>:<pid>:<6 hex>
    (re.compile(r"(?:relay:|reconciler:)?[\w.-]+:\d+:[0-9a-f]{6}\b"), "<process>"),
    (re.compile(r"\[[0-9A-Fa-f:.]+\](?::\d+)?"), "<address>"),  # [IPv6]:port
    (re.compile(r"(?<![\w.:])(?:\d{1,3}\.){3}\d{1,3}(?::\d+)?(?![\w.])"), "<address>"),
    (re.compile(r"(?<![\w:])::1(?![\w:])"), "<address>"),
    (re.compile(r"\b[A-Za-z][\w-]*(?:\.[\w-]+)*:\d{2,5}\b"), "<endpoint>"),  # host:port
    # a.b.example; lowercase only, so a Python path such as botocore.exceptions.ClientError
    # in an error message stays readable.
    (re.compile(r"\b(?:[a-z0-9-]+\.){2,}[a-z]{2,}\b"), "<host>"),
    # The quoted name after "host", "server" or "endpoint" in driver and botocore messages.
    (
        re.compile(r"\b((?:host(?: name)?|server(?: at)?|endpoint(?: URL)?):?\s+)\"[^\"]*\"", re.I),
        r'\1"<host>"',
    ),
    (re.compile(r"\blocalhost\b"), "<host>"),
)


def redact(text: str) -> str:
    """``text`` with the infrastructure it may quote replaced by placeholders."""
    for pattern, replacement in _REDACTIONS:
        text = pattern.sub(replacement, text)
    return text


def redact_optional(text: str | None) -> str | None:
    return None if text is None else redact(text)


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
        shown[key] = redact(value) if how == _TEXT and isinstance(value, str) else value
    return shown
