"""What a failed attempt leaves for people: the operators' text, the account's, where it raised.

``record_release`` says why a delivery went back to the broker (a bug, a broker error).

``failure_texts`` is the reason, twice: the raw text operators read and the public error the
job's account reads (``domain.disclosure``).

``failure_traceback`` says where: an operator debugging a job's code needs that without the
worker's logs (which may be gone, or on a host they cannot read), so it is stored on the job
(``jobs.last_traceback``) and treated as any stored text an operator reads. The log
scrubber masks API tokens, bearer credentials and URL passwords (a traceback quotes
exception messages, which quote DSNs); NUL bytes and lone surrogates are escaped as the store
escapes all free text (``storable.safe_text``); and it is bounded to ``MAX_TRACEBACK_BYTES``
of UTF-8. When it is longer the END is kept: the innermost frames and the exception line are
what a reader needs, the outer frames are the worker's own and the same every time. Only
operators (admin tokens, the CLI) read it; account views never do (docs/security.md).
"""

from __future__ import annotations

import contextlib
import logging
import traceback
from typing import TYPE_CHECKING

from jobrelay.domain.disclosure import REFUSED, RETRY, TEMPORARY, UNEXPECTED, public_error
from jobrelay.domain.messages import dead_letter_reason, peek_job_id
from jobrelay.errors import OperationError, Permanent, PermanentError, Retry, StoreError
from jobrelay.observe.scrub import scrub
from jobrelay.storage.storable import safe_text

if TYPE_CHECKING:
    from jobrelay.runtime.wiring import Runtime
    from jobrelay.transport.base import Delivery

MAX_TRACEBACK_BYTES = 8 * 1024
_NEAR = 1024  # characters: how far the cut may move forward to a line start
CUT_MARKER = "[traceback cut: only its last 8 KiB are kept, the innermost frames]\n"

log = logging.getLogger("jobrelay.worker")


def failure_texts(exc: BaseException) -> tuple[str, str]:
    """``_failure_texts`` with the operators' text scrubbed (``observe.scrub``): it is stored
    as the last error, the quarantine reason and the attempts' reasons."""
    raw, public = _failure_texts(exc)
    return scrub(raw), public


def _failure_texts(exc: BaseException) -> tuple[str, str]:
    """(raw, public): what operators read of a failed attempt, and what its account reads.

    The account reads the job's own words only when the job chose them for it, as the
    message of ``Retry`` or ``Permanent``; the cause of such an exception (``raise
    Retry("ledger unavailable") from exc``) is added to the operators' text alone. Any other
    exception's text (a driver's, an S3 client's, an OS error with its path) is the
    operators' only, and the account reads jobrelay's message for its kind.
    """
    raw = str(exc)
    if isinstance(exc, Retry | Permanent):
        public = public_error(RETRY if isinstance(exc, Retry) else REFUSED, raw)
        cause = exc.__cause__
        if cause is not None:
            lines = str(getattr(cause, "orig", None) or cause).strip().splitlines()
            raw = f"{raw}: {lines[0] if lines else type(cause).__name__}"
        return raw, public
    if isinstance(exc, PermanentError):
        return raw, public_error(REFUSED)
    if isinstance(exc, OperationError | StoreError):
        return raw, public_error(TEMPORARY)
    return f"unexpected {type(exc).__name__}: {exc}", public_error(UNEXPECTED)


def failure_traceback(exc: BaseException) -> str | None:
    """``exc``'s traceback (with its chained causes) scrubbed and bounded; None if it could
    not be formatted (a failure is recorded with its reason whatever happens here)."""
    try:
        text = "".join(traceback.format_exception(exc))
    except Exception:  # an exception whose __str__ or frames cannot be rendered
        log.warning("traceback not formatted", exc_info=True)
        return None
    # Scrubbed before it is cut: a cut through a secret could leave a part no pattern matches.
    return bounded(safe_text(scrub(text)))


def bounded(text: str, limit: int = MAX_TRACEBACK_BYTES) -> str:
    """``text`` if it fits in ``limit`` bytes of UTF-8, else the marker and its last lines.

    Cut never mid-character, and at a line start when one is near (a huge exception message
    on one line is kept as its end instead), so what is kept reads as a traceback's end.
    """
    data = text.encode("utf-8")
    if len(data) <= limit:
        return text
    keep = limit - len(CUT_MARKER.encode("utf-8"))
    tail = data[-keep:].decode("utf-8", "ignore")  # a character cut at the start is dropped
    line = tail.find("\n")
    if 0 <= line < min(len(tail) - 1, _NEAR):
        tail = tail[line + 1 :]
    return CUT_MARKER + tail


async def record_release(rt: Runtime, delivery: Delivery, exc: Exception, worker: str) -> None:
    """A ``released`` event on the job's timeline saying why its delivery went back.

    Best effort: for a body that names no job (or a job that does not exist) there is
    no timeline, and a database that fails here must not hide the release.
    """
    job_id = peek_job_id(delivery.body)
    if job_id is None:
        return
    reason = safe_text(scrub(f"{type(exc).__name__}: {exc}"))[:1000]
    with contextlib.suppress(StoreError):
        if await rt.store.get_job(job_id) is not None:
            now = rt.clock()
            await rt.store.record_event(
                job_id,
                "released",
                now,
                reason=reason,
                worker=worker,
                deliveryCount=delivery.delivery_count,
            )
            limit = rt.settings.delivery_limit
            if not rt.settings.uses_local_broker and delivery.delivery_count >= limit:
                # RabbitMQ dead-letters this release silently (x-delivery-limit; the
                # local transport records its own when it moves the row aside).
                deliveries = delivery.delivery_count + 1
                await rt.store.record_event(
                    job_id,
                    "dead_lettered",
                    now,
                    reason=dead_letter_reason(deliveries, limit),
                    deliveries=deliveries,
                    limit=limit,
                )
