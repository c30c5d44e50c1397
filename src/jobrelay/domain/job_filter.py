"""Which jobs a list, a count or a bulk action is about, and where a page of them ends.

The jobs list (``GET /v1/jobs``), the bulk actions (``/v1/bulk/replay|cancel``) and the
console all name jobs the same way, by a ``JobFilter``; the storage layer turns one into a
``WHERE``. Pages are keyset pages over ``(created_at, id)``, newest first: the cursor is the
last row's key, opaque to callers (URL-safe base64 of JSON) so its form can change, and a
page stays right while new jobs arrive (they sort before it), unlike an offset.

The overview's throughput is counted per minute by the database; ``minute_series`` lays
those counts out as one row per minute of the window, zeros included, so a chart's x-axis
is the clock and not the minutes that happened to have events.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta

from jobrelay.domain.states import JobState

# Event kinds the overview counts, by the name the chart gives them.
THROUGHPUT_KINDS: Mapping[str, str] = {
    "accepted": "accepted",
    "result_saved": "succeeded",
    "retry_scheduled": "retried",
    "quarantined": "quarantined",
}


# The events that put a job into a state a bulk action moves (queued, running, retry_wait,
# quarantined): a job with one of them after an operation's ``event_ceiling`` entered its
# state since.
STATE_ENTRY_KINDS: tuple[str, ...] = (
    "accepted",
    "claimed",
    "replayed",
    "retry_scheduled",
    "reconciled_lease_expired",
    "quarantined",
)


class CursorError(ValueError):
    """A cursor this server did not hand out (or from a different form of it)."""


@dataclass(frozen=True)
class JobFilter:
    """Every field narrows; ``None`` does not filter. ``reason`` matches part of the
    quarantine reason or the last error, ignoring case; with ``reason_public`` (an account
    token's search) part of the public error instead, the only error text the account can
    read: a search over the raw text answered yes/no about text the account is not shown,
    one guessed character per request. The time range is the job's ``created_at``,
    ``created_after`` inclusive and ``created_before`` exclusive."""

    states: tuple[JobState, ...] | None = None
    job_type: str | None = None
    queue: str | None = None
    account_id: str | None = None
    reason: str | None = None
    created_after: datetime | None = None
    created_before: datetime | None = None
    event_ceiling: int | None = None
    reason_public: bool = False
    # Only jobs no operator has asked to cancel yet (a bulk cancel of running jobs).
    uncancelled: bool = False

    def only(self, allowed: Iterable[JobState]) -> JobFilter:
        """The same filter kept to ``allowed`` states (a bulk action's legal sources)."""
        allowed = tuple(sorted(allowed, key=lambda s: s.value))
        states = allowed if self.states is None else tuple(s for s in self.states if s in allowed)
        return replace(self, states=states)

    def until(self, event_ceiling: int) -> JobFilter:
        """The same filter kept to the jobs in their state since event ``event_ceiling``."""
        return replace(self, event_ceiling=event_ceiling)


@dataclass(frozen=True)
class PageKey:
    """The key of the last job on a page: the next page starts strictly after it."""

    created_at: datetime
    job_id: str


def encode_cursor(key: PageKey) -> str:
    raw = json.dumps([key.created_at.astimezone(UTC).isoformat(), key.job_id])
    return base64.urlsafe_b64encode(raw.encode()).decode().rstrip("=")


def decode_cursor(cursor: str) -> PageKey:
    """The key inside a cursor; ``CursorError`` for anything not made by ``encode_cursor``."""
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        created, job_id = json.loads(raw)
        at = datetime.fromisoformat(created)
        if not isinstance(job_id, str) or at.tzinfo is None or len(job_id) > 36:
            raise CursorError("not a cursor from this server")
        # A forged time at the calendar's edge overflows when moved to UTC.
        return PageKey(at.astimezone(UTC), job_id)
    except (binascii.Error, ValueError, TypeError, UnicodeDecodeError, OverflowError) as exc:
        raise CursorError("not a cursor from this server") from exc


def window_start(now: datetime, minutes: int) -> datetime:
    """The first whole minute of a window of ``minutes`` minutes ending with ``now``'s."""
    return now.astimezone(UTC).replace(second=0, microsecond=0) - timedelta(minutes=minutes - 1)


def minute_series(
    counts: Iterable[tuple[datetime, str, int]], start: datetime, minutes: int
) -> dict[str, list[int] | list[str]]:
    """``{"minutes": [iso…], "accepted": [n…], …}``: one slot per minute from ``start``;
    counts outside the window or of other kinds are dropped."""
    names = list(THROUGHPUT_KINDS.values())
    series: dict[str, list[int]] = {name: [0] * minutes for name in names}
    for minute, kind, n in counts:
        name = THROUGHPUT_KINDS.get(kind)
        index = int((minute.astimezone(UTC) - start).total_seconds() // 60)
        if name is not None and 0 <= index < minutes:
            series[name][index] += n
    out: dict[str, list[int] | list[str]] = {
        "minutes": [(start + timedelta(minutes=i)).isoformat() for i in range(minutes)]
    }
    out.update(series)
    return out
