"""``jobrelay job show`` and ``jobs list``: what a person on call reads first.

The answer to "where is my export?" is a boundary: not yet published (look at the relay),
published but not claimed (look at the workers), waiting for a retry, quarantined (read the
reason), or done (here is the file). ``next_step`` says which, in one line.

``explain_document`` is the same explanation as JSON, for ``job show --json``, the HTTP
``/v1/jobs/{jobId}/explain`` and the support console; ``admin.attempts`` folds the timeline
into one row per attempt with its outcome and error.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from jobrelay.admin.attempts import attempts
from jobrelay.domain.delays import runs_at_text
from jobrelay.domain.disclosure import DEPENDENCY_FAILED
from jobrelay.domain.limits import FAIR, PRIORITY, JobLimit, limiting, split_id
from jobrelay.domain.states import JobState
from jobrelay.observe.scrub import scrub, scrub_text, scrubbed
from jobrelay.runtime.wiring import open_runtime, utc_now
from jobrelay.settings import Settings
from jobrelay.storage.queue_pauses import QueuePause, pause_of
from jobrelay.storage.records import JobLinks, LinkedJob
from jobrelay.storage.store import EventRecord, JobRecord

# Piped into a file or grep, lines are not wrapped at 80 columns (job ids stay whole).
console = Console(highlight=False, soft_wrap=True, width=None if sys.stdout.isatty() else 200)


def ago(when: datetime | None, now: datetime) -> str:
    if when is None:
        return "-"
    seconds = int((now - when).total_seconds())
    span = f"{abs(seconds)} s" if abs(seconds) < 120 else f"{abs(seconds) // 60} min"
    return f"{span} ago" if seconds >= 0 else f"in {span}"


def _span(when: datetime | None, now: datetime) -> str:
    return ago(when, now).removesuffix(" ago").removeprefix("in ")


def paused_line(pause: QueuePause, now: datetime) -> str:
    """The pause as ``job show`` names it: since when, by whom, why."""
    since = pause.changed_at.isoformat(timespec="seconds")
    return (
        f"queue {pause.queue} is paused since {since} ({ago(pause.changed_at, now)}) by "
        f"{pause.changed_by}: {pause.reason}"
    )


def next_step(
    job: JobRecord,
    now: datetime,
    pause: QueuePause | None = None,
    events: Sequence[EventRecord] = (),
) -> str:
    """The one line that says where the job waits; ``pause`` is its queue's, if paused;
    ``events``, its timeline, if read (a worker that passed the job on says so there)."""
    waiting = job.state in (JobState.QUEUED, JobState.RETRY_WAIT)
    if pause is not None and waiting:
        step = _next_step(job, now, events, paused=True)
        return (
            f"{paused_line(pause, now)}; no worker takes its jobs until "
            f"`jobrelay queues resume {pause.queue} --reason ...`; {step}"
        )
    return _next_step(job, now, events, paused=False)


def unknown_to_workers(events: Sequence[EventRecord]) -> EventRecord | None:
    """The last deferral by a worker that did not know the job's type or version, unless a
    worker claimed the job since: the one fact that tells "no worker" from "a worker without
    the app that defines this type" (which looks the same from the job's row)."""
    found: EventRecord | None = None
    for event in events:
        if event.kind == "claimed":
            found = None
        elif event.kind == "deferred" and "deferral" in event.detail:
            found = event
    return found


