"""The account view of each event kind, key by key, and the redaction of error text.

``FULL`` is every key each kind carries (docs/reference/events.md), with private values; the
expected account view is spelled out for each, so making a key visible is a visible change.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from jobrelay.domain.disclosure import ACCOUNT_EVENT_FIELDS, account_detail, redact

HOST = "web-3.prod.internal"
WORKER = f"{HOST}:812:0a1b2c"
ACTOR = "token#5 (support-alice)"

FULL: dict[str, dict[str, Any]] = {
    "accepted": {"type": "report.export", "parentJobId": "p-1"},
    "published": {"destination": "retry.5s", "outboxId": 9, "relay": f"relay:{WORKER}"},
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
    "cancelled": {"actor": "cli:root@ops", "reason": "operator note", "previousState": "queued"},
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
    "accepted": {"type", "parentJobId"},
    "published": set(),
    "claimed": {"attempt", "redelivered"},
    "result_saved": {"resultKey", "attempt", "meta"},
    "follow_up_accepted": {"jobId", "type"},
    "retry_scheduled": {"error", "delaySeconds", "nextAttemptAt", "attempt"},
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
    "cancelled": {"previousState"},
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


@pytest.mark.parametrize(
    ("text", "private"),
    [
        ('Could not connect to the endpoint URL: "http://minio.internal:9000/b/x.csv"', "minio"),
        ('connection to server at "pg-primary" (10.1.2.3), port 5432 failed', "pg-primary"),
        ('connection to server at "pg-primary" (10.1.2.3), port 5432 failed', "10.1.2.3"),
        ("[Errno 111] Connect call failed ('127.0.0.1', 5432)", "127.0.0.1"),
        ("lease held by web-1:1234:ab12cd", "web-1"),
        ("rabbit@node1.example.com:5672 went away", "node1"),
        ('could not translate host name "db-7" to address', "db-7"),
        ("localhost:5432 refused", "localhost"),
        ("[::1]:5432 refused", "::1"),
        ("smtp.corp.internal said 554", "smtp.corp"),
    ],
)
def test_redaction_takes_the_infrastructure_out(text: str, private: str) -> None:
    assert private not in redact(text)


@pytest.mark.parametrize(
    "text",
    [
        "invalid period 2020-13",
        "retry due 2026-01-01T12:00:00+00:00",
        "attempts exhausted (3/3): ledger read failed: boom",
        "botocore.exceptions.ClientError: An error occurred (NoSuchBucket)",
        "accountId in params does not match the job's account",
    ],
)
def test_redaction_keeps_errors_about_the_job_as_they_are(text: str) -> None:
    assert redact(text) == text


@given(st.text())
def test_redaction_is_idempotent_and_never_fails(text: str) -> None:
    once = redact(text)
    assert redact(once) == once
