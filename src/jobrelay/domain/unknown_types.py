"""What a worker says of a message it does not know: defer it, or give up on it.

During a rolling deploy only the newer workers know a type or a version; a worker started
without ``--app`` knows none of the application's types. Each deferral carries its count in
a header; past the delivery limit the job is quarantined saying no worker knew it. Every
line names the worker, the type and the count: from the job's side, a worker that does not
know the type looks exactly like no worker at all, unless it says it saw the job. Pure: the
delivery handler does the I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# A deferred copy of a job whose type or version no worker here knows carries its count.
DEFERS_HEADER = "x-jobrelay-defers"


@dataclass(frozen=True)
class UnknownVerdict:
    """``quarantine`` set: give up with that reason; else defer with ``reason``, ``detail``
    (the ``deferred`` event's) and ``headers`` (the copy's, carrying the count)."""

    reason: str
    quarantine: bool
    detail: dict[str, Any] = field(default_factory=dict)
    headers: dict[str, str] = field(default_factory=dict)


def judge_unknown(
    worker_id: str,
    job_type: str,
    unknown_type: str | None,
    decode_reason: str,
    defers_header: object,
    limit: int,
) -> UnknownVerdict:
    """The next step for a message of ``job_type`` this worker could not decode."""
    if unknown_type is not None:
        subject = f"type {unknown_type}"
        remedy = (
            "start the workers with the app that defines it (`--app` or JOBRELAY_APP), "
            "then replay the job"
        )
    else:
        subject = f"this message ({decode_reason}) of type {job_type}"
        remedy = "run workers of a version that knows it, then replay the job"
    defers = str(defers_header if defers_header is not None else "0")
    count = int(defers) if defers.isdigit() else 0
    said = f"worker {worker_id} does not know {subject}"
    if count >= limit:
        return UnknownVerdict(
            f"{said}, and no worker knew it after {count} deferrals: {remedy}", quarantine=True
        )
    detail: dict[str, Any] = {"worker": worker_id, "deferral": count + 1, "of": limit}
    if unknown_type is not None:
        detail["unknownType"] = unknown_type
    return UnknownVerdict(
        f"{said} (deferral {count + 1} of {limit})",
        quarantine=False,
        detail=detail,
        headers={DEFERS_HEADER: str(count + 1)},
    )
