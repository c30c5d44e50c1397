"""Reading jobs back: the ``/v1/jobs/{jobId}`` half of the HTTP contract.

Jobs are accepted by ``POST /v1/jobs`` (jobs.py) or by an application's own routes
(``App.http_router``, e.g. the export app's ``POST /v1/exports``). Reads answer 404 both for
a missing job and for another account's job, with the same body, so ids cannot be probed
across accounts. A job that retention deleted answers 410 (``job-pruned``) instead, to
whoever could have read it, for one more retention period (``storage/retention.py``). A
result is downloadable only for a type whose definition names its file
(``@app.job(..., result_filename=...)``).
"""

from __future__ import annotations

import logging
import re
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import APIRouter, Header, Path, Query, Request, Response
from fastapi.responses import RedirectResponse, StreamingResponse

from jobrelay.api.auth import Principal, PrincipalDep
from jobrelay.api.deps import RuntimeDep
from jobrelay.api.event_stream import (
    KEEPALIVE_SECONDS,
    MEDIA_TYPE,
    last_event_id,
    stream_events,
    wants_stream,
)
from jobrelay.api.problems import (
    JOB_PRUNED,
    NOT_FINISHED,
    RESULT_GONE,
    UNAVAILABLE,
    NotFinishedProblem,
    ProblemError,
    ValidationProblem,
    problem_openapi,
)
from jobrelay.api.schemas import (
    EventOut,
    EventsOut,
    JobOut,
    canonical_job_id,
)
from jobrelay.domain.states import JobState
from jobrelay.errors import TransientError
from jobrelay.library.waiting import Watcher
from jobrelay.runtime.wiring import Runtime
from jobrelay.storage.retention import Retention
from jobrelay.storage.store import JobRecord

log = logging.getLogger("jobrelay.api")

# An export request is two short strings; anything near this size is not one.
_NOT_FOUND = "no job with this id is visible to this token"
_UNSAFE_FILENAME = re.compile(r"[^A-Za-z0-9._-]")
# Lifetime of a presigned result URL: long enough to follow a redirect and start a download
# (S3 checks expiry when a GET starts, not while it streams), short enough that a leaked URL
# is soon worthless. The ceiling is 15 minutes.
RESULT_URL_SECONDS = 300
# ``GET /v1/jobs/{jobId}?wait=``: the longest a request may wait for its job to end.
MAX_WAIT_SECONDS = 60.0

router = APIRouter()

_AUTH_RESPONSES: dict[int | str, dict[str, Any]] = {
    401: problem_openapi("No token, or not a valid one."),
    503: problem_openapi("The database is unavailable; nothing was changed."),
}
PRUNED_RESPONSE = problem_openapi(
    "The job finished and was deleted by retention (JOBRELAY_RETENTION_DAYS); `prunedAt` says when."
)
_JOB_RESPONSES: dict[int | str, dict[str, Any]] = {
    **_AUTH_RESPONSES,
    404: problem_openapi("No such job, or it belongs to another account (not distinguished)."),
    410: PRUNED_RESPONSE,
}

JobIdPath = Annotated[str, Path(alias="jobId", description="The jobId returned by the 202.")]


class CsvResponse(StreamingResponse):
    media_type = "text/csv"


@router.get(
    "/v1/jobs/{jobId}",
    response_model=JobOut,
    summary="A job's state",
    responses={
        **_JOB_RESPONSES,
        422: problem_openapi(
            f"`wait` is not a number of seconds from 0 to {MAX_WAIT_SECONDS:g}.",
            ValidationProblem,
        ),
    },
)
async def get_job(
    job_id: JobIdPath,
    principal: PrincipalDep,
    runtime: RuntimeDep,
    request: Request,
    wait: Annotated[
        float | None,
        Query(
            ge=0,
            le=MAX_WAIT_SECONDS,
            description="Answer once the job has ended (succeeded, quarantined, cancelled) or "
            f"after this many seconds (at most {MAX_WAIT_SECONDS:g}), with its state then. "
            "Woken by the commit that ends the job, not by polling.",
        ),
    ] = None,
) -> JobOut:
    job = await _visible_job(runtime, principal, job_id)
    if wait and not job.state.is_terminal:
        try:
            await _watcher(request, runtime).wait(job.id, wait)
        except TimeoutError:
            pass
        except Exception as exc:  # the watcher could not listen or read: answer as without
            log.warning(
                "wait for job %s cut short: %s", job.id, exc, extra={"event": "wait_failed"}
            )
        job = await _visible_job(runtime, principal, job_id)
    return JobOut.from_record(job, admin=principal.is_admin)


