"""``jobrelay job show`` and ``jobs list``: what a person on call reads first.

The answer to "where is my export?" is a boundary: not yet published (look at the relay),
published but not claimed (look at the workers), waiting for a retry, quarantined (read the
reason), or done (here is the file). ``next_step`` says which, in one line.
"""

from __future__ import annotations

from datetime import datetime

from rich.console import Console
from rich.table import Table

from jobrelay.domain.states import JobState
from jobrelay.runtime import open_runtime, utc_now
from jobrelay.settings import Settings
from jobrelay.storage.store import EventRecord, JobRecord

console = Console(highlight=False, soft_wrap=True)


def _ago(when: datetime | None, now: datetime) -> str:
    if when is None:
        return "-"
    seconds = int((now - when).total_seconds())
    span = f"{abs(seconds)} s" if abs(seconds) < 120 else f"{abs(seconds) // 60} min"
    return f"{span} ago" if seconds >= 0 else f"in {span}"


def next_step(job: JobRecord, now: datetime) -> str:
    if job.state is JobState.SUCCEEDED:
        return f"done: result at {job.result_key}"
    if job.state is JobState.QUARANTINED:
        return (
            f"quarantined: {job.quarantine_reason or job.last_error}; the message is in "
            "jobrelay.quarantine, the reason above is the one to act on"
        )
    if job.state is JobState.CANCELLED:
        return "cancelled by an operator; nothing further will run"
    if job.state is JobState.RUNNING:
        return (
            f"running attempt {job.attempt}/{job.max_attempts} on {job.lease_owner}, lease "
            f"expires {_ago(job.lease_expires_at, now)}; if that worker died the job is "
            "taken over when the lease expires"
        )
    if not job.published and job.unpublished_since is not None:
        hint = f"; last publish error: {job.last_publish_error}" if job.last_publish_error else ""
        return (
            f"an outbox row has waited {_ago(job.unpublished_since, now).removesuffix(' ago')}"
            f" to be published: is a relay running?{hint}"
        )
    if job.state is JobState.RETRY_WAIT:
        return (
            f"waiting to retry ({_ago(job.next_attempt_at, now)}) after: {job.last_error}; "
            "the retry message is in the delay route"
        )
    return "published and waiting for a worker: is a worker running and consuming?"


def render_job(job: JobRecord, events: list[EventRecord], now: datetime) -> None:
    console.print(f"[bold]job {job.id}[/bold]  {job.type}  account {job.account_id}")
    facts = Table.grid(padding=(0, 2))
    facts.add_row("state", f"[bold]{job.state.value}[/bold]")
    facts.add_row(
        "published",
        "yes" if job.published else f"no (waiting since {_ago(job.unpublished_since, now)})",
    )
    facts.add_row("attempts", f"{job.attempt}/{job.max_attempts}")
    facts.add_row("last error", job.last_error or "-")
    facts.add_row("next attempt", _ago(job.next_attempt_at, now))
    facts.add_row(
        "lease",
        f"{job.lease_owner} until {_ago(job.lease_expires_at, now)}" if job.lease_owner else "-",
    )
    facts.add_row("result key", job.result_key or "-")
    if job.progress_total is not None:
        facts.add_row("progress", f"{job.progress_done or 0}/{job.progress_total} rows")
    facts.add_row("params", str(job.params))
    console.print(facts)
    timeline = Table(title="timeline", show_edge=False)
    for column in ("at", "event", "detail"):
        timeline.add_column(column)
    for event in events:
        detail = ", ".join(f"{k}={v}" for k, v in event.detail.items() if v is not None)
        timeline.add_row(event.at.isoformat(timespec="milliseconds"), event.kind, detail)
    console.print(timeline)
    console.print(f"next: {next_step(job, now)}")


async def show_job(settings: Settings, job_id: str) -> bool:
    async with open_runtime(settings, connect_transport=False) as rt:
        job = await rt.store.get_job(job_id)
        if job is None:
            return False
        render_job(job, await rt.store.events(job_id), utc_now())
    return True


async def list_jobs(settings: Settings, state: JobState | None, limit: int) -> None:
    async with open_runtime(settings, connect_transport=False) as rt:
        jobs = await rt.store.list_jobs(state=state, limit=limit)
    table = Table(show_edge=False)
    for column in (
        "job id",
        "type",
        "account",
        "state",
        "published",
        "attempt",
        "updated",
        "last error",
    ):
        table.add_column(column)
    now = utc_now()
    for job in jobs:
        table.add_row(
            job.id,
            job.type,
            job.account_id,
            job.state.value,
            "yes" if job.published else "no",
            f"{job.attempt}/{job.max_attempts}",
            _ago(job.updated_at, now),
            (job.last_error or "")[:60],
        )
    console.print(table)
    console.print(f"{len(jobs)} job(s)")
