"""Periodic jobs, as pure functions of a cron expression, a time zone and two instants.

A schedule's ticks are the instants its cron expression matches in its time zone, computed
by cronsim (the parser Healthchecks.io runs; Debian cron's rules, including its daylight
saving time handling). Every instant here is an aware UTC datetime: a tick is named by its
UTC instant, so the two 02:30s of an autumn night in Berlin are two ticks for a schedule
that matches both, and the key of a tick never depends on a host's zone.

What a scheduler does with the ticks that came due since it last looked is ``plan``: the
tick jobs to enqueue now and the ticks it skips, decided by the catch-up policy. Nothing
here reads a clock: the caller passes ``now``. Bad input is a ``ValueError``; the library
surface turns it into a ``ConfigError``.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, Literal
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from cronsim import CronSim, CronSimError

# A tick job's parameters may name the tick: a field of this name is set to its instant.
TICK_FIELD = "scheduled_at"
# At most this many tick jobs per transaction (catch-up of `all` or a long window): a
# scheduler back after a long outage fills the queue in steps, never in one statement.
ENQUEUE_BATCH = 500
# Skipped ticks are counted one by one up to here; past it the count is a lower bound.
COUNT_LIMIT = 10_000  # (about 0.1 s of cronsim: the pass holds its transaction meanwhile)
# How many skipped instants an event lists (the first ones; count, first and last say all).
LISTED = 20
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")
_DURATION = re.compile(r"(\d+(?:\.\d+)?)(s|m|h|d)")
_UNIT = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def check_name(name: str) -> str:
    if not _NAME.fullmatch(name):
        raise ValueError(f"schedule name {name!r} must match {_NAME.pattern}")
    return name


def check_cron(cron: str) -> str:
    """The expression, normalised to single spaces; five fields, or six with seconds first."""
    fields = cron.split()
    if len(fields) not in (5, 6):
        raise ValueError(
            f"cron {cron!r} must have five fields (minute hour day month weekday), "
            "or six with a leading seconds field",
        )
    try:
        CronSim(" ".join(fields), datetime(2000, 1, 1, tzinfo=UTC))
    except CronSimError as exc:
        raise ValueError(f"cron {cron!r}: {exc}") from None
    return " ".join(fields)


def zone(name: str) -> ZoneInfo:
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError):
        raise ValueError(f"unknown time zone {name!r} (an IANA name)") from None


@dataclass(frozen=True)
class Cron:
    """A cron expression in a time zone: the source of a schedule's ticks."""

    expr: str
    timezone: str = "UTC"

    def ticks_after(self, after: datetime) -> Iterator[datetime]:
        """Every tick strictly after ``after``, in order, as UTC instants."""
        for tick in CronSim(self.expr, after.astimezone(zone(self.timezone))):
            instant = tick.astimezone(UTC)
            # A fixed-time expression is evaluated on local wall-clock time (Debian cron's
            # rule), so from inside the repeated hour it offers that hour's first occurrence
            # again, which is already past.
            if instant > after:
                yield instant

    def next_after(self, after: datetime) -> datetime:
        return next(self.ticks_after(after))

    def last_before(self, before: datetime) -> datetime | None:
        """The latest tick strictly before ``before`` (None: none in the last ~year)."""
        # cronsim counts a start with microseconds as its first tick; round up to the second
        # in UTC (local wall-clock arithmetic would lose the fold of a repeated hour).
        instant = before.astimezone(UTC)
        if instant.microsecond:
            instant = instant.replace(microsecond=0) + timedelta(seconds=1)
        start = instant.astimezone(zone(self.timezone))
        try:
            return next(iter(CronSim(self.expr, start, reverse=True))).astimezone(UTC)
        except (StopIteration, CronSimError):  # pragma: no cover - a cron that never matches
            return None


