"""The JSON the API speaks: camelCase on the wire, snake_case in Python, strict on input.

Input models forbid unknown fields: a typo such as ``"acountId"`` must be a 422, not a
silently different job. Output models are built from store records here, in one place, so
the wire names of ARCHITECTURE.md's contract are spelled exactly once.
"""

from __future__ import annotations

import re
from datetime import datetime
from typing import Annotated, Any

from fastapi import Header
from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

from jobrelay.domain.disclosure import account_detail, account_error

# Re-exported: the routes read path ids with it; the CLI takes the same forms (domain.ids).
from jobrelay.domain.ids import canonical_job_id as canonical_job_id
from jobrelay.domain.states import JobState
from jobrelay.observe.scrub import scrub_text
from jobrelay.storage.store import EventRecord, JobRecord

# An account id (tokens act for one): lowercase letters, digits, '_' and '-'; 1-64 characters.
ACCOUNT_PATTERN = r"^[a-z0-9][a-z0-9_-]{0,63}$"
# RFC 9110 visible ASCII (VCHAR): no spaces, no control characters, no non-ASCII.
IDEMPOTENCY_KEY_PATTERN = r"^[\x21-\x7e]{1,255}$"
# The header every accepting route reads (POST /v1/exports, POST /v1/jobs, an app's own).
IdempotencyKey = Annotated[
    str | None,
    Header(
        alias="Idempotency-Key",
        pattern=IDEMPOTENCY_KEY_PATTERN,
        description="1-255 visible ASCII characters. Keys the job instead of the body.",
    ),
]

_TRACEPARENT = re.compile(r"^([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?$")


class WireModel(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, validate_by_name=True, frozen=True)


class Accepted(WireModel):
    accepted: bool = True
    job_id: str
    status_url: str


class Progress(WireModel):
    done: int
    total: int


class JobOut(WireModel):
    job_id: str
    type: str
    # None: enqueued on no account's behalf (a schedule's tick); only admins see such jobs.
    account_id: str | None
    params: dict[str, Any]
    state: str
    published: bool = Field(description="Whether the job's latest message reached the broker.")
    attempt: int
    max_attempts: int
    result_key: str | None
    result: Any = Field(
        default=None,
        description="The JSON value the job returned, committed with `succeeded` (null: none).",
    )
    last_error: str | None
    next_attempt_at: datetime | None
    run_at: datetime | None = Field(
        default=None,
        description="A delayed job's run time: not published, so not run, before it. Kept as "
        "history after it ran.",
    )
    progress: Progress | None
    waiting_for: int | None = Field(
        default=None,
        description="A `waiting` job's count of the jobs it runs after (`after`) that have not"
        " ended yet; null for a job in any other state.",
    )
    created_at: datetime
    updated_at: datetime

    @classmethod
    def from_record(cls, job: JobRecord, *, admin: bool = True) -> JobOut:
        """``admin=False`` is an account token's view: ``lastError`` is the job's public
        error (a code and a message written for customers), never the raw text
        (``domain.disclosure``)."""
        progress = None
        if job.progress_done is not None and job.progress_total is not None:
            progress = Progress(done=job.progress_done, total=job.progress_total)
        return cls(
            job_id=job.id,
            type=job.type,
            account_id=job.account_id,
            params=job.params,
            state=job.state.value,
            published=job.published,
            attempt=job.attempt,
            max_attempts=job.max_attempts,
            result_key=job.result_key,
            result=job.result,
            last_error=scrub_text(job.last_error)
            if admin
            else account_error(job.last_error, job.public_error),
            next_attempt_at=job.next_attempt_at,
            run_at=job.run_at,
            progress=progress,
            waiting_for=job.waiting_for if job.state is JobState.WAITING else None,
            created_at=job.created_at,
            updated_at=job.updated_at,
        )


class EventOut(WireModel):
    at: datetime
    kind: str
    detail: dict[str, Any]

    @classmethod
    def from_record(cls, event: EventRecord, *, admin: bool = True) -> EventOut:
        """``admin=False``: only the detail an account may see (``domain.disclosure``)."""
        detail = event.detail if admin else account_detail(event.kind, event.detail)
        return cls(at=event.at, kind=event.kind, detail=detail)


class EventsOut(WireModel):
    events: list[EventOut]


class Health(WireModel):
    status: str = "ok"


class Ready(WireModel):
    status: str = "ready"
    database: str = "ok"
    broker: str = "ok"


def valid_traceparent(raw: str | None) -> str | None:
    """A W3C Trace Context ``traceparent`` in version-00 form, or None when absent or invalid.

    Invalid values are dropped rather than rejected: tracing is advisory and must never make
    an otherwise good request fail.
    """
    if raw is None:
        return None
    match = _TRACEPARENT.match(raw.strip())
    if match is None:
        return None
    version, trace_id, parent_id, flags, rest = match.groups()
    if version == "ff" or (version == "00" and rest is not None):
        return None
    if trace_id == "0" * 32 or parent_id == "0" * 16:
        return None
    return f"00-{trace_id}-{parent_id}-{flags}"
