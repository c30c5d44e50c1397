"""The explanation of a job as its account's token sees it: the story without the operators.

``explain_document`` is for operators: it names lease owners, workers and relays, shows the
broker's publish errors and says which ``jobrelay`` command to run. An account token gets
the same facts about its own job, built here field by field from the operator document (a
field added there stays private until it is added here), with every error replaced by
its public error (``domain.disclosure``: a code and a message written for customers, never
the raw text) and a next step written for the customer.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from jobrelay.admin.explain import ago, explain_document
from jobrelay.domain.delays import runs_at_text
from jobrelay.domain.disclosure import (
    DEPENDENCY_FAILED,
    FAILED,
    PUBLIC_KEY,
    account_detail,
    account_error,
)
from jobrelay.domain.states import JobState
from jobrelay.storage.records import JobLinks
from jobrelay.storage.store import EventRecord, JobRecord

# Top-level keys of the operator document an account may see. Left out: lastPublishError
# (the broker's answer to the relay), leaseOwner and leaseExpiresAt (a worker's host).
ACCOUNT_EXPLAIN_KEYS = (
    "jobId",
    "type",
    "accountId",
    "params",
    "state",
    "published",
    "unpublishedSince",
    "attempt",
    "maxAttempts",
    "lastError",
    "quarantineReason",
    "nextAttemptAt",
    "runAt",
    "resultKey",
    "result",
    # The jobs it runs after (its account's own: ``after=`` names no other account's). Not
    # the jobs that wait for it: those may be on no account's behalf.
    "after",
    "progress",
    "traceId",
    "createdAt",
    "updatedAt",
)
_REDACTED_KEYS = frozenset({"lastError", "quarantineReason"})
# Not the worker.
ACCOUNT_ATTEMPT_KEYS = ("attempt", "startedAt", "outcome", "error", "endedAt", "durationSeconds")


def account_explain_document(
    job: JobRecord,
    events: list[EventRecord],
    now: datetime,
    trace_id: str | None = None,
    links: JobLinks | None = None,
) -> dict[str, Any]:
    full = explain_document(job, events, now, trace_id, links=links)
    shown: dict[str, Any] = {}
    for key in ACCOUNT_EXPLAIN_KEYS:
        value = full[key]
        shown[key] = account_error(value, job.public_error) if key in _REDACTED_KEYS else value
    public = _public_by_attempt(events)
    shown["attempts"] = [
        {
            key: (
                account_error(a[key], public.get(a["attempt"], FAILED))
                if key == "error"
                else a[key]
            )
            for key in ACCOUNT_ATTEMPT_KEYS
        }
        for a in full["attempts"]
    ]
    shown["nextStep"] = account_next_step(job, now)
    shown["events"] = [
        {"at": e["at"], "kind": e["kind"], "detail": account_detail(e["kind"], e["detail"])}
        for e in full["events"]
    ]
    return shown


def _public_by_attempt(events: list[EventRecord]) -> dict[int, str]:
    """The public error each attempt's outcome event recorded, by attempt number."""
    found: dict[int, str] = {}
    for event in events:
        public, attempt = event.detail.get(PUBLIC_KEY), event.detail.get("attempt")
        if isinstance(public, str) and isinstance(attempt, int):
            found.setdefault(attempt, public)
    return found


def account_next_step(job: JobRecord, now: datetime) -> str:
    """What the customer can expect next, in their terms: no hosts, no commands."""
    error = account_error(job.last_error, job.public_error)
    if job.state is JobState.SUCCEEDED:
        return "done: the result is ready" if job.result_key else "done"
    if job.state is JobState.QUARANTINED:
        reason = account_error(job.quarantine_reason or job.last_error, job.public_error)
        reason = reason or "no reason recorded"
        return f"stopped: {reason}; it runs again only if an operator replays it"
    if job.state is JobState.CANCELLED and (job.public_error or "").startswith(
        f"{DEPENDENCY_FAILED}:"
    ):
        return f"cancelled: {job.public_error}; it will not run"
    if job.state is JobState.CANCELLED:
        return "cancelled by an operator; it will not run"
    if job.state is JobState.WAITING:
        return f"waiting for {job.waiting_for} job(s) it runs after to end"
    if job.state is JobState.RUNNING:
        return f"running (attempt {job.attempt} of {job.max_attempts})"
    if job.state is JobState.RETRY_WAIT:
        after = f" after: {error}" if error else ""
        return (
            f"waiting to retry ({ago(job.next_attempt_at, now)}), attempt {job.attempt} of "
            f"{job.max_attempts} used{after}"
        )
    if job.waiting_for_run_at(now):
        assert job.run_at is not None
        return f"scheduled: {runs_at_text(job.run_at, now)}"
    return f"accepted {ago(job.created_at, now)}, waiting for a worker"
