"""``job show``'s reasoning, as pure functions: the one-line next step, and the timeline folded
into attempts. No database: records are built by hand."""

from __future__ import annotations

import dataclasses
from datetime import datetime, timedelta
from typing import Any

import pytest

from jobrelay.admin.attempts import attempts
from jobrelay.admin.explain import explain_document, next_step
from jobrelay.domain.states import JobState as S
from jobrelay.storage.store import EventRecord, JobRecord

from .records import JOB_ID, NOW
from .records import job_record as job


def ago(seconds: float) -> datetime:
    return NOW - timedelta(seconds=seconds)


@pytest.mark.parametrize(
    ("record", "expected"),
    [
        (
            job(published=False, unpublished_since=ago(40)),
            "accepted 40 s ago, outbox row not yet published (waiting 40 s): is a relay running?",
        ),
        (
            job(published=False, unpublished_since=ago(40), last_publish_error="unroutable: x"),
            "accepted 40 s ago, outbox row not yet published (waiting 40 s): is a relay "
            "running?; last publish error: unroutable: x",
        ),
        (
            job(state=S.RETRY_WAIT, attempt=1, updated_at=ago(3), published=False,
                unpublished_since=ago(3), next_attempt_at=NOW + timedelta(seconds=2)),
            "retry scheduled 3 s ago, outbox row not yet published (waiting 3 s): is a relay "
            "running?",
        ),
        (
            job(),
            "published and waiting for a worker (accepted 40 s ago): is a worker running and "
            "consuming?",
        ),
        (
            job(state=S.RETRY_WAIT, attempt=1, last_error="timeout",
                next_attempt_at=NOW + timedelta(seconds=25)),
            "waiting to retry (in 25 s) after: timeout; the retry message is in the delay route",
        ),
        (
            job(state=S.RETRY_WAIT, attempt=1, last_error="timeout", published=False,
                unpublished_since=NOW + timedelta(seconds=25),
                next_attempt_at=NOW + timedelta(seconds=25)),
            "waiting to retry (in 25 s) after: timeout; the retry message is held in the "
            "outbox until then",
        ),
        (
            job(state=S.RETRY_WAIT, attempt=1, last_error="timeout", next_attempt_at=ago(300)),
            "retry was due 5 min ago after: timeout; is a worker running and consuming? (the "
            "reconciler re-sends an overdue retry)",
        ),
        (
            job(state=S.RUNNING, attempt=2, lease_owner="h:1:a",
                lease_expires_at=NOW + timedelta(seconds=20)),
            "running attempt 2/3 on h:1:a, lease expires in 20 s; if that worker died the job "
            "is taken over when the lease expires",
        ),
        (
            job(state=S.RUNNING, attempt=2, lease_owner="h:1:a", lease_expires_at=ago(90)),
            "running attempt 2/3, but the lease of h:1:a expired 90 s ago: that worker is "
            "presumed lost; a redelivery or the reconciler takes the job over",
        ),
        (
            job(state=S.QUARANTINED, attempt=1, quarantine_reason="invalid period"),
            f"quarantined: invalid period; fix the cause, then replay it: jobrelay job replay "
            f"{JOB_ID}",
        ),
        (
            job(state=S.CANCELLED),
            "cancelled by an operator; later deliveries are acked without work",
        ),
        (
            job(state=S.SUCCEEDED, attempt=1, result_key="exports/acme/x.csv"),
            "done: result at exports/acme/x.csv",
        ),
        (
            job(state=S.SUCCEEDED, attempt=1, result_key=None),  # a job that returned None
            "done: succeeded, no result to download (the job returned no result key)",
        ),
    ],
)  # fmt: skip
def test_next_step_names_the_boundary(record: JobRecord, expected: str) -> None:
    assert next_step(record, NOW) == expected


def event(kind: str, seconds_ago: float, **detail: Any) -> EventRecord:
    return EventRecord(at=ago(seconds_ago), kind=kind, detail=detail)


