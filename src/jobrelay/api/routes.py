"""Accepting exports and reading jobs back: the ``/v1`` half of the HTTP contract.

Accepting is one ``Store.submit`` call, which writes the job, its outbox row and its
``accepted`` event in ONE transaction; the 202 is sent only after that commit, so a client
that saw a jobId can always read it back. Reads answer 404 both for a missing job and for
another account's job, with the same body, so ids cannot be probed across accounts.
"""

from __future__ import annotations

import logging
import re
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import APIRouter, Header, Path, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import RedirectResponse, StreamingResponse
from pydantic import ValidationError

from jobrelay.api.auth import Principal, PrincipalDep
from jobrelay.api.deps import RuntimeDep
from jobrelay.api.problems import (
    IDEMPOTENCY_CONFLICT,
    NOT_FINISHED,
    RESULT_GONE,
    UNAVAILABLE,
    FieldError,
    NotFinishedProblem,
    ProblemError,
    ValidationProblem,
    problem_openapi,
)
from jobrelay.api.schemas import (
    IDEMPOTENCY_KEY_PATTERN,
    Accepted,
    EventOut,
    EventsOut,
    ExportRequest,
    JobOut,
    canonical_job_id,
    valid_traceparent,
)
from jobrelay.domain.ids import job_id_for, request_hash
from jobrelay.domain.states import JobState
from jobrelay.errors import IdempotencyConflict, TransientError
from jobrelay.exports.report_export import TYPE as EXPORT_TYPE
from jobrelay.observe.metrics import NEW as NEW_JOB
from jobrelay.roles.runtime import Runtime
from jobrelay.storage.store import JobRecord, NewJob

log = logging.getLogger("jobrelay.api")

# An export request is two short strings; anything near this size is not one.
MAX_BODY_BYTES = 16 * 1024
_NOT_FOUND = "no job with this id is visible to this token"
_UNSAFE_FILENAME = re.compile(r"[^A-Za-z0-9._-]")
# Lifetime of a presigned result URL: long enough to follow a redirect and start a download
# (S3 checks expiry when a GET starts, not while it streams), short enough that a leaked URL
# is soon worthless. The ceiling is 15 minutes.
RESULT_URL_SECONDS = 300

router = APIRouter()

_AUTH_RESPONSES: dict[int | str, dict[str, Any]] = {
    401: problem_openapi("No token, or not a valid one."),
    503: problem_openapi("The database is unavailable; nothing was changed."),
}
_JOB_RESPONSES: dict[int | str, dict[str, Any]] = {
    **_AUTH_RESPONSES,
    404: problem_openapi("No such job, or it belongs to another account (not distinguished)."),
}

IdempotencyKey = Annotated[
    str | None,
    Header(
        alias="Idempotency-Key",
        pattern=IDEMPOTENCY_KEY_PATTERN,
        description="1-255 visible ASCII characters. Keys the job instead of the body.",
    ),
]
TraceParent = Annotated[
    str | None,
    Header(description="W3C trace context; passed on to the job's message. Invalid is ignored."),
]
JobIdPath = Annotated[str, Path(alias="jobId", description="The jobId returned by the 202.")]


class CsvResponse(StreamingResponse):
    media_type = "text/csv"


@router.post(
    "/v1/exports",
    status_code=202,
    response_model=Accepted,
    summary="Accept a report.export job",
    responses={
        **_AUTH_RESPONSES,
        403: problem_openapi("The token may not act for this accountId."),
        413: problem_openapi(f"The body is larger than {MAX_BODY_BYTES} bytes."),
        422: problem_openapi(
            "Invalid body or header, or an Idempotency-Key reused with another body.",
            ValidationProblem,
        ),
    },
    # The body is parsed in the handler (after authentication), so it is declared here.
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": ExportRequest.model_json_schema()}},
        }
    },
)
async def create_export(
    request: Request,
    response: Response,
    principal: PrincipalDep,
    runtime: RuntimeDep,
    idempotency_key: IdempotencyKey = None,
    traceparent: TraceParent = None,
) -> Accepted:
    body = _parse_export(await read_body(request))
    if not principal.may_act_for(body.account_id):
        raise ProblemError(403, f"this token may not act for account {body.account_id!r}")
    params = body.params()
    trace = valid_traceparent(traceparent)
    job = NewJob(
        job_id=job_id_for(body.account_id, EXPORT_TYPE, params, idempotency_key),
        type=EXPORT_TYPE,
        account_id=body.account_id,
        params=params,
        request_hash=request_hash(body.account_id, EXPORT_TYPE, params),
        max_attempts=runtime.settings.max_attempts,
        idempotency_key=idempotency_key,
        headers={"traceparent": trace} if trace else None,
    )
    try:
        job_id, created = await runtime.store.submit(job, runtime.clock())
    except IdempotencyConflict as exc:
        raise ProblemError(
            422,
            str(exc),
            type_=IDEMPOTENCY_CONFLICT,
            title="Idempotency-Key reused",
            errors=[FieldError(field="Idempotency-Key", message=str(exc)).model_dump()],
        ) from None
    if created:
        runtime.metrics.transition(NEW_JOB, JobState.QUEUED.value)
    runtime.faults.hit("api.before_response", params=params)
    log.info(
        "job accepted" if created else "job already accepted",
        extra={
            "event": "job_accepted",
            "jobId": job_id,
            "isNew": created,
            "type": EXPORT_TYPE,
            "attempt": 0 if created else None,  # a repeat: the job may be further along
        },
    )
    status_url = f"/v1/jobs/{job_id}"
    response.headers["Location"] = status_url
    return Accepted(job_id=job_id, status_url=status_url)