def held_line(job: JobRecord, now: datetime, events: Sequence[EventRecord]) -> str:
    """A job under limits whose message waits in the outbox for its admission: why (its
    last ``throttled`` event, unless it was admitted since: that was an earlier attempt's),
    and what lets it go (a slot or a token; an operator's ``limits set``)."""
    remedy = "the relay admits it when its limit has room (`jobrelay limits list`)"
    if job.state is JobState.RETRY_WAIT and job.next_attempt_at and job.next_attempt_at > now:
        return (
            f"waiting to retry ({ago(job.next_attempt_at, now)}) after: {job.last_error}; "
            f"then {remedy}"
        )
    held: EventRecord | None = None
    admitted = False
    for event in events:
        if event.kind == "throttled":
            held = event
        elif event.kind == "admitted":
            held, admitted = None, True
    if held is not None:
        return f"held: {held.detail.get('reason')} (since {ago(held.at, now)}); {remedy}"
    if admitted:  # a retry: admitted again once its limits have room
        return f"its retry waits for admission under its limits: {remedy}"
    return (
        f"waiting for admission under its limits (accepted {ago(job.created_at, now)}): "
        f"{remedy}; no relay has looked at it yet: is a relay running?"
    )


def _next_step(
    job: JobRecord, now: datetime, events: Sequence[EventRecord], *, paused: bool
) -> str:
    if job.state is JobState.SUCCEEDED:
        if job.result_key is None:
            return "done: succeeded, no result to download (the job returned no result key)"
        return f"done: result at {job.result_key}"
    if job.state is JobState.QUARANTINED:
        return (
            f"quarantined: {job.quarantine_reason or job.last_error}; fix the cause, then "
            f"replay it: jobrelay job replay {job.id}"
        )
    if job.state is JobState.CANCELLED and (job.public_error or "").startswith(
        f"{DEPENDENCY_FAILED}:"
    ):
        return f"cancelled: {job.cancel_reason} (it was written with after_failure=cancel)"
    if job.state is JobState.CANCELLED:
        return "cancelled by an operator; later deliveries are acked without work"
    if job.state is JobState.WAITING:
        return (
            f"waiting for {job.waiting_for} job(s) it runs after (`after=`) to end: the commit"
            " that ends the last of them queues it; nothing holds it until then"
        )
    if job.state is JobState.RUNNING and job.cancel_requested_at is not None:
        return (
            f"cancel requested by {job.cancel_requested_by} {ago(job.cancel_requested_at, now)}"
            f" ({job.cancel_reason}): {job.lease_owner} stops attempt {job.attempt} and ends it "
            "cancelled; if that worker died, it is ended once its lease expires"
        )
    if job.state is JobState.RUNNING:
        lease = job.lease_expires_at
        if lease is not None and lease <= now:
            return (
                f"running attempt {job.attempt}/{job.max_attempts}, but the lease of "
                f"{job.lease_owner} expired {ago(lease, now)}: that worker is presumed lost; "
                "a redelivery or the reconciler takes the job over"
            )
        return (
            f"running attempt {job.attempt}/{job.max_attempts} on {job.lease_owner}, lease "
            f"expires {ago(lease, now)}; if that worker died the job is taken over when the "
            "lease expires"
        )
    if job.waiting_for_run_at(now):
        assert job.run_at is not None
        return (
            f"delayed, not stuck: {runs_at_text(job.run_at, now)}; its message is held in the "
            "outbox until then (no worker holds it); `jobrelay job cancel` stops it first"
        )
    waiting = job.state in (JobState.QUEUED, JobState.RETRY_WAIT)
    unknown = unknown_to_workers(events) if waiting else None
    if unknown is not None:
        remedy = (
            "start the workers with the app that defines it (`--app` or JOBRELAY_APP)"
            if "unknownType" in unknown.detail
            else "run workers of a version that knows it"
        )
        return (
            f"{unknown.detail.get('reason')}, {ago(unknown.at, now)}: {remedy}, or let the "
            "rolling deploy finish; once every deferral is used it is quarantined"
        )
    if waiting and job.awaiting_admission and (job.throttled_at or limiting(job.limits)):
        return held_line(job, now, events)
    held_until = job.unpublished_since
    if job.state is JobState.RETRY_WAIT and held_until is not None and held_until > now:
        # A back-off's retry: its row waits in the outbox until due (no relay is late).
        return (
            f"waiting to retry ({ago(held_until, now)}) after: {job.last_error}; the retry "
            "message is held in the outbox until then"
        )
    if not job.published and job.unpublished_since is not None:
        hint = f"; last publish error: {job.last_publish_error}" if job.last_publish_error else ""
        if job.state is JobState.QUEUED and job.attempt == 0:
            what = f"accepted {ago(job.created_at, now)}"
        elif job.state is JobState.RETRY_WAIT:
            what = f"retry scheduled {ago(job.updated_at, now)}"
        else:
            what = f"{job.state.value} since {ago(job.updated_at, now)}"
        return (
            f"{what}, outbox row not yet published (waiting "
            f"{_span(job.unpublished_since, now)}): is a relay running?{hint}"
        )
    if job.state is JobState.RETRY_WAIT:
        due = job.next_attempt_at
        if paused:
            return f"its retry is due {ago(due, now)} after: {job.last_error}"
        if due is not None and due <= now:
            return (
                f"retry was due {ago(due, now)} after: {job.last_error}; is a worker running "
                "and consuming? (the reconciler re-sends an overdue retry)"
            )
        return (
            f"waiting to retry ({ago(due, now)}) after: {job.last_error}; "
            "the retry message is in the delay route"
        )
    if paused:
        return f"published and waiting (accepted {ago(job.created_at, now)})"
    return (
        f"published and waiting for a worker (accepted {ago(job.created_at, now)}): "
        "is a worker running and consuming?"
    )


