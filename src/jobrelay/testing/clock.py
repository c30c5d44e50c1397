"""The fake clock of a test's runner: time moves only when the test (or ``drain``) says."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta


class FakeClock:
    """A clock for ``jobrelay.testing``: starts at ``start`` (default: the wall clock's now)
    and only moves forward, by ``advance`` or ``move_to``. The runner's store, relay, worker
    and scheduler read it, and so do the app's enqueues (``App.bind``): leases, retries'
    due times, delayed jobs and schedules all follow it."""

    def __init__(self, start: datetime | None = None) -> None:
        if start is not None and start.tzinfo is None:
            raise ValueError("FakeClock's start must be an aware datetime (UTC)")
        self._now = (start or datetime.now(UTC)).astimezone(UTC)

    def __call__(self) -> datetime:
        return self._now

    def now(self) -> datetime:
        return self._now

    def advance(self, by: float | timedelta) -> datetime:
        """Move forward by ``by`` (seconds, or a ``timedelta``); returns the new time."""
        step = by if isinstance(by, timedelta) else timedelta(seconds=by)
        if step < timedelta(0):
            raise ValueError(f"a clock only moves forward, not by {step}")
        self._now += step
        return self._now

    def move_to(self, when: datetime) -> datetime:
        """Move forward to ``when`` (never back: an earlier time leaves the clock as it is)."""
        self._now = max(self._now, when.astimezone(UTC))
        return self._now

    def __repr__(self) -> str:
        return f"<FakeClock {self._now.isoformat()}>"
