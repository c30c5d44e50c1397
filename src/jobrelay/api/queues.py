"""Work queues: their depth and pause state, and pausing or resuming one (admin).

``GET /v1/queues`` lists every queue of the app's topology with what the broker says of it
(``null`` where it cannot say) and the operators' pause flag. ``POST
/v1/queues/{queue}/pause`` and ``/resume`` set the flag, with a required reason, audited in
``queue_events`` with the admin token's name; workers see it within
``JOBRELAY_QUEUE_PAUSE_POLL_SECONDS`` and stop (or start) consuming that queue. Nothing is
lost while a queue is paused: its messages wait in the broker.
"""

from __future__ import annotations

from dataclasses import replace
from datetime import datetime, timedelta
from typing import Annotated, Any

from fastapi import APIRouter, Path, Request
from pydantic import Field

from jobrelay.api.admin import AdminActor, _Reasoned, admin_responses, body_of
from jobrelay.api.bodies import MAX_BODY_BYTES, parse_body, read_body
from jobrelay.api.deps import RuntimeDep
from jobrelay.api.problems import ProblemError, ValidationProblem, problem_openapi
from jobrelay.api.schemas import WireModel
from jobrelay.errors import TransportError
from jobrelay.library.operator import UnknownQueue, set_queue_paused
from jobrelay.runtime.wiring import Runtime
from jobrelay.storage.heartbeats import seen_since
from jobrelay.storage.queue_pauses import pauses
from jobrelay.transport.base import QueueStats, ReportsQueues

router = APIRouter()

_READ = admin_responses("The database is unavailable.")
_ACT: dict[int | str, dict[str, Any]] = {
    **_READ,
    404: problem_openapi("No such queue in this app's topology."),
    409: problem_openapi("The queue is already paused (or already running)."),
    413: problem_openapi(f"The body is larger than {MAX_BODY_BYTES} bytes."),
    422: problem_openapi("Invalid body (a reason is required).", ValidationProblem),
}
QueuePath = Annotated[str, Path(max_length=64, description="A queue of the app's topology.")]


class QueueReason(_Reasoned):
    reason: str = Field(min_length=1, max_length=500, description="Why; kept in the audit.")


class QueueOut(WireModel):
    queue: str
    ready: int | None = Field(description="Messages waiting; null: the broker cannot say.")
    consumers: int | None
    in_flight: int | None
    paused: bool
    paused_at: datetime | None = None
    paused_by: str | None = None
    paused_reason: str | None = None


class QueuesOut(WireModel):
    queues: list[QueueOut]
    queues_error: str | None = None


async def queue_rows(runtime: Runtime) -> QueuesOut:
    """Every queue of the topology: broker counts (or why not) and the pause flag."""
    stats: dict[str, QueueStats] = {}
    error = None
    transport = runtime.transport
    if isinstance(transport, ReportsQueues):
        try:
            stats = {s.queue: s for s in await transport.queue_stats()}
        except TransportError as exc:
            error = str(exc)
    else:
        error = "this transport does not report its queues"
    stats = await _fill_in(runtime, stats)
    flags = await pauses(runtime.store)
    rows = []
    for name in runtime.topology.queues:
        s = stats.get(name)
        flag = flags.get(name)
        paused = flag is not None and flag.paused
        rows.append(
            QueueOut(
                queue=name,
                ready=s.ready if s else None,
                # The local transport's consumers are counted from heartbeats: a paused
                # queue's workers have stopped consuming it.
                consumers=(0 if paused and runtime.settings.uses_local_broker else s.consumers)
                if s
                else None,
                in_flight=s.in_flight if s else None,
                paused=paused,
                paused_at=flag.changed_at if flag and paused else None,
                paused_by=flag.changed_by if flag and paused else None,
                paused_reason=flag.reason if flag and paused else None,
            )
        )
    return QueuesOut(queues=rows, queues_error=error)


@router.get(
    "/v1/queues",
    response_model=QueuesOut,
    summary="Work queues: depth, consumers, in flight, paused (admin)",
    responses=_READ,
)
async def list_queues(runtime: RuntimeDep, actor: AdminActor) -> QueuesOut:
    return await queue_rows(runtime)


async def _set(request: Request, runtime: Runtime, queue: str, paused: bool, actor: str) -> Any:
    body = parse_body(QueueReason, await read_body(request))
    queues = runtime.topology.queues
    try:
        changed = await set_queue_paused(
            runtime, queue, paused, actor=actor, reason=body.reason, queues=queues
        )
    except UnknownQueue:
        known = ", ".join(queues)
        raise ProblemError(404, f"no such queue in this app (its queues: {known})") from None
    if not changed:
        raise ProblemError(409, f"queue {queue} is already {'paused' if paused else 'running'}")
    [row] = [q for q in (await queue_rows(runtime)).queues if q.queue == queue]
    return row


@router.post(
    "/v1/queues/{queue}/pause",
    response_model=QueueOut,
    summary="Stop workers consuming a queue; its messages wait in the broker (admin)",
    responses=_ACT,
    openapi_extra=body_of(QueueReason, required=True),
)
async def pause_queue(
    request: Request, queue: QueuePath, runtime: RuntimeDep, actor: AdminActor
) -> QueueOut:
    row: QueueOut = await _set(request, runtime, queue, True, actor)
    return row


@router.post(
    "/v1/queues/{queue}/resume",
    response_model=QueueOut,
    summary="Let workers consume a paused queue again (admin)",
    responses=_ACT,
    openapi_extra=body_of(QueueReason, required=True),
)
async def resume_queue(
    request: Request, queue: QueuePath, runtime: RuntimeDep, actor: AdminActor
) -> QueueOut:
    row: QueueOut = await _set(request, runtime, queue, False, actor)
    return row


async def _fill_in(runtime: Runtime, stats: dict[str, QueueStats]) -> dict[str, QueueStats]:
    """What the transport itself cannot count, from where it is known: on RabbitMQ the
    unacked (in-flight) messages from the management API when it answers; on the local
    transport the consumers, as the workers serving the queue whose heartbeat is recent."""
    if not stats:
        return stats
    settings = runtime.settings
    if settings.uses_local_broker:
        since = runtime.clock() - timedelta(seconds=3 * settings.heartbeat_seconds)
        beats = [b for b in await seen_since(runtime.store, since) if b.role == "worker"]
        return {
            name: replace(s, consumers=sum(name in b.queues for b in beats))
            if s.consumers is None
            else s
            for name, s in stats.items()
        }
    from jobrelay.transport.rabbit_management import unacked
    from jobrelay.transport.topology import work_queue

    names = {work_queue(name): name for name in stats}
    counts = await unacked(settings.broker_url, settings.broker_management_url, list(names))
    if counts is None:
        return stats
    return {
        name: replace(s, in_flight=counts.get(work_queue(name))) if s.in_flight is None else s
        for name, s in stats.items()
    }