def scrubbed_view(job: JobRecord, events: list[EventRecord]) -> tuple[JobRecord, list[EventRecord]]:
    """The job and its timeline with every operators' text through the one scrubber: rows
    written before it scrubbed them at write may quote a password (``observe.scrub``)."""
    job = dataclasses.replace(
        job,
        last_error=scrub_text(job.last_error),
        quarantine_reason=scrub_text(job.quarantine_reason),
        last_publish_error=scrub_text(job.last_publish_error),
        last_traceback=scrub_text(job.last_traceback),
        cancel_reason=scrub_text(job.cancel_reason),
    )
    return job, [dataclasses.replace(e, detail=scrubbed(e.detail)) for e in events]


def trace_link(trace_id: str | None, template: str | None) -> str | None:
    """``JOBRELAY_TRACE_URL`` with the trace id in it (None: no trace, or no template)."""
    if trace_id is None or template is None:
        return None
    return template.replace("{trace_id}", trace_id)


def explain_document(
    job: JobRecord,
    events: list[EventRecord],
    now: datetime,
    trace_id: str | None = None,
    pause: QueuePause | None = None,
    links: JobLinks | None = None,
    trace_url: str | None = None,
) -> dict[str, Any]:
    """Everything ``job show`` prints, as camelCase JSON; ``trace_url``: the template of
    ``JOBRELAY_TRACE_URL``."""
    job, events = scrubbed_view(job, events)

    def iso(when: datetime | None) -> str | None:
        return when.isoformat() if when is not None else None

    return {
        "jobId": job.id,
        "type": job.type,
        "accountId": job.account_id,
        "params": job.params,
        "state": job.state.value,
        "queue": job.queue,
        "queuePause": (
            {
                "since": iso(pause.changed_at),
                "by": pause.changed_by,
                "reason": pause.reason,
            }
            if pause is not None
            else None
        ),
        "published": job.published,
        "unpublishedSince": iso(job.unpublished_since),
        "lastPublishError": job.last_publish_error,
        "attempt": job.attempt,
        "maxAttempts": job.max_attempts,
        "lastError": job.last_error,
        "quarantineReason": job.quarantine_reason,
        # Operators' only: not in the account view's keys (admin.account_view).
        "lastTraceback": job.last_traceback,
        "nextAttemptAt": iso(job.next_attempt_at),
        "runAt": iso(job.run_at),
        "leaseOwner": job.lease_owner,
        "leaseExpiresAt": iso(job.lease_expires_at),
        "resultKey": job.result_key,
        "result": job.result,
        # ``after=`` (null: none): the jobs it runs after, how many have not ended; the
        # jobs that wait for it.
        "after": None if links is None else links.after_json(job),
        "dependants": None if links is None else links.dependants_json(),
        "progress": (
            {"done": job.progress_done or 0, "total": job.progress_total}
            if job.progress_total is not None
            else None
        ),
        # Limits per key (operators' only): the job's, as enqueued; admitted since when (null:
        # awaiting admission, or finished); first held back when.
        "limits": [limit.to_json() for limit in job.limits],
        "admittedAt": iso(job.admitted_at),
        "throttledAt": iso(job.throttled_at),
        "traceId": trace_id,
        "traceUrl": trace_link(trace_id, trace_url),
        "createdAt": iso(job.created_at),
        "updatedAt": iso(job.updated_at),
        "attempts": [
            {
                "attempt": a.number,
                "startedAt": iso(a.started_at),
                "worker": a.worker,
                "outcome": a.outcome,
                "error": a.error,
                "endedAt": iso(a.ended_at),
                "durationSeconds": (
                    (a.ended_at - a.started_at).total_seconds() if a.ended_at else None
                ),
            }
            for a in attempts(job, events)
        ],
        "nextStep": next_step(job, now, pause, events),
        "events": [{"at": iso(e.at), "kind": e.kind, "detail": e.detail} for e in events],
    }


