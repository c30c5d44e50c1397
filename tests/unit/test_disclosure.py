"""The account view of each event kind, key by key, and of error text: never the raw text.

``FULL`` is every key each kind carries (docs/reference/events.md), with private values; the
expected account view is spelled out for each, so making a key visible is a visible change.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from jobrelay.domain.disclosure import (
    ACCOUNT_EVENT_FIELDS,
    FAILED,
    MAX_PUBLIC,
    MESSAGES,
    PUBLIC_KEY,
    RETRY,
    TEMPORARY,
    UNKNOWN,
    account_detail,
    account_error,
    exhausted,
    public_error,
)

HOST = "web-3.prod.internal"
WORKER = f"{HOST}:812:0a1b2c"
ACTOR = "token#5 (support-alice)"

FULL: dict[str, dict[str, Any]] = {
    "accepted": {
        "type": "report.export",
        "parentJobId": "p-1",
        "after": 3,
        "afterFailure": "run",
    },
    "dependencies_met": {"dependencies": 3, "failed": 1},
    "published": {"destination": "retry.5s", "outboxId": 9, "relay": f"relay:{WORKER}"},
    "throttled": {
        "limit": "report.export",
        "key": "acme",
        "reason": "report.export acme has 2 of 2 running",
    },
    "admitted": {"limits": ["report.export"], "keys": ["acme"], "rate": False},
    "claimed": {"worker": WORKER, "attempt": 2, "redelivered": True, "deliveryCount": 3},
    "result_saved": {
        "resultKey": "exports/acme/j.csv",
        "worker": WORKER,
        "attempt": 1,
        "meta": {"rows": 20, "bytes": 900, "sha256": "ab" * 32, "worker": "the job's own"},
    },
    "follow_up_accepted": {"jobId": "n-1", "type": "notify.email"},
    "retry_scheduled": {
        "error": f"S3 down at https://{HOST}:9000/b",
        "delaySeconds": 5,
        "askedDelaySeconds": 4.5,
        "nextAttemptAt": "2026-01-01T12:00:05+00:00",
        "attempt": 1,
    },
    "quarantined": {"reason": "bad", "attempt": 3, "redelivered": False, "deliveryCount": 1},
    "deferred": {"reason": f"lease held by {WORKER}", "delaySeconds": 2},
    "duplicate_acked": {"reason": "exports/acme/j.csv", "redelivered": True, "deliveryCount": 2},
    "duplicate_rejected": {"reason": "quarantined", "redelivered": True, "deliveryCount": 2},
    "invalid_message": {"reason": "jobId mismatch", "redelivered": True, "deliveryCount": 2},
    "lease_lost": {"worker": WORKER, "attempt": 1, "currentAttempt": 2, "currentState": "running"},
    "ack_sent": {"attempt": 1},
    "rejected": {"attempt": 1},
    "settle_lost": {"attempt": 1, "action": "ack_sent"},
    "released": {"reason": "RuntimeError: boom", "worker": "host:1:abc", "deliveryCount": 2},
    "replayed": {
        "actor": ACTOR,
        "reason": "operator note",
        "previousReason": "bad",
        "attempt": 3,
        "maxAttempts": 6,
    },
    "cancel_requested": {
        "actor": "cli:root@ops",
        "reason": "operator note",
        "attempt": 1,
        "worker": WORKER,
    },
    "cancelled": {
        "actor": "cli:root@ops",
        "reason": "operator note",
        "previousState": "running",
        "attempt": 1,
        "worker": WORKER,
        "leaseExpired": True,
        "dependency": "0190-dep",
        "dependencyState": "quarantined",
    },
    "resent": {"actor": "cli:root@ops", "reason": "operator note", "queue": "default"},
    "dead_lettered": {"reason": "delivery limit of 5 reached", "deliveries": 6, "limit": 5},
    "reconciled_lease_expired": {
        "actor": f"reconciler:{WORKER}",
        "worker": WORKER,
        "leaseExpiredAt": "2026-01-01T12:00:00+00:00",
        "attempt": 1,
    },
    "effect_sending": {"effect": "email", "messageId": "<m@x>", "attempt": 1},
    "effect_sent": {"effect": "email", "messageId": "<m@x>", "state": "sent"},
    "effect_refused": {"effect": "email", "state": "failed", "error": f"{HOST}:25 said 554"},
    "possible_duplicate": {
        "effect": "email",
        "messageId": "<m@x>",
        "attempt": 2,
        "previous": "sending",
    },
    "effect_skipped": {"effect": "email", "state": "sent", "messageId": "<m@x>", "attempt": 2},
    "effect_fenced": {
        "effect": "email",
        "attempt": 1,
        "worker": WORKER,
        "currentAttempt": 2,
        "currentState": "running",
    },
    "reconciled_retry_overdue": {
        "actor": f"reconciler:{WORKER}",
        "nextAttemptAt": "2026-01-01T12:00:05+00:00",
        "attempt": 1,
    },
    "reconciled_queued_unclaimed": {"actor": f"reconciler:{WORKER}"},
    "scheduled": {
        "schedule": "nightly",
        "tick": "2026-01-01T02:00:00+00:00",
        "delaySeconds": 0.2,
        "scheduler": f"scheduler:{WORKER}",
    },
    "ticks_skipped": {
        "schedule": "nightly",
        "reason": "catchup",
        "count": 2,
        "countComplete": True,
        "first": "2026-01-01T02:00:00+00:00",
        "last": "2026-01-02T02:00:00+00:00",
        "ticks": ["2026-01-01T02:00:00+00:00", "2026-01-02T02:00:00+00:00"],
    },
}

ACCOUNT_SEES = {
    "accepted": {"type", "parentJobId", "after", "afterFailure"},
    "dependencies_met": {"dependencies", "failed"},
    "published": set(),
    "throttled": {"limit", "key", "reason"},
    "admitted": {"limits", "keys", "rate"},
    "claimed": {"attempt", "redelivered"},
    "result_saved": {"resultKey", "attempt", "meta"},
    "follow_up_accepted": {"jobId", "type"},
    "retry_scheduled": {"error", "delaySeconds", "askedDelaySeconds", "nextAttemptAt", "attempt"},
    "quarantined": {"reason", "attempt"},
    "deferred": {"delaySeconds"},
    "duplicate_acked": {"reason"},
    "duplicate_rejected": {"reason"},
    "invalid_message": {"reason"},
    "lease_lost": {"attempt", "currentAttempt", "currentState"},
    "ack_sent": {"attempt"},
    "rejected": {"attempt"},
    "settle_lost": {"attempt"},
    "released": {"reason"},
    "replayed": {"previousReason", "attempt", "maxAttempts"},
    "cancel_requested": {"attempt"},
    "cancelled": {"previousState", "attempt", "leaseExpired", "dependency", "dependencyState"},
    "resent": set(),
    "dead_lettered": {"reason", "deliveries", "limit"},
    "reconciled_lease_expired": {"leaseExpiredAt", "attempt"},
    "effect_sending": {"effect", "messageId", "attempt"},
    "effect_sent": {"effect", "messageId", "state"},
    "effect_refused": {"effect", "state", "error"},
    "possible_duplicate": {"effect", "messageId", "attempt", "previous"},
    "effect_skipped": {"effect", "state", "messageId", "attempt"},
    "effect_fenced": {"effect", "attempt", "currentAttempt", "currentState"},
    "reconciled_retry_overdue": {"nextAttemptAt", "attempt"},
    "reconciled_queued_unclaimed": set(),
    "scheduled": {"schedule", "tick", "delaySeconds"},
    "ticks_skipped": {"schedule", "reason", "count", "countComplete", "first", "last", "ticks"},
}


def test_the_samples_cover_every_kind_with_a_rule() -> None:
    assert set(FULL) == set(ACCOUNT_SEES) == set(ACCOUNT_EVENT_FIELDS)


@pytest.mark.parametrize("kind", sorted(FULL))
def test_each_kind_shows_exactly_its_listed_keys_and_no_private_value(kind: str) -> None:
    shown = account_detail(kind, FULL[kind])
    assert set(shown) == ACCOUNT_SEES[kind]
    text = repr(shown)
    for private in (HOST, "support-alice", "token#", "cli:", "operator note", "0a1b2c"):
        assert private not in text


def test_an_unknown_kind_or_key_is_private() -> None:
    assert account_detail("something_new", {"worker": WORKER, "attempt": 1}) == {}
    assert account_detail("ack_sent", {"attempt": 1, "channel": "ch-7@host"}) == {"attempt": 1}


# Each leak the patterns of the earlier redaction let through (issue 25, item 2), and some
# they caught: no raw error text reaches an account, whatever its shape.
LEAKS = [
    ("connecting to mailhub.internal:25 failed", "mailhub.internal"),
    ("[Errno 17] File exists: '/srv/app/var/exports/exports/initech'", "/srv/app/var"),
    ("connect to 2001:db8::7 port 5432 failed", "2001:db8::7"),
    ("could not connect to DB-PRIMARY.CORP", "DB-PRIMARY"),
    ("HTTPConnectionPool(host='minio', port=9000): Max retries exceeded", "minio"),
    (
        "An error occurred (AccessDenied) when calling the PutObject operation: User: "
        "arn:aws:iam::123456789012:user/exporter is not authorized on "
        "arn:aws:s3:::acme-private-exports/x.csv",
        "123456789012",
    ),
    ("bucket acme-private-exports: AccessDenied", "acme-private-exports"),
    ("connecting to 127.0.0.1", "127.0.0.1"),
    ('could not translate host name "db-7" to address', "db-7"),
]
TEXT_FIELDS = [
    (kind, key)
    for kind, fields in ACCOUNT_EVENT_FIELDS.items()
    for key, how in fields.items()
    if how == "text"
]


@pytest.mark.parametrize(("kind", "key"), TEXT_FIELDS)
@pytest.mark.parametrize(("text", "private"), LEAKS)
def test_no_raw_error_text_reaches_an_account(kind: str, key: str, text: str, private: str) -> None:
    shown = account_detail(kind, {key: text, "attempt": 1})
    assert private not in repr(shown)
    assert shown[key].split(":")[0] in {"failed", "duplicate", "invalid_message", "effect_refused"}


@pytest.mark.parametrize(("kind", "key"), TEXT_FIELDS)
def test_an_event_shows_its_public_error_in_place_of_the_raw_text(kind: str, key: str) -> None:
    public = public_error(RETRY, "the mail server is busy")
    shown = account_detail(kind, {key: "smtp.corp.internal:25 said 451", PUBLIC_KEY: public})
    assert shown == {key: "retry: the mail server is busy"}


def test_a_row_shows_its_public_error_or_a_fixed_message_never_the_raw_text() -> None:
    assert account_error(None, "retry: x") is None  # no error, nothing stale shown
    assert account_error("dial mailhub.internal:25", None) == FAILED
    assert account_error("dial mailhub.internal:25", "temporary_failure: y") == (
        "temporary_failure: y"
    )


def test_a_public_error_is_one_line_and_bounded() -> None:
    assert public_error(TEMPORARY) == f"temporary_failure: {MESSAGES[TEMPORARY]}"
    assert public_error(RETRY, "busy\nnow\x00!") == "retry: busy now !"
    assert len(public_error(RETRY, "x" * 5000)) == MAX_PUBLIC
    assert public_error(RETRY, " ") == f"retry: {MESSAGES[UNKNOWN]}"
    assert exhausted(3, 3, public_error(TEMPORARY)).startswith(
        "attempts_exhausted: 3 of 3 attempts failed; the last: temporary_failure: "
    )


@given(st.text())
def test_whatever_the_raw_text_an_account_reads_a_fixed_message(text: str) -> None:
    assert account_detail("retry_scheduled", {"error": text}) == {"error": FAILED}