# --- catch-up --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Catchup:
    """Which of the ticks missed while no scheduler ran are still enqueued.

    ``last``: only the latest one (the default); ``all``: every one; a window: those no
    older than ``window``. The rest are skipped and recorded, never dropped silently.
    """

    mode: Literal["last", "all", "window"]
    window: timedelta | None = None

    @classmethod
    def parse(cls, text: str) -> Catchup:
        value = text.strip().lower()
        if value in ("last", "all"):
            return cls(value)  # type: ignore[arg-type]
        match = _DURATION.fullmatch(value)
        if match is None or float(match.group(1)) <= 0:
            raise ValueError(
                f"expected last, all, or a duration like 90s, 15m, 2h or 7d; got {text!r}"
            )
        return cls("window", timedelta(seconds=float(match.group(1)) * _UNIT[match.group(2)]))

    def __str__(self) -> str:
        if self.window is None:
            return self.mode
        return f"{self.window.total_seconds():g}s"


@dataclass(frozen=True)
class Skipped:
    """Ticks that came due and got no job: why, how many, which."""

    reason: Literal["catchup", "paused"]
    count: int
    first: datetime
    last: datetime
    listed: tuple[datetime, ...]
    count_complete: bool = True

    def detail(self) -> dict[str, Any]:
        return {
            "reason": self.reason,
            "count": self.count,
            "countComplete": self.count_complete,
            "first": self.first.isoformat(),
            "last": self.last.isoformat(),
            "ticks": [t.isoformat() for t in self.listed],
        }

    def merge(self, later: Skipped) -> Skipped:
        """This record followed by ``later`` (the same pause, a later pass)."""
        listed = (*self.listed, *later.listed)[:LISTED]
        return Skipped(
            self.reason,
            self.count + later.count,
            self.first,
            later.last,
            listed,
            self.count_complete and later.count_complete,
        )


@dataclass(frozen=True)
class Plan:
    """What one pass does with a schedule: enqueue ``enqueue``, record ``skipped``, and move
    the cursor (every tick at or before it is handled) to ``cursor``."""

    enqueue: tuple[datetime, ...]
    skipped: Skipped | None
    cursor: datetime
    more: bool = False  # the batch limit was reached: another pass follows at once


def skipped_between(
    cron: Cron, after: datetime, before: datetime, reason: Literal["catchup", "paused"]
) -> Skipped | None:
    """The ticks strictly after ``after`` and strictly before ``before``."""
    listed: list[datetime] = []
    count = 0
    first: datetime | None = None
    for tick in cron.ticks_after(after):
        if tick >= before:
            break
        first = first or tick
        count += 1
        if len(listed) < LISTED:
            listed.append(tick)
        if count >= COUNT_LIMIT:
            break
    if first is None:
        return None
    last = cron.last_before(before) or listed[-1]
    return Skipped(reason, count, first, last, tuple(listed), count_complete=count < COUNT_LIMIT)


def plan(
    cron: Cron,
    cursor: datetime,
    now: datetime,
    catchup: Catchup,
    *,
    paused: bool = False,
    batch: int = ENQUEUE_BATCH,
) -> Plan:
    """The ticks in (``cursor``, ``now``]: which to enqueue, which to skip, and the new cursor.

    ``cursor`` only moves forward, so a pass that runs with an earlier ``now`` than the last
    one (another scheduler's transaction) does nothing.
    """
    if now <= cursor:
        return Plan((), None, cursor)
    if paused:
        skipped = skipped_between(cron, cursor, now + timedelta(microseconds=1), "paused")
        return Plan((), skipped, now)
    if catchup.mode == "all":
        start = cursor
    elif catchup.mode == "window":
        assert catchup.window is not None
        start = max(cursor, now - catchup.window - timedelta(microseconds=1))
    else:
        latest = cron.last_before(now + timedelta(microseconds=1))
        if latest is None or latest <= cursor:
            return Plan((), None, now)
        start = latest - timedelta(microseconds=1)
    skipped = skipped_between(cron, cursor, start + timedelta(microseconds=1), "catchup")
    enqueue: list[datetime] = []
    for tick in cron.ticks_after(start):
        if tick > now:
            break
        enqueue.append(tick)
        if len(enqueue) >= batch:
            return Plan(tuple(enqueue), skipped, tick, more=True)
    return Plan(tuple(enqueue), skipped, now)


def tick_key(schedule: str, tick: datetime) -> str:
    """The idempotency key of a tick's job: the same for every scheduler that enqueues it."""
    return f"schedule:{schedule}:{tick.astimezone(UTC).isoformat()}"
