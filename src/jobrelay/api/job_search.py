"""``GET /v1/jobs``: find jobs by state, type, queue, account, reason text and time, a keyset
page at a time.

Admin tokens list every account's jobs. An account token lists too, but only its own
account's (the account filter is forced to it; asking for another account is a 403) and in
the account view: ``lastError`` and ``quarantineReason`` are the job's public error
(``domain.disclosure``), nothing of leases, workers or actors, and ``reason`` searches that
public error only. Every filter is validated (422 problem+json naming
the field); an unknown queue or type simply matches nothing.
"""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime
from typing import Annotated, Any

from fastapi import APIRouter, Query
from fastapi.exceptions import RequestValidationError

from jobrelay.api.auth import Principal
from jobrelay.api.deps import RuntimeDep
from jobrelay.api.problems import ProblemError, ValidationProblem, problem_openapi
from jobrelay.api.ratelimit import RATE_LIMIT_RESPONSES, RateLimitedDep
from jobrelay.api.schemas import ACCOUNT_PATTERN, JobOut, WireModel
from jobrelay.domain.disclosure import account_error
from jobrelay.domain.job_filter import CursorError, JobFilter, PageKey, decode_cursor
from jobrelay.domain.job_filter import encode_cursor as encode
from jobrelay.domain.states import JobState
from jobrelay.observe.scrub import scrub_text
from jobrelay.storage.dashboard import search_jobs
from jobrelay.storage.store import JobRecord

router = APIRouter()

# A page is cut at this many bytes of JSON whatever its ``limit``: 1,000 jobs of 16 KiB params
# made a 9.5 MB page, held in the server's memory and the client's (issue 34, item 13). The
# ``nextCursor`` of a cut page goes on after its last job.
MAX_PAGE_BYTES = 1024 * 1024
_PAGE_FRAME = len('{"jobs":[],"nextCursor":""}') + 200  # the envelope and a cursor, generously

LIST_RESPONSES: dict[int | str, dict[str, Any]] = {
    **RATE_LIMIT_RESPONSES,
    401: problem_openapi("No token, or not a valid one."),
    403: problem_openapi("An account token asked for another account's jobs."),
    422: problem_openapi(
        "A filter is invalid (the field is named in `errors`).", ValidationProblem
    ),
    503: problem_openapi("The database is unavailable."),
}


class JobSummary(JobOut):
    queue: str
    quarantine_reason: str | None = None

    @classmethod
    def from_job(cls, job: JobRecord, *, admin: bool = True) -> JobSummary:
        reason = (
            scrub_text(job.quarantine_reason)
            if admin
            else account_error(job.quarantine_reason, job.public_error)
        )
        return cls(
            **JobOut.from_record(job, admin=admin).model_dump(),
            queue=job.queue,
            quarantine_reason=reason,
        )


class JobsOut(WireModel):
    jobs: list[JobSummary]
    next_cursor: str | None = None


def invalid(field: str, message: str) -> RequestValidationError:
    """A 422 naming one query parameter, rendered like every other validation problem."""
    error = {"type": "value_error", "loc": ("query", field), "msg": message}
    return RequestValidationError([error])


def time_problem(value: datetime | None) -> str | None:
    """Why ``value`` cannot bound a search, or None. A time whose UTC instant falls outside
    years 1-9999 (``9999-12-31T23:59:59-23:59``) raised ``OverflowError`` deep in the store:
    a 500 any token could cause."""
    if value is None:
        return None
    if value.tzinfo is None:
        return "give a time zone (e.g. 2026-12-01T18:00:00Z)"
    try:
        value.astimezone(UTC)
    except OverflowError:
        return "out of range: the time in UTC must fall in the years 1 to 9999"
    return None


def text_problem(value: str | None) -> str | None:
    """Why a text filter is refused, or None. A NUL matched every job on SQLite (its
    ``instr`` stops there) and is an error on PostgreSQL."""
    return "must not contain a NUL character" if value and "\x00" in value else None


def aware(field: str, value: datetime | None) -> datetime | None:
    problem = time_problem(value)
    if problem is not None:
        raise invalid(field, problem)
    return value


