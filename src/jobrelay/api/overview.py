"""``GET /v1/overview``: how the system is doing, in one read (admin).

What the console's live overview draws, every few seconds: jobs per state, type and queue;
the last hour's throughput per minute (``accepted``, ``succeeded`` = ``result_saved``,
``retried`` = ``retry_scheduled``, ``quarantined`` events); the outbox backlog, its oldest
row and the relay lag; and each work queue's depth as the broker reports it (RabbitMQ: a
passive declare gives ready messages and consumers, in flight comes from the management API
when it answers; the local transport: ready and in-flight rows, consumers from the workers'
heartbeats) with its pause flag (``api.queues``). A number
the broker cannot give is ``null``, never a guess; a broker that does not answer leaves
the counts ``null`` with ``queuesError`` saying why, and the rest of the overview still comes.
The processes are the workers and relays whose heartbeat (``runtime.heartbeat``) is recent,
each with a ``status``: ``gone`` once it missed ``GONE_AFTER_BEATS`` beats in a row (the rule
the local transport's consumer count uses too), else ``alive``. It is computed here, from the
database's ``last_seen_at`` and this process's ``JOBRELAY_HEARTBEAT_SECONDS``, so a page that
sits open never judges a process by the browser's clock. A gone process stays listed for a
while (``process_window``) so an operator sees what stopped, and when.

The reconciler's current findings are a dry-run pass made for each read (``run_once(dry_run,
scan_quarantine=False)``, at most 50 jobs of each kind): always current, never a repair,
and without the quarantine scan, which reads the broker's quarantine queue and is too heavy
for a page refreshed every few seconds.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Literal

from fastapi import APIRouter
from pydantic import Field

from jobrelay.api.admin import AdminActor
from jobrelay.api.deps import RuntimeDep
from jobrelay.api.job_search import LIST_RESPONSES
from jobrelay.api.problems import problem_openapi
from jobrelay.api.queues import QueueOut, queue_rows
from jobrelay.api.schemas import WireModel
from jobrelay.domain.job_filter import minute_series, window_start
from jobrelay.maintenance.reconcile import Reconciler
from jobrelay.storage.admin import AdminQueries
from jobrelay.storage.dashboard import job_counts, relay_lag, throughput
from jobrelay.storage.heartbeats import seen_since

router = APIRouter()

WINDOW_MINUTES = 60
PROCESS_MINUTES = 5  # a process not seen for this long is left out of the overview
GONE_AFTER_BEATS = 3  # a process that missed this many heartbeats in a row is gone
FINDINGS_SHOWN = 20


class Counts(WireModel):
    total: int
    by_state: dict[str, int]
    by_type: dict[str, int]
    by_queue: dict[str, int]


class Throughput(WireModel):
    minutes: list[str] = Field(description="The start of each minute (UTC), oldest first.")
    accepted: list[int]
    succeeded: list[int]
    retried: list[int]
    quarantined: list[int]


class Outbox(WireModel):
    backlog: int = Field(description="Outbox rows not yet published.")
    oldest_at: datetime | None
    oldest_age_seconds: float | None
    lag_sampled: int = Field(description="Latest published rows the lag is measured on.")
    lag_median_seconds: float | None
    lag_max_seconds: float | None
    last_published_at: datetime | None


ProcessStatus = Literal["alive", "gone"]


class ProcessOut(WireModel):
    id: str
    role: str = Field(description="worker or relay")
    host: str
    pid: int
    queues: list[str]
    started_at: datetime
    last_seen_at: datetime
    status: ProcessStatus = Field(
        description=(
            f"`gone` when its last heartbeat is more than {GONE_AFTER_BEATS} heartbeat "
            "intervals (`JOBRELAY_HEARTBEAT_SECONDS`) old, else `alive`."
        )
    )


def process_status(last_seen: datetime, now: datetime, heartbeat_seconds: float) -> ProcessStatus:
    """``gone`` once ``GONE_AFTER_BEATS`` beats were missed: one late beat (a busy event
    loop, a slow write) is not a dead process, three in a row are."""
    late = now - last_seen > timedelta(seconds=GONE_AFTER_BEATS * heartbeat_seconds)
    return "gone" if late else "alive"


def process_window(heartbeat_seconds: float) -> timedelta:
    """How far back the overview lists processes: ``PROCESS_MINUTES``, or longer when the
    heartbeat is so slow that a live process would otherwise drop out between two beats
    (a gone one then stays listed as long again as it took to be called gone)."""
    gone_after = timedelta(seconds=GONE_AFTER_BEATS * heartbeat_seconds)
    return max(timedelta(minutes=PROCESS_MINUTES), 2 * gone_after)


class FindingOut(WireModel):
    kind: str
    job_id: str | None
    detail: str


class ReconcilerOut(WireModel):
    counts: dict[str, int] = Field(description="Findings per kind (at most 50 of each read).")
    findings: list[FindingOut] = Field(description=f"The first {FINDINGS_SHOWN}.")


class OverviewOut(WireModel):
    generated_at: datetime
    counts: Counts
    throughput: Throughput
    outbox: Outbox
    queues: list[QueueOut]
    queues_error: str | None = None
    reconciler: ReconcilerOut = Field(
        description="A dry-run reconciler pass made for this read, without the quarantine scan."
    )
    processes: list[ProcessOut] = Field(
        description=(
            f"Workers and relays whose heartbeat is under {PROCESS_MINUTES} min old (longer "
            f"with a slow heartbeat: {2 * GONE_AFTER_BEATS} heartbeat intervals), the latest "
            "first; see `status`."
        )
    )


@router.get(
    "/v1/overview",
    response_model=OverviewOut,
    summary="Counts, throughput, outbox and queue depths (admin)",
    responses={
        **{k: v for k, v in LIST_RESPONSES.items() if k != 422},
        403: problem_openapi("Not an admin token."),
    },
)
async def overview(runtime: RuntimeDep, actor: AdminActor) -> OverviewOut:
    store = runtime.store
    now = runtime.clock()
    start = window_start(now, WINDOW_MINUTES)
    counts = await job_counts(store)
    series = minute_series(await throughput(store, start), start, WINDOW_MINUTES)
    backlog, oldest = await AdminQueries(store).outbox_stats()
    lag = await relay_lag(store)
    queues = await queue_rows(runtime)
    beat_seconds = runtime.settings.heartbeat_seconds
    processes = await seen_since(store, now - process_window(beat_seconds))
    look = Reconciler(runtime, actor="overview", batch=50)
    report = await look.run_once(dry_run=True, scan_quarantine=False, record=False)
    return OverviewOut(
        generated_at=now,
        counts=Counts(
            total=counts.total,
            by_state=counts.by_state,
            by_type=counts.by_type,
            by_queue=counts.by_queue,
        ),
        throughput=Throughput.model_validate(series),
        outbox=Outbox(
            backlog=backlog,
            oldest_at=oldest,
            oldest_age_seconds=(now - oldest).total_seconds() if oldest else None,
            lag_sampled=lag.sampled,
            lag_median_seconds=lag.median_seconds,
            lag_max_seconds=lag.max_seconds,
            last_published_at=lag.last_published_at,
        ),
        queues=queues.queues,
        queues_error=queues.queues_error,
        reconciler=ReconcilerOut(
            counts=report.counts(),
            findings=[
                FindingOut(kind=f.kind, job_id=f.job_id, detail=f.detail)
                for f in report.findings[:FINDINGS_SHOWN]
            ],
        ),
        processes=[
            ProcessOut(
                id=p.id,
                role=p.role,
                host=p.host,
                pid=p.pid,
                queues=list(p.queues),
                started_at=p.started_at,
                last_seen_at=p.last_seen_at,
                status=process_status(p.last_seen_at, now, beat_seconds),
            )
            for p in processes
        ],
    )
