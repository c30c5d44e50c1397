"""``jobrelay jobs list``: the operator's table of jobs, filtered as the CLI asks.

Kept apart from ``explain`` (one job, read in depth) because a list reads many jobs and
answers a different question: which jobs, not why this one.
"""

from __future__ import annotations

import sys
from datetime import datetime
from typing import TYPE_CHECKING

from rich.table import Table

from jobrelay.admin.explain import ago, console
from jobrelay.domain.delays import runs_at_text
from jobrelay.domain.states import JobState
from jobrelay.observe.scrub import scrub
from jobrelay.runtime.wiring import open_runtime, utc_now
from jobrelay.settings import Settings

if TYPE_CHECKING:
    from jobrelay.storage.records import JobRecord


async def list_jobs(
    settings: Settings,
    state: JobState | None,
    limit: int,
    *,
    reason: str | None = None,
    job_type: str | None = None,
    queue: str | None = None,
    account: str | None = None,
) -> None:
    from jobrelay.storage.admin import AdminQueries

    async with open_runtime(settings, connect_transport=False) as rt:
        admin = AdminQueries(rt.store)
        jobs = await admin.find_jobs(
            state=state,
            reason=reason,
            job_type=job_type,
            queue=queue,
            account_id=account,
            limit=limit,
        )
        if job_type is not None and not jobs:
            known = await admin.stored_types()
            if rt.app is not None:
                known |= {*rt.app.jobs, *rt.app.included_types}
            if job_type not in known:
                names = ", ".join(sorted(known)) or "none"
                print(
                    f"jobrelay: warning: --type: no job type {job_type!r} here (known: {names})",
                    file=sys.stderr,
                )
    render_jobs(jobs, utc_now())


def render_jobs(jobs: list[JobRecord], now: datetime) -> None:
    """The table ``jobs list`` prints: one row per job, its reason scrubbed."""
    table = Table(show_edge=False)
    table.add_column("job id", no_wrap=True)
    for column in (
        "type",
        "account",
        "state",
        "published",
        "attempt",
        "updated",
        "reason / last error",
    ):
        table.add_column(column)
    for job in jobs:
        table.add_row(
            job.id,
            job.type,
            job.account_id,
            job.state.value,
            "yes" if job.published else "no",
            f"{job.attempt}/{job.max_attempts}",
            ago(job.updated_at, now),
            runs_at_text(job.run_at, now)
            if job.run_at is not None and job.waiting_for_run_at(now)
            else scrub(job.quarantine_reason or job.last_error or "")[:80],
        )
    console.print(table)
    console.print(f"{len(jobs)} job(s)")
