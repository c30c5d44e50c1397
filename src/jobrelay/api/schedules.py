"""Periodic jobs over HTTP, for admin tokens: list, one schedule with its timeline, pause, resume.

The same ``ScheduleOperator`` as ``jobrelay schedules``; pause and resume are audited on the
schedule's timeline with the admin token's name (``token#<id> (<label>)``) and the required
reason, as replay and cancel are on a job's.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any

from fastapi import APIRouter, Path, Request
from pydantic import Field

from jobrelay.admin.schedules import ScheduleOperator, pause_refusal
from jobrelay.api.admin import INVALID_TRANSITION, AdminActor, CancelRequest, admin_responses
from jobrelay.api.bodies import MAX_BODY_BYTES, parse_body, read_body
from jobrelay.api.deps import RuntimeDep
from jobrelay.api.problems import ProblemError, problem_openapi
from jobrelay.api.schemas import WireModel

router = APIRouter()

_RESPONSES = admin_responses()
_ONE: dict[int | str, dict[str, Any]] = {**_RESPONSES, 404: problem_openapi("No such schedule.")}
_ACTION: dict[int | str, dict[str, Any]] = {
    **_ONE,
    409: problem_openapi("The schedule is already paused (pause) or running (resume)."),
    413: problem_openapi(f"The body is larger than {MAX_BODY_BYTES} bytes."),
    422: problem_openapi("Invalid body (a non-blank reason is required)."),
}
NamePath = Annotated[str, Path(description="The schedule's name.")]


def _body_of(model: type[PauseRequest]) -> dict[str, Any]:
    """The body as OpenAPI states it: parsed in the handler, after the token (as admin.py)."""
    schema = {"application/json": {"schema": model.model_json_schema()}}
    return {"requestBody": {"required": True, "content": schema}}


class ScheduleOut(WireModel):
    name: str
    job_type: str
    cron: str
    timezone: str
    paused: bool
    paused_at: str | None
    paused_by: str | None
    paused_reason: str | None
    skipped_while_paused: dict[str, Any] | None = Field(
        description="Ticks skipped so far in the current pause: reason, count, first, last, "
        "ticks (the first few), countComplete."
    )
    next_tick: str | None = Field(description="The next tick's time (UTC); null while paused.")
    last_tick: str | None = Field(description="The latest tick that was enqueued.")
    last_job_id: str | None
    last_job_state: str | None = Field(description="Its state; null once the job was pruned.")
    last_skipped: dict[str, Any] | None = Field(
        description="The latest `ticks_skipped` event's detail, with its `at`."
    )
    handled_until: str = Field(description="Every tick at or before this time is handled.")
    defined_by_app: bool = Field(description="False: the API's app has no such schedule.")


class SchedulesOut(WireModel):
    schedules: list[ScheduleOut]


class ScheduleEvent(WireModel):
    at: datetime
    kind: str
    detail: dict[str, Any]


class ScheduleDetail(ScheduleOut):
    events: list[ScheduleEvent] = Field(description="The schedule's timeline, newest first.")


class PauseRequest(CancelRequest):
    """``reason`` is required, and kept in the schedule's timeline."""


class PauseOut(WireModel):
    name: str
    action: str
    paused: bool
    actor: str
    skipped: dict[str, Any] | None = Field(
        default=None, description="resume: the ticks skipped while paused."
    )


@router.get(
    "/v1/schedules",
    response_model=SchedulesOut,
    summary="List periodic schedules (admin)",
    responses=_RESPONSES,
)
async def list_schedules(runtime: RuntimeDep, actor: AdminActor) -> SchedulesOut:
    rows = await ScheduleOperator(runtime).rows()
    return SchedulesOut(schedules=[ScheduleOut(**row.as_dict()) for row in rows])


@router.get(
    "/v1/schedules/{name}",
    response_model=ScheduleDetail,
    summary="One periodic schedule and its timeline (admin)",
    responses=_ONE,
)
async def show_schedule(name: NamePath, runtime: RuntimeDep, actor: AdminActor) -> ScheduleDetail:
    operator = ScheduleOperator(runtime)
    found = [row for row in await operator.rows() if row.view.name == name]
    if not found:
        raise ProblemError(404, "no such schedule")
    events = [ScheduleEvent(**e) for e in await operator.events(name)]
    return ScheduleDetail(**found[0].as_dict(), events=events)


async def _set_paused(
    request: Request, runtime: RuntimeDep, name: str, actor: str, paused: bool
) -> PauseOut:
    body = parse_body(PauseRequest, await read_body(request))
    outcome = await ScheduleOperator(runtime).set_paused(
        name, paused, actor=actor, reason=body.reason
    )
    if not outcome.found:
        raise ProblemError(404, "no such schedule")
    if not outcome.done:
        raise ProblemError(
            409,
            pause_refusal(name, outcome, paused),
            type_=INVALID_TRANSITION,
            title="Not allowed in this state",
        )
    return PauseOut(
        name=name,
        action="pause" if paused else "resume",
        paused=paused,
        actor=actor,
        skipped=outcome.skipped.detail() if outcome.skipped else None,
    )


@router.post(
    "/v1/schedules/{name}/pause",
    response_model=PauseOut,
    summary="Pause a periodic schedule (admin)",
    responses=_ACTION,
    openapi_extra=_body_of(PauseRequest),
)
async def pause_schedule(
    request: Request, name: NamePath, runtime: RuntimeDep, actor: AdminActor
) -> PauseOut:
    """Its ticks are skipped (and counted) until it is resumed; a `paused` event names this
    token and the reason."""
    return await _set_paused(request, runtime, name, actor, True)


@router.post(
    "/v1/schedules/{name}/resume",
    response_model=PauseOut,
    summary="Resume a paused periodic schedule (admin)",
    responses=_ACTION,
    openapi_extra=_body_of(PauseRequest),
)
async def resume_schedule(
    request: Request, name: NamePath, runtime: RuntimeDep, actor: AdminActor
) -> PauseOut:
    """The ticks skipped while paused are written as a `ticks_skipped` event (never caught
    up); the next tick is enqueued as usual."""
    return await _set_paused(request, runtime, name, actor, False)