@router.get(
    "/v1/jobs/{jobId}", response_model=JobOut, summary="A job's state", responses=_JOB_RESPONSES
)
async def get_job(job_id: JobIdPath, principal: PrincipalDep, runtime: RuntimeDep) -> JobOut:
    return JobOut.from_record(await _visible_job(runtime, principal, job_id))


@router.get(
    "/v1/jobs/{jobId}/events",
    response_model=EventsOut,
    summary="Everything that happened to a job, oldest first",
    responses=_JOB_RESPONSES,
)
async def get_events(job_id: JobIdPath, principal: PrincipalDep, runtime: RuntimeDep) -> EventsOut:
    job = await _visible_job(runtime, principal, job_id)
    events = await runtime.store.events(job.id)
    return EventsOut(events=[EventOut.from_record(e) for e in events])


@router.get(
    "/v1/jobs/{jobId}/result",
    response_class=CsvResponse,
    summary="The CSV of a succeeded job",
    responses={
        **_JOB_RESPONSES,
        200: {"description": "The export as CSV, streamed (results on file://)."},
        307: {
            "description": (
                "Results on s3://: a redirect to a presigned GET URL that expires after "
                f"{RESULT_URL_SECONDS} s. Sent only after the token was checked for this job."
            )
        },
        409: problem_openapi(
            "The job has not succeeded (the detail says its state).", NotFinishedProblem
        ),
        410: problem_openapi("The job succeeded but its result file is gone."),
        503: problem_openapi("The database or the result store (S3) is unavailable."),
    },
)
async def get_result(job_id: JobIdPath, principal: PrincipalDep, runtime: RuntimeDep) -> Response:
    # Tenancy first: no URL is ever signed for a job the caller may not see.
    job = await _visible_job(runtime, principal, job_id)
    if job.type != EXPORT_TYPE:
        raise ProblemError(404, f"a {job.type} job has no result to download")
    if job.state is not JobState.SUCCEEDED:
        raise ProblemError(
            409,
            f"the job is {job.state.value}; the result exists only once it has succeeded",
            type_=NOT_FINISHED,
            title="Job not finished",
            state=job.state.value,
        )
    key = job.result_key
    try:
        if key is None or not await runtime.results.exists(key):
            raise _result_gone(job)
        url = await runtime.results.presign(key, RESULT_URL_SECONDS, filename=_filename(job))
    except TransientError as exc:
        raise _results_unavailable(exc) from None
    if url is not None:
        # The URL is a bearer credential for a while: no cache may keep it.
        return RedirectResponse(url, status_code=307, headers={"Cache-Control": "no-store"})
    chunks = runtime.results.read(key)
    # Read the first chunk before answering, so a file removed since exists() is still a
    # clean 410 and not a stream that breaks after a 200 was sent.
    try:
        first = await anext(chunks, b"")
    except FileNotFoundError:
        raise _result_gone(job) from None
    return CsvResponse(
        _stream(first, chunks),
        headers={"Content-Disposition": f'attachment; filename="{_filename(job)}"'},
    )


async def read_body(request: Request) -> bytes:
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_BODY_BYTES:
            raise ProblemError(413, f"the request body is larger than {MAX_BODY_BYTES} bytes")
    return bytes(body)


def _parse_export(raw: bytes) -> ExportRequest:
    """Validate the body the way FastAPI would, so the 422 looks the same as any other."""
    try:
        return ExportRequest.model_validate_json(raw)
    except ValidationError as exc:
        errors = [
            {**error, "loc": ("body", *error["loc"])}
            for error in exc.errors(include_url=False, include_input=False)
        ]
        raise RequestValidationError(errors) from None


async def _visible_job(runtime: Runtime, principal: Principal, raw_id: str) -> JobRecord:
    job_id = canonical_job_id(raw_id)
    job = await runtime.store.get_job(job_id) if job_id is not None else None
    if job is None or not principal.may_act_for(job.account_id):
        raise ProblemError(404, _NOT_FOUND)
    return job


def _results_unavailable(exc: TransientError) -> ProblemError:
    # The reason goes to the log only: it can name endpoints and buckets.
    log.warning(
        "result store unavailable: %s",
        exc,
        extra={"event": "api_dependency_unavailable", "dependency": "results"},
    )
    return ProblemError(
        503,
        "the result store is unavailable; try again later",
        type_=UNAVAILABLE,
        headers={"Retry-After": "5"},
    )


def _result_gone(job: JobRecord) -> ProblemError:
    log.error(
        "result missing for a succeeded job",
        extra={"event": "result_missing", "jobId": job.id, "resultKey": job.result_key},
    )
    return ProblemError(
        410,
        "the job succeeded but its result file is no longer available; "
        "support can investigate with this jobId",
        type_=RESULT_GONE,
        title="Result gone",
    )


async def _stream(first: bytes, rest: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    try:
        if first:
            yield first
        async for chunk in rest:
            yield chunk
    finally:
        aclose = getattr(rest, "aclose", None)
        if aclose is not None:
            await aclose()


def _filename(job: JobRecord) -> str:
    account, period = job.params.get("accountId"), job.params.get("period")
    stem = (
        f"export-{account}-{period}"
        if isinstance(account, str) and isinstance(period, str)
        else f"export-{job.id}"
    )
    return _UNSAFE_FILENAME.sub("_", stem)[:120] + ".csv"
