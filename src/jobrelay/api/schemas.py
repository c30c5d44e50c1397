"""The JSON the API speaks: camelCase on the wire, snake_case in Python, strict on input.

Input models forbid unknown fields: a typo such as ``"acountId"`` must be a 422, not a
silently different job. Output models are built from store records here, in one place, so
the wire names of ARCHITECTURE.md's contract are spelled exactly once.
"""

from __future__ import annotations

import re
import uuid
from datetime import datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic.alias_generators import to_camel

from jobrelay.domain.effects import MAX_ADDRESS_LENGTH, check_address
from jobrelay.storage.store import EventRecord, JobRecord

ACCOUNT_PATTERN = r"^[a-z0-9][a-z0-9_-]{0,63}$"
PERIOD_PATTERN = r"^[0-9]{4}-[0-9]{2}$"
# RFC 9110 visible ASCII (VCHAR): no spaces, no control characters, no non-ASCII.
IDEMPOTENCY_KEY_PATTERN = r"^[\x21-\x7e]{1,255}$"
FIRST_PERIOD, LAST_PERIOD = (1900, 1), (2999, 12)

_TRACEPARENT = re.compile(r"^([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?$")


class WireModel(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, validate_by_name=True, frozen=True)


class ExportRequest(WireModel):
    # Only the camelCase wire names are accepted: "account_id" is an unknown field here.
    model_config = ConfigDict(extra="forbid", validate_by_name=False)

    account_id: str = Field(
        pattern=ACCOUNT_PATTERN,
        description="Lowercase letters, digits, '_' and '-'; 1-64 characters.",
        examples=["acme"],
    )
    period: str = Field(
        pattern=PERIOD_PATTERN,
        description="A calendar month, YYYY-MM, from 1900-01 to 2999-12.",
        examples=["2020-05"],
    )
    notify_email: str | None = Field(
        default=None,
        max_length=MAX_ADDRESS_LENGTH,
        description=(
            "Optional. One plain address (name@example.com, at most 254 characters, no display "
            "name, no list) that gets one e-mail with a link to the result once the export "
            "has succeeded. Part of the request's identity: it changes the jobId."
        ),
        examples=["ops@example.com"],
    )

    @field_validator("notify_email")
    @classmethod
    def _single_address(cls, value: str | None) -> str | None:
        return None if value is None else check_address(value)

    @field_validator("period")
    @classmethod
    def _real_month(cls, value: str) -> str:
        year, month = int(value[:4]), int(value[5:])
        if not 1 <= month <= 12:
            raise ValueError("month must be 01-12")
        if not FIRST_PERIOD <= (year, month) <= LAST_PERIOD:
            raise ValueError("period must be between 1900-01 and 2999-12")
        return value

    def params(self) -> dict[str, Any]:
        """The job's stored parameters: the wire fields given, in wire spelling.

        ``notifyEmail`` is stored only when given, so a request without it keeps the jobId
        it always had.
        """
        params = {"accountId": self.account_id, "period": self.period}
        if self.notify_email is not None:
            params["notifyEmail"] = self.notify_email
        return params


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
    account_id: str
    params: dict[str, Any]
    state: str
    published: bool = Field(description="Whether the job's latest message reached the broker.")
    attempt: int
    max_attempts: int
    result_key: str | None
    last_error: str | None
    next_attempt_at: datetime | None
    progress: Progress | None
    created_at: datetime
    updated_at: datetime

    @classmethod
    def from_record(cls, job: JobRecord) -> JobOut:
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
            last_error=job.last_error,
            next_attempt_at=job.next_attempt_at,
            progress=progress,
            created_at=job.created_at,
            updated_at=job.updated_at,
        )


class EventOut(WireModel):
    at: datetime
    kind: str
    detail: dict[str, Any]

    @classmethod
    def from_record(cls, event: EventRecord) -> EventOut:
        return cls(at=event.at, kind=event.kind, detail=event.detail)


class EventsOut(WireModel):
    events: list[EventOut]


class Health(WireModel):
    status: str = "ok"


class Ready(WireModel):
    status: str = "ready"
    database: str = "ok"
    broker: str = "ok"


def canonical_job_id(raw: str) -> str | None:
    """The canonical spelling of a path's jobId, or None unless it is a hyphenated UUID.

    ``uuid.UUID`` also takes braces, ``urn:uuid:`` and bare hex; only the one form we hand
    out is accepted (in either case), so each job has exactly one URL.
    """
    try:
        canonical = str(uuid.UUID(raw))
    except ValueError:
        return None
    return canonical if canonical == raw.lower() else None


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
