"""What an application's own HTTP routes use (``app.http_router(router)``).

An application router is a FastAPI ``APIRouter`` served by ``jobrelay api``/``up`` next to
the core's ``/v1/jobs`` routes. Its handlers get the caller (``CallerDep``, from the bearer
token, 401 without one), accept jobs with ``AcceptDep`` (the job, its outbox row and its
``accepted`` event in one transaction, committed before the handler answers), and fail with
``ProblemError`` (``application/problem+json``, RFC 9457), like every core route::

    router = APIRouter()

    @router.post("/v1/thumbnails", status_code=202, response_model=Accepted)
    async def thumbnails(request: Request, caller: CallerDep, accept: AcceptDep) -> Accepted:
        body = parse_body(Thumbnail, await read_body(request))
        accepted = await accept(resize, body, account=caller.account_id)
        return Accepted(job_id=accepted.job_id, status_url=f"/v1/jobs/{accepted.job_id}")

    app.http_router(router)
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Annotated, Any, TypeVar

from fastapi import Depends, Header
from pydantic import BaseModel

from jobrelay.api.auth import Principal as Caller
from jobrelay.api.auth import PrincipalDep as CallerDep
from jobrelay.api.bodies import MAX_BODY_BYTES, parse_body, read_body
from jobrelay.api.deps import RuntimeDep
from jobrelay.api.problems import (
    IDEMPOTENCY_CONFLICT,
    FieldError,
    ProblemError,
    ValidationProblem,
    problem_openapi,
)
from jobrelay.api.quota import QUOTA_RESPONSES, within_quota
from jobrelay.api.ratelimit import RATE_LIMIT_RESPONSES, RateLimitedDep
from jobrelay.api.schemas import (
    IDEMPOTENCY_KEY_PATTERN,
    Accepted,
    IdempotencyKey,
    WireModel,
    valid_traceparent,
)
from jobrelay.domain import delays
from jobrelay.domain.delays import RunTime
from jobrelay.domain.ids import job_id_for
from jobrelay.domain.states import JobState
from jobrelay.errors import ConfigError, IdempotencyConflict
from jobrelay.library.job_definition import JobDefinition
from jobrelay.observe.metrics import NEW as _NEW_JOB
from jobrelay.runtime.wiring import Runtime

__all__ = [
    "ACCEPT_RESPONSES",
    "AUTH_RESPONSES",
    "IDEMPOTENCY_CONFLICT",
    "IDEMPOTENCY_KEY_PATTERN",
    "MAX_BODY_BYTES",
    "AcceptDep",
    "Accepted",
    "Acceptor",
    "Admission",
    "Caller",
    "CallerDep",
    "FieldError",
    "IdempotencyKey",
    "ProblemError",
    "TraceParent",
    "ValidationProblem",
    "WireModel",
    "parse_body",
    "problem_openapi",
    "read_body",
    "valid_traceparent",
]

log = logging.getLogger("jobrelay.api")
M = TypeVar("M", bound=BaseModel)

AUTH_RESPONSES: dict[int | str, dict[str, Any]] = {
    401: problem_openapi("No token, or not a valid one."),
    503: problem_openapi("The database is unavailable; nothing was changed."),
}
# What a route that accepts jobs (AcceptDep) may answer besides its own errors.
ACCEPT_RESPONSES: dict[int | str, dict[str, Any]] = {
    **AUTH_RESPONSES,
    **RATE_LIMIT_RESPONSES,
    **QUOTA_RESPONSES,
}
TraceParent = Annotated[
    str | None,
    Header(description="W3C trace context; passed on to the job's message. Invalid is ignored."),
]


@dataclass(frozen=True)
class Admission:
    job_id: str
    created: bool  # False: the same request was accepted before, nothing was written


class Acceptor:
    """Accept a job of the serving app in a transaction of its own (``AcceptDep``)."""

    def __init__(self, runtime: Runtime) -> None:
        self._runtime = runtime

    async def __call__(
        self,
        definition: JobDefinition[Any],
        params: BaseModel | Mapping[str, Any],
        *,
        account: str | None,
        key: str | None = None,
        job_id: str | None = None,
        headers: Mapping[str, str] | None = None,
        by_request: bool = False,
    ) -> Admission:
        """Commit the job before returning. The same ``job_id`` (or ``key``) with the same
        parameters is the same job (``created=False``); with other parameters a 422
        ``ProblemError`` naming ``Idempotency-Key``; a new job of an ``account`` over its
        quota (``JOBRELAY_ACCOUNT_MAX_UNFINISHED_JOBS``) a 429. Fault point
        ``api.before_response`` is reached after the commit.

        ``by_request``: the id is the request's (what ``POST /v1/exports`` does), from the
        account and ``key`` when there is one, else from the account, the type and
        ``params`` as given, keyed with the installation's secret: the same request twice
        is the same job, and nobody without the secret can compute its id."""
        return await accept_job(
            self._runtime,
            definition,
            params,
            account=account,
            key=key,
            job_id=job_id,
            headers=headers,
            by_request=by_request,
        )


async def accept_job(
    rt: Runtime,
    definition: JobDefinition[Any],
    params: BaseModel | Mapping[str, Any],
    *,
    account: str | None,
    key: str | None = None,
    job_id: str | None = None,
    headers: Mapping[str, str] | None = None,
    by_request: bool = False,
    when: RunTime = delays.NOW,
    key_field: str = "Idempotency-Key",
    after: Sequence[str] = (),
    after_failure: str = "cancel",
) -> Admission:
    """The one way a request becomes a job, for ``Acceptor`` (the application routes) and
    ``POST /v1/jobs`` alike, so the two cannot drift apart: the id, the quota, the commit,
    the ``new -> queued`` count, the fault point and the log line. ``when``: the run time
    the request asked for (``domain.delays.resolve``); ``key_field``: the request's name
    for its key, which a conflict's 422 names. Bad ``params`` raise ``InvalidParams`` (the
    route names its fields), and ``after`` ids the account may not read
    ``InvalidDependencies``, before anything is written."""
    now = rt.clock()
    if by_request and job_id is not None:
        raise ConfigError("accept", "by_request derives the id: give no job_id")
    keys = None
    if by_request or (key is not None and job_id is None):
        keys = await rt.store.id_keys(now)
    previous = None
    if by_request:
        assert keys is not None
        given = params.model_dump(mode="json") if isinstance(params, BaseModel) else params
        job_id, previous = keys.derive(
            lambda s: job_id_for(s, account, definition.type, dict(given), key)
        )
    job = definition.new_job(
        params,
        key=key,
        account=account,
        job_id=job_id,
        headers=headers,
        max_attempts=definition.max_attempts_under(rt.settings),
        keys=keys,
        when=when,
        after=after,
        after_failure=after_failure,
    )
    if previous is not None:
        job = replace(job, previous_job_id=previous)
    await within_quota(rt, account, job.job_id)
    try:
        accepted_id, created = await rt.store.submit(job, now)
    except IdempotencyConflict as exc:
        raise ProblemError(
            422,
            str(exc),
            type_=IDEMPOTENCY_CONFLICT,
            title=f"{key_field[:1].upper()}{key_field[1:]} reused",
            errors=[FieldError(field=key_field, message=str(exc)).model_dump()],
        ) from None
    if created:
        first = JobState.WAITING if job.after else JobState.QUEUED
        rt.metrics.transition(_NEW_JOB, first.value)
    await rt.faults.ahit("api.before_response", params=job.params)
    log.info(
        "job accepted" if created else "job already accepted",
        extra={
            "event": "job_accepted",
            "jobId": accepted_id,
            "isNew": created,
            "type": definition.type,
            "attempt": 0 if created else None,  # a repeat: the job may be further along
        },
    )
    return Admission(accepted_id, created)


async def _acceptor(runtime: RuntimeDep, _caller: RateLimitedDep) -> Acceptor:
    """An acceptor for a caller within its rate limit (``JOBRELAY_RATE_LIMIT``): every
    route that accepts jobs is limited per token, before it reads its body. Async though it
    awaits nothing: FastAPI runs a plain ``def`` dependency in its thread pool, a thread hop
    on every accept."""
    return Acceptor(runtime)


AcceptDep = Annotated[Acceptor, Depends(_acceptor)]
