"""When a delayed job may first run: ``delay`` or ``run_at``, resolved once, at enqueue.

A delayed job is a queued job whose outbox row is held until its due time (``run_at``): the
relay does not publish it before then, so it holds no worker memory and no broker message
while it waits, and a restart in between loses nothing (the row is in the database).

Pure: the caller passes the clock. The rules are the library's, the HTTP API's and the
CLI's alike, so they are stated here once.

Which clock: a ``delay`` is NOT added here. It is kept as seconds (``RunTime.delay``) and the
write adds it to the database's own clock in SQL (``storage.drivers.new_job``), because the relay
judges the held row by the database's clock: a due time from the enqueuing host's clock
would be off by that host's skew (120 s ahead made ``delay=5`` wait 125 s; 120 s behind made
``delay=60`` run at once). A ``run_at`` is absolute and stays as given; only whether it is
already past is judged here, by the caller's clock.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from jobrelay.errors import InvalidRunTime

# Further ahead than this is a mistake (milliseconds taken for seconds), not a plan: a job
# meant for next year is a schedule.
MAX_AHEAD = timedelta(days=365)

Delay = float | int | timedelta


@dataclass(frozen=True)
class RunTime:
    """A resolved run time: ``due`` (an absolute time) or ``delay`` (seconds after the
    database's clock at the write), neither: run now; and the request as asked, for the hash."""

    due: datetime | None
    requested: dict[str, Any] | None
    delay: float | None = None

    @property
    def delayed(self) -> bool:
        return self.due is not None or self.delay is not None


NOW = RunTime(due=None, requested=None)


def resolve(
    now: datetime,
    *,
    delay: Delay | None = None,
    run_at: datetime | None = None,
    delay_name: str = "delay",
    run_at_name: str = "run_at",
) -> RunTime:
    """The run time of a job enqueued at ``now`` with ``delay`` seconds or at ``run_at``.

    A delay stays relative (``RunTime.delay``; 0 is "now"): the database adds it to its own
    clock when the job is written.

    ``InvalidRunTime`` (naming the argument as the caller spells it: ``delay_name``,
    ``run_at_name``) for both given, a negative or non-finite delay, a naive ``run_at``, or
    a time more than ``MAX_AHEAD`` away. A ``run_at`` already past is "now": the job runs at
    once, as a clock a little behind the database's would otherwise make it fail.
    """
    if delay is not None and run_at is not None:
        raise InvalidRunTime(run_at_name, f"give {delay_name} or {run_at_name}, not both")
    if delay is not None:
        seconds = _seconds(delay, delay_name)  # at most MAX_AHEAD
        return RunTime(
            due=None, requested={"delaySeconds": seconds}, delay=seconds if seconds > 0 else None
        )
    elif run_at is not None:
        if not isinstance(run_at, datetime):
            raise InvalidRunTime(run_at_name, "must be a datetime with a time zone")
        if run_at.tzinfo is None or run_at.utcoffset() is None:
            raise InvalidRunTime(
                run_at_name, "a naive datetime is ambiguous: give one with a time zone (UTC)"
            )
        try:
            due = run_at.astimezone(UTC)
        except OverflowError:  # 9999-12-31T23:59:59-23:59 is past what a datetime holds
            raise InvalidRunTime(run_at_name, "out of range (years 1 to 9999 in UTC)") from None
        requested = {"runAt": due.isoformat()}
    else:
        return NOW
    if due - now > MAX_AHEAD:
        raise InvalidRunTime(
            delay_name if delay is not None else run_at_name,
            f"at most {MAX_AHEAD.days} days ahead (a periodic job is a schedule)",
        )
    return RunTime(due=due if due > now else None, requested=requested)


def _seconds(delay: Delay, name: str) -> float:
    if isinstance(delay, timedelta):
        seconds = delay.total_seconds()
    elif isinstance(delay, bool) or not isinstance(delay, int | float):
        raise InvalidRunTime(name, "must be a number of seconds or a timedelta")
    else:
        seconds = float(delay)
    if not math.isfinite(seconds):
        raise InvalidRunTime(name, "must be a finite number of seconds")
    if seconds < 0:
        raise InvalidRunTime(name, "must be zero or more seconds")
    if seconds > MAX_AHEAD.total_seconds():
        raise InvalidRunTime(name, f"at most {MAX_AHEAD.days} days ahead")
    return seconds


def waiting(due: datetime | None, now: datetime) -> float | None:
    """Seconds until ``due`` (None when not delayed or already due): "runs at … (in N s)"."""
    if due is None or due <= now:
        return None
    return (due - now).total_seconds()


def runs_at_text(due: datetime, now: datetime) -> str:
    """``runs at 2026-12-02T15:00:00+00:00 (in 42 s)``, the one wording the CLI and explain use."""
    left = waiting(due, now)
    suffix = f" (in {math.ceil(left)} s)" if left is not None else " (due)"
    return f"runs at {due.isoformat()}{suffix}"