def plain_text(field: str, value: str | None) -> str | None:
    problem = text_problem(value)
    if problem is not None:
        raise invalid(field, problem)
    return value


def visible_filter(principal: Principal, f: JobFilter) -> JobFilter:
    """``f`` as this token may ask it: an account token's account filter is its own."""
    if principal.is_admin:
        return f
    if f.account_id is not None and f.account_id != principal.account_id:
        raise ProblemError(403, "an account token lists only its own account's jobs")
    # Its reason search runs over what it can read, never over the operators' raw text.
    return replace(f, account_id=principal.account_id or "\x00", reason_public=True)


StateQ = Annotated[JobState | None, Query(description="Only jobs in this state.")]
TypeQ = Annotated[str | None, Query(alias="type", min_length=1, max_length=64)]
QueueQ = Annotated[str | None, Query(min_length=1, max_length=32)]
AccountQ = Annotated[str | None, Query(alias="accountId", pattern=ACCOUNT_PATTERN)]
ReasonQ = Annotated[
    str | None,
    Query(
        max_length=500,
        description=(
            "Part of the quarantine reason or last error (any case); for an account token, "
            "part of the error as it reads it (`lastError`)."
        ),
    ),
]
AfterQ = Annotated[
    datetime | None,
    Query(alias="createdAfter", description="Created at or after this time (with a zone)."),
]
BeforeQ = Annotated[
    datetime | None,
    Query(alias="createdBefore", description="Created before this time (with a zone)."),
]


def job_filter(
    state: JobState | None,
    job_type: str | None,
    queue: str | None,
    account_id: str | None,
    reason: str | None,
    created_after: datetime | None,
    created_before: datetime | None,
) -> JobFilter:
    # An empty range (after >= before) is not an error: like an unknown queue, it matches
    # nothing.
    after = aware("createdAfter", created_after)
    before = aware("createdBefore", created_before)
    return JobFilter(
        states=None if state is None else (state,),
        job_type=plain_text("type", job_type),
        queue=plain_text("queue", queue),
        account_id=account_id,
        reason=plain_text("reason", reason) or None,
        created_after=after,
        created_before=before,
    )


@router.get(
    "/v1/jobs",
    response_model=JobsOut,
    summary="List jobs, newest first (admin: all; account token: its own)",
    responses=LIST_RESPONSES,
)
async def list_jobs(
    runtime: RuntimeDep,
    principal: RateLimitedDep,
    state: StateQ = None,
    reason: ReasonQ = None,
    job_type: TypeQ = None,
    queue: QueueQ = None,
    account_id: AccountQ = None,
    created_after: AfterQ = None,
    created_before: BeforeQ = None,
    cursor: Annotated[
        str | None,
        Query(max_length=200, description="`nextCursor` of the previous page."),
    ] = None,
    limit: Annotated[
        int,
        Query(ge=1, le=1000, description="At most this many jobs; fewer past 1 MiB of JSON."),
    ] = 100,
) -> JobsOut:
    f = job_filter(state, job_type, queue, account_id, reason, created_after, created_before)
    f = visible_filter(principal, f)
    after: PageKey | None = None
    if cursor:
        try:
            after = decode_cursor(cursor)
        except CursorError as exc:
            raise invalid("cursor", str(exc)) from None
    page = await search_jobs(runtime.store, f, limit=limit + 1, after=after)
    more = len(page) > limit
    page = page[:limit]
    summaries: list[JobSummary] = []
    size = _PAGE_FRAME
    for job in page:
        summary = JobSummary.from_job(job, admin=principal.is_admin)
        size += len(summary.model_dump_json(by_alias=True)) + 1
        if summaries and size > MAX_PAGE_BYTES:
            more = True  # cut here: the cursor goes on after the last job kept
            break
        summaries.append(summary)
    last = page[len(summaries) - 1] if summaries else None
    next_cursor = encode(PageKey(last.created_at, last.id)) if more and last else None
    return JobsOut(jobs=summaries, next_cursor=next_cursor)