def render_job(
    job: JobRecord,
    events: list[EventRecord],
    now: datetime,
    trace_id: str | None = None,
    pause: QueuePause | None = None,
    links: JobLinks | None = None,
    trace_url: str | None = None,
) -> None:
    job, events = scrubbed_view(job, events)
    owner = f"  account {job.account_id}" if job.account_id is not None else ""
    console.print(f"[bold]job {job.id}[/bold]  {escape(job.type + owner)}")
    facts = Table.grid(padding=(0, 2))
    facts.add_row("state", f"[bold]{job.state.value}[/bold]")
    queue = job.queue if pause is None else f"{job.queue} ({paused_line(pause, now)})"
    facts.add_row("queue", queue)
    if job.waiting_for_run_at(now):
        assert job.run_at is not None
        facts.add_row("delayed", runs_at_text(job.run_at, now))
    elif job.run_at is not None:
        facts.add_row("run at", job.run_at.isoformat(timespec="seconds"))
    facts.add_row(
        "published",
        "yes"
        if job.published
        else "not yet: held until its run time"
        if job.waiting_for_run_at(now)
        else f"no (an outbox row waits since {ago(job.unpublished_since, now)})"
        if job.unpublished_since is not None
        else "no",
    )
    if job.last_publish_error and not job.published:
        facts.add_row("publish error", job.last_publish_error)
    if job.limits:
        facts.add_row("limits", ", ".join(_limit_text(limit) for limit in job.limits))
        if any(limit.kind == PRIORITY for limit in job.limits):
            facts.add_row("priority", f"{job.priority} in its queue (0..9, higher runs first)")
    if links is not None and links.dependency_count:
        facts.add_row("runs after", _links_text(links.dependencies, links.dependency_count, job))
    if links is not None and links.dependant_count:
        facts.add_row("waited for by", _links_text(links.dependants, links.dependant_count))
    facts.add_row("attempts", f"{job.attempt}/{job.max_attempts}")
    facts.add_row("last error", job.last_error or "-")
    if job.quarantine_reason:
        facts.add_row("quarantined for", job.quarantine_reason)
    facts.add_row("next attempt", ago(job.next_attempt_at, now))
    facts.add_row(
        "lease",
        f"{job.lease_owner} until {ago(job.lease_expires_at, now)}" if job.lease_owner else "-",
    )
    facts.add_row("result key", job.result_key or "-")
    if job.result is not None:
        facts.add_row("result", escape(json.dumps(job.result, ensure_ascii=False)))
    if job.progress_total is not None:
        facts.add_row("progress", f"{job.progress_done or 0}/{job.progress_total}")
    facts.add_row("params", escape(json.dumps(job.params, ensure_ascii=False, default=str)))
    facts.add_row("trace id", trace_id or "-")
    link = trace_link(trace_id, trace_url)
    if link is not None:
        facts.add_row("trace", f"[link={escape(link)}]{escape(link)}[/link]")
    facts.add_row(
        "accepted", f"{job.created_at.isoformat(timespec='seconds')} ({ago(job.created_at, now)})"
    )
    console.print(facts)
    tried = attempts(job, events)
    if tried:
        table = Table(title="attempts", show_edge=False)
        for column in ("#", "started", "worker", "outcome", "error"):
            table.add_column(column)
        for a in tried:
            table.add_row(
                str(a.number),
                a.started_at.isoformat(timespec="milliseconds"),
                a.worker or "-",
                a.outcome,
                a.error or "",
            )
        console.print(table)
    timeline = Table(title="timeline", show_edge=False)
    for column in ("at", "event", "detail"):
        timeline.add_column(column)
    for event in events:
        detail = ", ".join(f"{k}={_shown(v)}" for k, v in event.detail.items() if v is not None)
        timeline.add_row(event.at.isoformat(timespec="milliseconds"), event.kind, detail)
    console.print(timeline)
    console.print(f"next: {next_step(job, now, pause, events)}")


