"""The jobs list's filter, its keyset cursor and the overview's per-minute series."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from jobrelay.domain.job_filter import (
    CursorError,
    JobFilter,
    PageKey,
    decode_cursor,
    encode_cursor,
    minute_series,
    window_start,
)
from jobrelay.domain.states import JobState as S

AT = datetime(2026, 12, 1, 18, 30, 15, 250_000, tzinfo=UTC)


def test_a_cursor_round_trips_and_anything_else_is_refused() -> None:
    key = PageKey(AT, "355781a6-5d2a-57ff-a430-b2902eefab0f")
    cursor = encode_cursor(key)
    assert "=" not in cursor and decode_cursor(cursor) == key
    # Not base64, not JSON, and a naive time with a number for the id.
    for bad in ("", "bm90LWEtY3Vyc29y", "!!!", "WyIyMDI2LTEyLTAxVDE4OjMwOjE1IiwgMV0"):
        with pytest.raises(CursorError):
            decode_cursor(bad)


def test_only_keeps_a_filter_to_the_actions_states() -> None:
    legal = {S.QUEUED, S.RETRY_WAIT, S.QUARANTINED}
    assert JobFilter(reason="x").only(legal) == JobFilter(
        states=(S.QUARANTINED, S.QUEUED, S.RETRY_WAIT), reason="x"
    )
    assert JobFilter(states=(S.SUCCEEDED, S.QUEUED)).only(legal).states == (S.QUEUED,)
    assert JobFilter(states=(S.SUCCEEDED,)).only(legal).states == ()


def test_minute_series_lays_counts_on_the_clock_with_zeros() -> None:
    start = window_start(AT, 3)
    assert start == datetime(2026, 12, 1, 18, 28, tzinfo=UTC)
    counts = [
        (start, "accepted", 2),
        (start + timedelta(minutes=2), "accepted", 1),
        (start + timedelta(minutes=2), "result_saved", 4),
        (start + timedelta(minutes=1), "claimed", 9),  # not a counted kind
        (start - timedelta(minutes=1), "quarantined", 5),  # before the window
        (start + timedelta(minutes=3), "quarantined", 5),  # after it
    ]
    series = minute_series(counts, start, 3)
    assert series["minutes"] == [
        "2026-12-01T18:28:00+00:00",
        "2026-12-01T18:29:00+00:00",
        "2026-12-01T18:30:00+00:00",
    ]
    assert series["accepted"] == [2, 0, 1]
    assert series["succeeded"] == [0, 0, 4]
    assert series["retried"] == [0, 0, 0] and series["quarantined"] == [0, 0, 0]
