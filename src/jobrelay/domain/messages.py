"""The wire message: ``{"jobId", "type", "version"}`` and nothing else.

The message carries only identity; the job row is the truth about parameters and state, so
a stale or duplicated message can never smuggle old parameters into a new attempt. Decoding
is strict: anything else is a reason to quarantine, never a guess.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping
from dataclasses import dataclass

SUPPORTED_VERSIONS = frozenset({1})
CURRENT_VERSION = 1
# The relay names the outbox row each message was sent from, so that what a delivery writes
# can say which message it came from (the timeline orders it after that row's ``published``).
OUTBOX_ID_HEADER = "x-jobrelay-outbox-id"


def outbox_id_of(headers: Mapping[str, object]) -> int | None:
    """The outbox row a delivered message was sent from; None when it does not say."""
    value = headers.get(OUTBOX_ID_HEADER)
    if isinstance(value, int) and not isinstance(value, bool):
        return value if value >= 0 else None
    if isinstance(value, bytes):
        value = value.decode("ascii", "replace")
    if isinstance(value, str) and value.isascii() and value.isdigit():
        return int(value)
    return None


@dataclass(frozen=True)
class JobMessage:
    job_id: str
    type: str
    version: int = CURRENT_VERSION

    def encode(self) -> bytes:
        return json.dumps(
            {"jobId": self.job_id, "type": self.type, "version": self.version},
            separators=(",", ":"),
        ).encode()


class MessageDecodeError(ValueError):
    """The body is not a valid jobrelay message. ``job_id`` is set when it could be read.

    ``unknown`` marks a well-formed message whose type or version this worker does not know:
    during a rolling deploy a newer worker may know it, so it is deferred, not quarantined.
    ``unknown_type`` is that type when it is the type the worker does not know.
    """

    def __init__(
        self,
        reason: str,
        job_id: str | None = None,
        *,
        unknown: bool = False,
        unknown_type: str | None = None,
    ) -> None:
        super().__init__(reason)
        self.reason = reason
        self.job_id = job_id
        self.unknown = unknown
        self.unknown_type = unknown_type


def decode(body: bytes, known_types: frozenset[str]) -> JobMessage:
    """Parse and validate a body, or raise MessageDecodeError with the reason to record."""
    try:
        data = json.loads(body)
    except (ValueError, RecursionError) as exc:
        # ValueError: not UTF-8, not JSON, or an integer longer than Python converts (4300
        # digits); RecursionError: nested deeper than the parser recurses. Any body a broker
        # hands over must end as a reason to quarantine, never as a crash on each delivery.
        raise MessageDecodeError(f"malformed JSON: {_first_line(exc)}") from None
    if not isinstance(data, dict):
        raise MessageDecodeError("message is not a JSON object")
    job_id = data.get("jobId")
    readable_id = job_id if isinstance(job_id, str) and _is_uuid(job_id) else None
    extra = set(data) - {"jobId", "type", "version"}
    if extra:
        raise MessageDecodeError(f"unexpected fields: {sorted(extra)}", readable_id)
    if readable_id is None:
        raise MessageDecodeError("jobId missing or not a UUID")
    job_type = data.get("type")
    if not isinstance(job_type, str) or not job_type:
        raise MessageDecodeError(f"type missing or not a string: {job_type!r}", readable_id)
    version = data.get("version")
    if isinstance(version, bool) or not isinstance(version, int):
        raise MessageDecodeError(f"version missing or not an integer: {version!r}", readable_id)
    if job_type not in known_types:
        raise MessageDecodeError(
            f"unknown job type: {job_type!r}", readable_id, unknown=True, unknown_type=job_type
        )
    if version not in SUPPORTED_VERSIONS:
        raise MessageDecodeError(
            f"unsupported message version: {version}", readable_id, unknown=True
        )
    return JobMessage(job_id=readable_id, type=job_type, version=version)


def dead_letter_reason(deliveries: int, limit: int) -> str:
    """What a job's timeline says when the delivery-limit backstop took its message."""
    return (
        f"delivery limit of {limit} reached: the message was delivered {deliveries} times "
        "without an outcome and went to the quarantine queue"
    )


def peek_job_id(body: bytes) -> str | None:
    """The job id a body names, if it names one, whatever else is wrong with it: for a
    timeline line about a delivery that could not be handled (never to decide anything)."""
    try:
        decode(body, frozenset())
    except MessageDecodeError as exc:
        return exc.job_id
    return None  # pragma: no cover: no type is known, so decode always raises


def _first_line(exc: BaseException) -> str:
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


def _is_uuid(value: str) -> bool:
    try:
        return str(uuid.UUID(value)) == value
    except ValueError:
        return False