def test_a_worker_that_did_not_know_the_type_is_named_until_one_claims_the_job() -> None:
    reason = "worker w1 does not know type images.resize (deferral 2 of 5)"
    timeline = [
        event("accepted", 30),
        event("deferred", 20, reason="w1 …", worker="w1", deferral=1, of=5, unknownType="x"),
        event("deferred", 10, reason=reason, worker="w1", deferral=2, of=5, unknownType="x"),
        event("published", 9),
    ]
    step = next_step(job(), NOW, events=timeline)
    assert step.startswith(
        f"{reason}, 10 s ago: start the workers with the app that defines "
        "it (`--app` or JOBRELAY_APP)"
    ), step
    assert explain_document(job(), timeline, NOW)["nextStep"] == step
    # A lease deferral is not the worker's ignorance; a claim since means a worker knew it.
    held = [event("deferred", 5, reason="lease held by w2", delaySeconds=5)]
    assert "is a worker running" in next_step(job(), NOW, events=held)
    claimed = [*timeline, event("claimed", 5, worker="w2", attempt=1)]
    retry = job(
        state=S.RETRY_WAIT,
        attempt=1,
        last_error="timeout",
        next_attempt_at=NOW + timedelta(seconds=25),
    )
    assert next_step(retry, NOW, events=claimed).startswith("waiting to retry")


def test_attempts_fold_the_timeline_with_each_outcome() -> None:
    timeline = [
        event("accepted", 100, type="report.export"),
        event("published", 99, destination="work"),
        event("claimed", 98, worker="w1", attempt=1),
        event("retry_scheduled", 97, error="db timeout", delaySeconds=5),
        event("claimed", 90, worker="w2", attempt=2),  # w2 is killed: no outcome
        event("claimed", 50, worker="w3", attempt=3),
        event("lease_lost", 45, worker="w2", attempt=2),  # w2 was only slow after all
        event("result_saved", 40, resultKey="k", worker="w3", attempt=3),
        event("ack_sent", 39, attempt=3),
        event("duplicate_acked", 10, reason="k"),
    ]
    found = attempts(job(state=S.SUCCEEDED, attempt=3), timeline)
    assert [(a.number, a.worker, a.outcome, a.error) for a in found] == [
        (1, "w1", "retry", "db timeout"),
        (2, "w2", "lease lost", None),
        (3, "w3", "succeeded", None),
    ]
    # Each attempt ends at its first outcome; the one whose worker was killed never did.
    assert [a.ended_at for a in found] == [ago(97), ago(45), ago(40)]
    document = explain_document(job(state=S.SUCCEEDED, attempt=3), timeline, NOW)
    assert [a["durationSeconds"] for a in document["attempts"]] == [1.0, 45.0, 10.0]


def test_attempts_show_a_running_one_a_reconciled_one_and_skip_delivery_decisions() -> None:
    timeline = [
        event("claimed", 500, worker="dead", attempt=1),
        event("reconciled_lease_expired", 300, actor="reconciler:x", worker="dead", attempt=1),
        event("claimed", 20, worker="w2", attempt=2),
    ]
    found = attempts(job(state=S.RUNNING, attempt=2), timeline)
    assert [(a.number, a.outcome) for a in found] == [
        (1, "lost (lease expired, re-queued by the reconciler)"),
        (2, "running"),
    ]
    invalid = [event("quarantined", 1, reason="invalid payload: version 9")]
    assert attempts(job(state=S.QUARANTINED), invalid) == []


def test_explain_document_is_json_ready() -> None:
    import json

    document = explain_document(
        job(state=S.QUARANTINED, attempt=1, quarantine_reason="bad"),
        [event("accepted", 40, type="report.export")],
        NOW,
        trace_id="4bf92f3577b34da6a3ce929d0e0e4736",
    )
    assert json.loads(json.dumps(document))["nextStep"].startswith("quarantined: bad")
    assert document["traceId"] == "4bf92f3577b34da6a3ce929d0e0e4736"
    assert document["events"] == [
        {"at": ago(40).isoformat(), "kind": "accepted", "detail": {"type": "report.export"}}
    ]


