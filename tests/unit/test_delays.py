"""``domain.delays``: ``delay`` / ``run_at`` resolved into a due time, and every bad one refused."""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta, timezone

import pytest
from hypothesis import given
from hypothesis import strategies as st

from jobrelay.domain.delays import MAX_AHEAD, NOW, resolve, runs_at_text, waiting
from jobrelay.errors import InvalidRunTime

T0 = datetime(2026, 12, 2, 15, 0, tzinfo=UTC)


def test_nothing_given_runs_now() -> None:
    assert resolve(T0) == NOW
    assert not NOW.delayed


@given(st.floats(min_value=0.001, max_value=MAX_AHEAD.total_seconds()))
def test_a_delay_stays_seconds_for_the_database_to_add_to_its_clock(seconds: float) -> None:
    """Not added to the caller's clock here: the write adds it to the database's (a host
    whose clock is off would otherwise hold the job for the delay plus its skew)."""
    when = resolve(T0, delay=seconds)
    assert when.due is None and when.delay == seconds and when.delayed
    assert when.requested == {"delaySeconds": seconds}
    assert resolve(T0 + timedelta(minutes=2), delay=seconds) == when  # whatever the clock


def test_a_timedelta_is_the_same_delay_as_its_seconds() -> None:
    assert resolve(T0, delay=timedelta(minutes=2)) == resolve(T0, delay=120)
    assert resolve(T0, delay=timedelta(seconds=90)).delay == 90


def test_zero_delay_runs_now_but_is_still_part_of_the_request() -> None:
    when = resolve(T0, delay=0)
    assert when.due is None and when.requested == {"delaySeconds": 0.0}
    assert when.delay is None and not when.delayed


def test_run_at_in_another_zone_is_the_same_instant_in_utc() -> None:
    paris = timezone(timedelta(hours=1))
    when = resolve(T0, run_at=datetime(2026, 12, 2, 17, 0, tzinfo=paris))
    assert when.due == datetime(2026, 12, 2, 16, 0, tzinfo=UTC)
    assert when.due is not None and when.due.tzinfo is UTC
    assert when.requested == {"runAt": "2026-12-02T16:00:00+00:00"}


@given(st.timedeltas(min_value=timedelta(0), max_value=timedelta(days=400)))
def test_a_past_run_at_means_now(ago: timedelta) -> None:
    when = resolve(T0, run_at=T0 - ago)
    assert when.due is None
    assert when.requested is not None  # the request still says when it asked for


@pytest.mark.parametrize(
    ("kwargs", "field", "words"),
    [
        ({"delay": -1}, "delay", "zero or more"),
        ({"delay": timedelta(seconds=-1)}, "delay", "zero or more"),
        ({"delay": math.nan}, "delay", "finite"),
        ({"delay": math.inf}, "delay", "finite"),
        ({"delay": "5"}, "delay", "number of seconds"),
        ({"delay": True}, "delay", "number of seconds"),
        ({"delay": MAX_AHEAD.total_seconds() + 1}, "delay", "365 days"),
        ({"delay": timedelta(days=10_000)}, "delay", "365 days"),
        ({"run_at": datetime(2026, 12, 3, 0, 0)}, "run_at", "naive"),
        ({"run_at": "2026-12-03T00:00:00Z"}, "run_at", "datetime"),
        ({"run_at": T0 + MAX_AHEAD + timedelta(seconds=1)}, "run_at", "365 days"),
        ({"run_at": T0 + timedelta(hours=1), "delay": 5}, "run_at", "not both"),
    ],
)
def test_bad_run_times_are_refused_naming_the_argument(
    kwargs: dict[str, object], field: str, words: str
) -> None:
    with pytest.raises(InvalidRunTime) as raised:
        resolve(T0, **kwargs)  # type: ignore[arg-type]
    assert raised.value.field == field
    assert words in str(raised.value)


def test_the_caller_names_the_arguments_as_its_users_spell_them() -> None:
    with pytest.raises(InvalidRunTime) as raised:
        resolve(T0, delay=-5, delay_name="delaySeconds", run_at_name="runAt")
    assert raised.value.field == "delaySeconds"


def test_exactly_max_ahead_is_allowed() -> None:
    assert resolve(T0, run_at=T0 + MAX_AHEAD).due == T0 + MAX_AHEAD


def test_runs_at_text_says_when_and_how_long() -> None:
    due = T0 + timedelta(seconds=41.2)
    assert runs_at_text(due, T0) == f"runs at {due.isoformat()} (in 42 s)"
    assert runs_at_text(T0, T0).endswith("(due)")
    assert waiting(due, T0) == pytest.approx(41.2)
    assert waiting(T0, T0) is None and waiting(None, T0) is None