def render_traceback(job: JobRecord, wanted: bool) -> None:
    """After the view: the last failure's traceback (``wanted``), else a hint that there is one.

    Printed as stored, not as rich markup: a traceback quotes code and messages, whose
    brackets and colons rich would read as styles and emoji.
    """
    if not wanted:
        if job.last_traceback:
            console.print("last failure has a traceback: --traceback")
        return
    if not job.last_traceback:
        console.print("no traceback stored for this job")
        return
    console.print("traceback of the last failure:")
    console.print(scrub(job.last_traceback).rstrip("\n"), markup=False, emoji=False)


async def show_job(
    settings: Settings, job_id: str, *, as_json: bool = False, traceback: bool = False
) -> bool:
    from jobrelay.storage.admin import AdminQueries

    async with open_runtime(settings, connect_transport=False) as rt:
        job = await rt.store.get_job(job_id)
        if job is None:
            return False
        events = await rt.store.events(job_id)
        trace_id = await AdminQueries(rt.store).trace_id(job_id)
        pause = await pause_of(rt.store, job.queue)
        links = await rt.store.links_of(job_id)
    now = utc_now()
    if as_json:
        document = explain_document(job, events, now, trace_id, pause, links, settings.trace_url)
        print(json.dumps(document, indent=2))
    else:
        render_job(job, events, now, trace_id, pause, links, settings.trace_url)
        render_traceback(job, traceback)
    return True


def _links_text(shown: Sequence[LinkedJob], total: int, job: JobRecord | None = None) -> str:
    """``waiting for 3 of 1,000: a (succeeded), b (running), …`` or ``2 jobs: …``."""
    if job is not None and job.state is JobState.WAITING:
        head = f"waiting for {job.waiting_for:,} of {total:,}"
    else:
        head = f"{total:,} job{'s' if total != 1 else ''}"
    listed = ", ".join(f"{j.job_id} ({j.state.value if j.state else 'pruned'})" for j in shown)
    more = ", …" if total > len(shown) else ""
    return escape(f"{head}: {listed}{more}")


def _limit_text(limit: JobLimit) -> str:
    name, key = split_id(limit.limit_id)
    who = escape(name if key is None else f"{name} {key}")
    if limit.kind == FAIR:
        return f"{escape(name)} (fair by key: {escape(limit.key or '')})"
    if limit.kind == PRIORITY:
        return f"{escape(name)} (by priority)"
    if limit.max is not None:
        return f"{who} (concurrency {limit.max})"
    return f"{who} (rate {limit.per_second:g}/s)"


def _shown(value: Any) -> str:
    """A detail value as the timeline prints it: nested ones (``meta``) as JSON."""
    return json.dumps(value, default=str) if isinstance(value, dict | list) else str(value)