def _watcher(request: Request, runtime: Runtime) -> Watcher:
    """The API's one watcher of the jobs its requests wait on (``library.waiting``), kept
    with the API it serves: it listens only while a request waits."""
    watcher: Watcher | None = getattr(request.app.state, "job_watcher", None)
    if watcher is None:
        watcher = request.app.state.job_watcher = Watcher(runtime.engine)
    return watcher


@router.get(
    "/v1/jobs/{jobId}/events",
    response_model=EventsOut,
    summary="Everything that happened to a job, oldest first",
    description=(
        "With `Accept: text/event-stream`, a live stream of server-sent events: every event so"
        " far, then each new one as it commits (the same events, order and redaction), each"
        " with its `id`; `Last-Event-ID` resumes after it. The stream ends with an `end` event"
        f" once the job has ended; an idle stream sends a comment every {KEEPALIVE_SECONDS:g} s."
    ),
    responses={
        **_JOB_RESPONSES,
        200: {
            "description": "The timeline (JSON), or a stream of server-sent events.",
            "content": {MEDIA_TYPE: {"schema": {"type": "string"}}},
        },
    },
)
async def get_events(
    job_id: JobIdPath,
    principal: PrincipalDep,
    runtime: RuntimeDep,
    accept: Annotated[str | None, Header(include_in_schema=False)] = None,
    last_event: Annotated[
        str | None,
        Header(alias="Last-Event-ID", description="Resume a stream after this event's id."),
    ] = None,
) -> Any:
    job = await _visible_job(runtime, principal, job_id)
    if wants_stream(accept):
        frames = stream_events(
            runtime, job.id, admin=principal.is_admin, after=last_event_id(last_event)
        )
        return StreamingResponse(
            frames,
            media_type=MEDIA_TYPE,
            headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"},
        )
    events = await runtime.store.events(job.id)
    return EventsOut(events=[EventOut.from_record(e, admin=principal.is_admin) for e in events])


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
        410: problem_openapi(
            "The job succeeded but its result file is gone (`result-gone`), or the job itself "
            "was deleted by retention (`job-pruned`)."
        ),
        503: problem_openapi("The database or the result store (S3) is unavailable."),
    },
)
async def get_result(job_id: JobIdPath, principal: PrincipalDep, runtime: RuntimeDep) -> Response:
    # Tenancy first: no URL is ever signed for a job the caller may not see.
    job = await _visible_job(runtime, principal, job_id)
    filename = _filename(runtime, job)
    if filename is None:
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
        url = await runtime.results.presign(key, RESULT_URL_SECONDS, filename=filename)
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
        headers={"Content-Disposition": f'attachment; filename="{filename}"'},
    )


async def _visible_job(runtime: Runtime, principal: Principal, raw_id: str) -> JobRecord:
    job_id = canonical_job_id(raw_id)
    job = await runtime.store.get_job(job_id) if job_id is not None else None
    if job is not None and principal.may_act_for(job.account_id):
        return job
    # Another account's job and no job at all take the same path, the same two lookups (the
    # job, then its tombstone): answering the first without the second was measurably faster.
    raise await missing_job(runtime, principal, job_id)


async def missing_job(runtime: Runtime, principal: Principal, job_id: str | None) -> ProblemError:
    """What to answer for an id with no job row: 410 if retention deleted a job this
    principal could have read (its tombstone says so), else the usual 404."""
    if job_id is not None:
        stone = await Retention(runtime.store, runtime.results).pruned(job_id)
        if stone is not None and principal.may_act_for(stone.account_id):
            return ProblemError(
                410,
                "the job finished and was deleted by retention "
                f"(JOBRELAY_RETENTION_DAYS={runtime.settings.retention_days:g})",
                type_=JOB_PRUNED,
                title="Job pruned",
                prunedAt=stone.pruned_at.isoformat().replace("+00:00", "Z"),
            )
    return ProblemError(404, _NOT_FOUND)


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


def _filename(runtime: Runtime, job: JobRecord) -> str | None:
    definition = runtime.job_app().jobs.get(job.type)
    if definition is None or definition.result_filename is None:
        return None
    stem = definition.result_filename(job.id, job.params)
    return _UNSAFE_FILENAME.sub("_", stem)[:120] + ".csv"
