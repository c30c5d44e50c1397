"""``POST /v1/jobs``: accept a job of any type the application exposes (``http=True``).

The same contract as ``POST /v1/exports``, through the same code (``jobrelay.http.accept_job``,
what ``AcceptDep`` runs): the job, its outbox row and its ``accepted`` event commit in one
transaction before the 202, counted, logged and followed by the same fault point; the account
comes from the token (an admin token enqueues on no account's behalf); the same ``key`` with
the same params returns the same id. A type that is unknown or not exposed is a 404,
indistinguishable from each other.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Request, Response
from pydantic import ConfigDict, Field, StringConstraints

from jobrelay.api.bodies import MAX_BODY_BYTES, parse_body, read_body
from jobrelay.api.deps import RuntimeDep
from jobrelay.api.problems import (
    FieldError,
    ProblemError,
    ValidationProblem,
    problem_openapi,
)
from jobrelay.api.quota import QUOTA_RESPONSES
from jobrelay.api.ratelimit import RATE_LIMIT_RESPONSES, RateLimitedDep
from jobrelay.api.schemas import IDEMPOTENCY_KEY_PATTERN, Accepted, IdempotencyKey, WireModel
from jobrelay.domain import delays
from jobrelay.domain.delays import RunTime
from jobrelay.errors import InvalidDependencies, InvalidParams, InvalidRunTime
from jobrelay.http import accept_job

router = APIRouter()


class JobRequest(WireModel):
    model_config = ConfigDict(extra="forbid", validate_by_name=False)

    type: str = Field(min_length=1, max_length=64, description="An exposed job type.")
    params: dict[str, Any] = Field(default_factory=dict, description="The job's parameters.")
    key: str | None = Field(
        default=None,
        pattern=IDEMPOTENCY_KEY_PATTERN,
        description="Optional idempotency key: the same key and params give the same job.",
    )
    run_at: str | None = Field(
        default=None,
        max_length=64,
        description="Run no earlier than this RFC 3339 time with an offset (a past one: now).",
        examples=["2026-12-02T16:00:00Z"],
    )
    delay_seconds: float | None = Field(
        default=None,
        strict=True,  # a JSON number: true and "1" are not seconds
        description="Run no earlier than this many seconds from now (0 to 365 days).",
    )
    after: list[Annotated[str, StringConstraints(min_length=1, max_length=64)]] = Field(
        default_factory=list,
        max_length=100_000,
        description=(
            "Job ids this job runs after: it is `waiting` until every one has ended"
            " (at most JOBRELAY_MAX_DEPENDENCIES, each readable by the caller)."
        ),
    )
    after_failure: Literal["cancel", "run"] = Field(
        default="cancel",
        description="What a job of `after` that ends quarantined or cancelled does: "
        "cancel this one (naming it), or let it run.",
    )


def run_time(body: JobRequest, now: datetime) -> RunTime:
    """The body's run time, or a 422 naming ``runAt`` / ``delaySeconds`` (domain.delays)."""
    run_at = None
    if body.run_at is not None:
        try:
            run_at = datetime.fromisoformat(body.run_at)
        except ValueError:
            raise _run_time_problem(
                InvalidRunTime("runAt", "not an RFC 3339 time (2026-12-02T16:00:00Z)")
            ) from None
    try:
        return delays.resolve(
            now,
            delay=body.delay_seconds,
            run_at=run_at,
            delay_name="delaySeconds",
            run_at_name="runAt",
        )
    except InvalidRunTime as exc:
        raise _run_time_problem(exc) from None


def _one_key(in_body: str | None, header: str | None) -> str | None:
    """The request's key: the body's ``key`` or the ``Idempotency-Key`` header (what a
    client's retry middleware sends); both may be given only when they are the same."""
    if in_body is not None and header is not None and in_body != header:
        problem = "the Idempotency-Key header and the body's key differ: give one key"
        raise ProblemError(
            422,
            problem,
            title="Invalid request",
            errors=[FieldError(field="Idempotency-Key", message=problem).model_dump()],
        )
    return in_body if in_body is not None else header


def _run_time_problem(exc: InvalidRunTime) -> ProblemError:
    return ProblemError(
        422,
        str(exc),
        title="Invalid run time",
        errors=[FieldError(field=exc.field, message=exc.problem).model_dump()],
    )


@router.post(
    "/v1/jobs",
    status_code=202,
    response_model=Accepted,
    summary="Accept a job of an application type exposed over HTTP",
    responses={
        401: problem_openapi("No token, or not a valid one."),
        404: problem_openapi("No such job type, or it is not exposed over HTTP."),
        413: problem_openapi(f"The body is larger than {MAX_BODY_BYTES} bytes."),
        422: problem_openapi(
            "Invalid body, params, run time or dependencies, or a key reused with another request.",
            ValidationProblem,
        ),
        503: problem_openapi("The database is unavailable; nothing was changed."),
        **RATE_LIMIT_RESPONSES,
        **QUOTA_RESPONSES,
    },
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": JobRequest.model_json_schema()}},
        }
    },
)
async def create_job(
    request: Request,
    response: Response,
    principal: RateLimitedDep,
    runtime: RuntimeDep,
    idempotency_key: IdempotencyKey = None,
) -> Accepted:
    body = parse_body(JobRequest, await read_body(request))
    key = _one_key(body.key, idempotency_key)
    definition = runtime.app.jobs.get(body.type) if runtime.app is not None else None
    if definition is None or not definition.http:
        raise ProblemError(404, "no such job type is exposed over HTTP")
    when = run_time(body, runtime.clock())
    try:
        admission = await accept_job(
            runtime,
            definition,
            body.params,
            account=principal.account_id,
            key=key,
            when=when,
            key_field="key",
            after=body.after,
            after_failure=body.after_failure,
        )
    except InvalidDependencies as exc:
        refused = [FieldError(field="after", message=str(exc)).model_dump()]
        raise ProblemError(422, str(exc), title="Invalid dependencies", errors=refused) from None
    except InvalidParams as exc:
        errors = [
            FieldError(
                field=f"params.{e['field']}" if e["field"] else "params", message=e["message"]
            )
            for e in exc.errors
        ]
        raise ProblemError(
            422, str(exc), title="Invalid params", errors=[e.model_dump() for e in errors]
        ) from None
    job_id = admission.job_id
    status_url = f"/v1/jobs/{job_id}"
    response.headers["Location"] = status_url
    return Accepted(job_id=job_id, status_url=status_url)
