"""Bulk replay and cancel: every job matching a filter, in bounded batches (admin).

``POST /v1/bulk/replay`` and ``POST /v1/bulk/cancel`` take the jobs list's filter, a
required reason and a ``limit``; with ``dryRun`` they only count. Each call acts on at most
``limit`` matching jobs, each through the same ``Operator`` action as the single-job routes
(one guarded transaction per job, a ``replayed``/``cancelled`` event naming the admin token
and the reason), and answers how many it did, how many were refused because their state
changed meanwhile, and how many still match. A caller repeats the call until ``remaining``
is 0 (the console shows done/total while it does).

One operation is one set of jobs, fixed when it starts: every answer carries ``before``
(the highest job event id when the operation's first call ran), and a caller passes it back
on every later call of the same operation. Then only jobs that have not entered their state
since match: a job replayed by this operation that fails again at once is quarantined anew,
after ``before``, and is not replayed a second time (a re-run of the filter alone would
replay it once per round); a job that arrived meanwhile is not swept in. A call without
``before`` starts a new operation, so an interrupted run is run again by starting afresh.

The filter is kept to the action's legal source states (replay: ``quarantined``; cancel:
``waiting``, ``queued``, ``running``, ``retry_wait``, ``quarantined``): each body's schema
allows only those, so another state is a 422 like any other invalid body. A running job's
cancel is a request (``storage.cancels``): it counts as done, and the job no longer matches
(its worker ends it ``cancelled``).

A call the database fails part-way through has changed some jobs already (each job is its
own transaction): its 503 says so (``cutShort``), naming the jobs it changed, the one whose
outcome is unknown (its transaction may or may not have committed), and how many it did not
try; the same call with the same ``before`` finishes the operation.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from datetime import datetime
from typing import Any, Literal, TypeVar

from fastapi import APIRouter, Request
from pydantic import ConfigDict, Field, StrictBool, StrictInt, field_validator

from jobrelay.api.admin import AdminActor, _Reasoned, body_of
from jobrelay.api.bodies import MAX_BODY_BYTES, parse_body, read_body
from jobrelay.api.deps import RuntimeDep
from jobrelay.api.job_search import LIST_RESPONSES, job_filter, text_problem, time_problem
from jobrelay.api.problems import UNAVAILABLE, ProblemError, ValidationProblem, problem_openapi
from jobrelay.api.schemas import ACCOUNT_PATTERN, WireModel
from jobrelay.domain.job_filter import JobFilter
from jobrelay.domain.states import JobState
from jobrelay.errors import StoreError
from jobrelay.library.operator import CANCELLABLE, REPLAYABLE, Operator
from jobrelay.runtime.wiring import Runtime
from jobrelay.storage.dashboard import count_jobs, event_ceiling, search_jobs

# A running job's cancel is recorded and carried out by its worker (``Operator.cancel``).
BULK_CANCELLABLE = CANCELLABLE | {JobState.RUNNING}

router = APIRouter()
log = logging.getLogger("jobrelay.api")
V = TypeVar("V")

_RESPONSES: dict[int | str, dict[str, Any]] = {
    **LIST_RESPONSES,
    403: problem_openapi("Not an admin token."),
    413: problem_openapi(f"The body is larger than {MAX_BODY_BYTES} bytes."),
    422: problem_openapi(
        "Invalid body: no reason, a bad filter, or a state this action cannot move.",
        ValidationProblem,
    ),
    503: problem_openapi(
        "The database is unavailable. Before any job was acted on: nothing was changed. "
        "Part-way through: `jobIds` were changed, `outcomeUnknown` may have been, "
        "`notAttempted` were not tried; call again with `before` to finish."
    ),
}


class _Filter(WireModel):
    model_config = ConfigDict(extra="forbid")

    type: str | None = Field(default=None, min_length=1, max_length=64)
    queue: str | None = Field(default=None, min_length=1, max_length=32)
    account_id: str | None = Field(default=None, pattern=ACCOUNT_PATTERN)
    reason: str | None = Field(default=None, max_length=500)
    # Strict: an ISO 8601 string only (lax mode would read a number as a Unix time).
    created_after: datetime | None = Field(default=None, strict=True)
    created_before: datetime | None = Field(default=None, strict=True)

    @field_validator("created_after", "created_before")
    @classmethod
    def _searchable_time(cls, value: datetime | None) -> datetime | None:
        return _refuse(time_problem(value), value)

    @field_validator("type", "queue", "reason")
    @classmethod
    def _searchable_text(cls, value: str | None) -> str | None:
        return _refuse(text_problem(value), value)


def _refuse(problem: str | None, value: V) -> V:
    """The filter's checks are the jobs list's (``job_search``), named as body fields here."""
    if problem is not None:
        raise ValueError(problem)
    return value


class ReplayFilter(_Filter):
    state: Literal["quarantined"] | None = None


class CancelFilter(_Filter):
    state: Literal["waiting", "queued", "running", "retry_wait", "quarantined"] | None = None


class _Bulk(_Reasoned):
    reason: str = Field(min_length=1, max_length=500, description="Kept in every job's timeline.")
    dry_run: StrictBool = Field(default=False, description="Only count what matches.")
    limit: int = Field(default=100, ge=1, le=500, description="At most this many per call.")
    before: StrictInt | None = Field(
        default=None,
        ge=0,
        le=2**63 - 1,
        description="The `before` of this operation's first answer, on every later call: only "
        "jobs that have not entered their state since match. Omit it to start an operation.",
    )

    @field_validator("limit", mode="before")
    @classmethod
    def _json_integer(cls, value: object) -> object:
        """A JSON integer (``82.0`` is one too), not a string or a boolean."""
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError("must be an integer")
        return value


class BulkReplayRequest(_Bulk):
    filter: ReplayFilter = Field(default_factory=ReplayFilter)


class BulkCancelRequest(_Bulk):
    filter: CancelFilter = Field(default_factory=CancelFilter)


class BulkOut(WireModel):
    action: str
    dry_run: bool
    matched: int = Field(description="Jobs matching before this call.")
    done: int
    refused: int = Field(description="Matched, but their state changed before the action.")
    remaining: int = Field(description="Jobs still matching after this call.")
    job_ids: list[str] = Field(description="The jobs this call acted on.")
    actor: str
    before: int = Field(
        description="This operation's bound (the highest job event id when it started): pass "
        "it on the operation's next call."
    )


@router.post(
    "/v1/bulk/replay",
    response_model=BulkOut,
    summary="Replay the quarantined jobs matching a filter, a batch at a time (admin)",
    responses=_RESPONSES,
    openapi_extra=body_of(BulkReplayRequest, required=True),
)
async def bulk_replay(request: Request, runtime: RuntimeDep, actor: AdminActor) -> BulkOut:
    body = parse_body(BulkReplayRequest, await read_body(request))
    return await _run(runtime, "replay", body, actor)


@router.post(
    "/v1/bulk/cancel",
    response_model=BulkOut,
    summary="Cancel the jobs matching a filter that have not finished (admin)",
    responses=_RESPONSES,
    openapi_extra=body_of(BulkCancelRequest, required=True),
)
async def bulk_cancel(request: Request, runtime: RuntimeDep, actor: AdminActor) -> BulkOut:
    body = parse_body(BulkCancelRequest, await read_body(request))
    return await _run(runtime, "cancel", body, actor)


def _filter(action: str, body: BulkReplayRequest | BulkCancelRequest) -> JobFilter:
    f = body.filter
    state = None if f.state is None else JobState(f.state)
    base = job_filter(
        state, f.type, f.queue, f.account_id, f.reason, f.created_after, f.created_before
    )
    if action == "replay":
        return base.only(REPLAYABLE)
    return replace(base.only(BULK_CANCELLABLE), uncancelled=True)


async def _run(
    runtime: Runtime, action: str, body: BulkReplayRequest | BulkCancelRequest, actor: str
) -> BulkOut:
    store = runtime.store
    before = body.before if body.before is not None else await event_ceiling(store)
    f = _filter(action, body).until(before)
    matched = await count_jobs(store, f)
    done: list[str] = []
    refused = 0
    if not body.dry_run and matched:
        operator = Operator(runtime)
        batch = await search_jobs(store, f, limit=body.limit)
        for index, job in enumerate(batch):
            try:
                if action == "replay":
                    outcome = await operator.replay(job.id, actor=actor, reason=body.reason)
                else:
                    outcome = await operator.cancel(job.id, actor=actor, reason=body.reason)
            except StoreError as exc:
                left = len(batch) - index - 1
                raise _cut_short(action, done, [job.id], left, before, exc) from None
            if outcome.done:
                done.append(job.id)
            else:
                refused += 1
    try:
        remaining = matched if body.dry_run else await count_jobs(store, f)
    except StoreError as exc:
        if not done:
            raise  # nothing was changed: the usual 503 says so
        raise _cut_short(action, done, [], 0, before, exc) from None
    return BulkOut(
        action=action,
        dry_run=body.dry_run,
        matched=matched,
        done=len(done),
        refused=refused,
        remaining=remaining,
        job_ids=done,
        actor=actor,
        before=before,
    )


def _cut_short(
    action: str, done: list[str], unknown: list[str], left: int, before: int, exc: StoreError
) -> ProblemError:
    """The 503 of a call the database failed part-way: what it did, what it may have done,
    what it did not try (the generic 503's "nothing was changed" would be false)."""
    log.warning(
        "database unavailable during a bulk %s",
        action,
        extra={
            "event": "api_dependency_unavailable",
            "dependency": "database",
            "reason": str(exc),
            "done": len(done),
        },
    )
    past = "cancelled" if action == "cancel" else "replayed"
    parts = [f"{len(done)} job{' was' if len(done) == 1 else 's were'} {past} (jobIds)"]
    if unknown:
        parts.append(f"job {unknown[0]} may or may not have been (outcomeUnknown)")
    if left:
        parts.append(f"{left} more were not tried (notAttempted)")
    return ProblemError(
        503,
        f"the database became unavailable part-way through this bulk {action}: "
        + "; ".join(parts)
        + "; call again with the same before to finish the operation",
        type_=UNAVAILABLE,
        headers={"Retry-After": "5"},
        cutShort=True,
        jobIds=done,
        outcomeUnknown=unknown,
        notAttempted=left,
        before=before,
    )
