"""A job's timeline folded into one row per attempt, with how each ended and its error:
what ``jobrelay job show`` tables and ``explain_document`` lists (``admin.explain``)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from jobrelay.domain.states import JobState
from jobrelay.storage.store import EventRecord, JobRecord


@dataclass(frozen=True)
class Attempt:
    number: int
    started_at: datetime
    worker: str | None
    outcome: str  # succeeded, retry, quarantined, lease lost, lost, running, no outcome
    error: str | None = None
    ended_at: datetime | None = None  # the outcome's event; None while running or unknown


_OUTCOME_EVENTS = {
    "result_saved": "succeeded",
    "retry_scheduled": "retry",
    "quarantined": "quarantined",
    "lease_lost": "lease lost",
    "reconciled_lease_expired": "lost (lease expired, re-queued by the reconciler)",
}


def attempts(job: JobRecord, events: list[EventRecord]) -> list[Attempt]:
    """One row per claimed attempt, with how it ended, from the timeline alone."""
    found: dict[int, Attempt] = {}
    current: int | None = None
    for event in events:
        detail = event.detail
        if event.kind == "claimed":
            current = int(detail.get("attempt") or len(found) + 1)
            found[current] = Attempt(current, event.at, detail.get("worker"), "no outcome")
            continue
        outcome = _OUTCOME_EVENTS.get(event.kind)
        if outcome is None:
            continue
        number = detail.get("attempt", current)
        if event.kind == "reconciled_lease_expired":
            number = detail.get("attempt")
        if not isinstance(number, int) or number not in found:
            continue  # decided on delivery, before any attempt (invalid payload, exhausted)
        previous = found[number]
        if previous.outcome not in ("no outcome", "lease lost"):
            continue  # the first outcome of an attempt is the one that counted
        error = detail.get("error") or detail.get("reason")
        if event.kind == "result_saved":
            error = None
        if event.kind == "reconciled_lease_expired":
            error = f"worker {detail.get('worker')} stopped renewing its lease"
        found[number] = Attempt(
            number,
            previous.started_at,
            previous.worker,
            outcome,
            str(error) if error else None,
            event.at,
        )
    if job.state is JobState.RUNNING and job.attempt in found:
        last = found[job.attempt]
        if last.outcome == "no outcome":
            found[job.attempt] = Attempt(last.number, last.started_at, last.worker, "running")
    return [found[n] for n in sorted(found)]