def test_a_paused_queue_is_named_before_anything_else_about_a_waiting_job() -> None:
    from jobrelay.storage.queue_pauses import QueuePause

    pause = QueuePause("default", True, ago(120), "alice", "deploy 42")
    waiting = next_step(job(), NOW, pause)
    assert waiting.startswith(
        "queue default is paused since 2026-01-01T11:58:00+00:00 (2 min ago) by alice: "
        "deploy 42; no worker takes its jobs until `jobrelay queues resume default"
    )
    assert "is a worker running" not in waiting
    retry = next_step(
        job(state=S.RETRY_WAIT, attempt=1, last_error="timeout", next_attempt_at=ago(300)),
        NOW,
        pause,
    )
    assert retry.endswith("its retry is due 5 min ago after: timeout")
    # A pause does not hold a running or a finished job: their line is unchanged.
    running = job(state=S.RUNNING, attempt=2, lease_owner="h:1:a", lease_expires_at=ago(90))
    assert next_step(running, NOW, pause) == next_step(running, NOW)
    document = explain_document(job(), [], NOW, pause=pause)
    assert document["queuePause"] == {
        "since": ago(120).isoformat(),
        "by": "alice",
        "reason": "deploy 42",
    }
    assert explain_document(job(), [], NOW)["queuePause"] is None


def test_a_job_awaiting_admission_is_held_for_its_limit_not_waiting_for_a_worker() -> None:
    """Old code: such a job (its message waits in the outbox for its limits) read "outbox row
    not yet published ...: is a relay running?", or "waiting for a worker"."""
    from jobrelay.domain.limits import CONCURRENCY, JobLimit

    limits = (JobLimit("report.export\x1facme", CONCURRENCY, max=2),)
    waiting = job(limits=limits, published=False, unpublished_since=ago(150))
    reason = {
        "limit": "report.export",
        "key": "acme",
        "reason": "report.export acme has 2 of 2 running",
    }
    held = EventRecord(at=ago(120), kind="throttled", detail=reason)
    assert next_step(waiting, NOW, None, [held]) == (
        "held: report.export acme has 2 of 2 running (since 2 min ago); the relay admits it "
        "when its limit has room (`jobrelay limits list`)"
    )
    assert next_step(waiting, NOW).startswith("waiting for admission under its limits")
    admitted = EventRecord(at=ago(60), kind="admitted", detail={})
    retry = job(
        state=S.RETRY_WAIT,
        attempt=1,
        last_error="boom",
        next_attempt_at=NOW + timedelta(seconds=9),
        limits=limits,
        published=False,
        unpublished_since=ago(5),
    )
    assert next_step(retry, NOW, None, [held, admitted]).startswith(
        "waiting to retry (in 9 s) after: boom; then the relay admits it"
    )
    due = dataclasses.replace(retry, next_attempt_at=ago(1))
    assert next_step(due, NOW, None, [held, admitted]).startswith(
        "its retry waits for admission under its limits"
    )
    # Admitted: no longer held; its line is the one of any published job.
    running = dataclasses.replace(
        waiting, admitted_at=ago(1), published=True, unpublished_since=None
    )
    assert next_step(running, NOW, None, [held, admitted]).startswith("published and waiting")


def test_job_show_names_a_fairness_key_as_such(capsys: pytest.CaptureFixture[str]) -> None:
    """``job show`` of a job fair by key (``fair_by=``; the shipped ``report.export``) names
    the key it takes turns under. Old code: it read the fairness as a rate limit and raised
    ``TypeError: unsupported format string passed to NoneType.__format__``."""
    from jobrelay.admin.explain import render_job
    from jobrelay.domain.limits import FAIR, JobLimit

    fair = job(limits=(JobLimit("report.export", FAIR, key="acme"),))
    render_job(fair, [], NOW)
    assert "report.export (fair by key: acme)" in capsys.readouterr().out
