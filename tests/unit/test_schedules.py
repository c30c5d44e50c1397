"""Periodic schedules as pure functions: cron in a time zone across DST, catch-up, keys.

The clock is always a fixed instant passed in; nothing here sleeps or reads the time. The
expected instants are what Debian cron does (cronsim follows it): a fixed-time job whose
local time does not exist on the spring-forward night runs once, when the clocks jump; one
whose local time exists twice on the fall-back night runs once, at the first; a job with a
wildcard hour runs by elapsed time, so it runs at both 02:00s of the fall-back night.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo

import pytest

import jobrelay
from jobrelay.domain.ids import IdKeys
from jobrelay.domain.schedules import (
    COUNT_LIMIT,
    LISTED,
    Catchup,
    Cron,
    check_cron,
    plan,
    skipped_between,
    tick_key,
)
from jobrelay.errors import ConfigError
from jobrelay.settings import load_settings

BERLIN = "Europe/Berlin"
# 2026: CET -> CEST on 29 March at 02:00 local (01:00Z); CEST -> CET on 25 October at
# 03:00 local (01:00Z).
SPRING = datetime(2026, 3, 28, 12, 0, tzinfo=UTC)
AUTUMN = datetime(2026, 10, 24, 12, 0, tzinfo=UTC)


def z(day: str) -> datetime:
    return datetime.fromisoformat(day).replace(tzinfo=UTC)


def ticks(cron: Cron, after: datetime, until: datetime) -> list[datetime]:
    out = []
    for tick in cron.ticks_after(after):
        if tick > until:
            return out
        out.append(tick)
    return out


# --- DST on a fixed clock ----------------------------------------------------------------


def test_a_nightly_job_in_the_skipped_hour_runs_once_when_the_clocks_jump() -> None:
    got = ticks(Cron("30 2 * * *", BERLIN), SPRING, SPRING + timedelta(days=2))
    assert got == [z("2026-03-29T01:00"), z("2026-03-30T00:30")]  # 03:00 CEST, then 02:30


def test_a_nightly_job_in_the_repeated_hour_runs_once() -> None:
    got = ticks(Cron("30 2 * * *", BERLIN), AUTUMN, AUTUMN + timedelta(days=2))
    assert got == [z("2026-10-25T00:30"), z("2026-10-26T01:30")]  # the first 02:30 only


def test_an_hourly_job_runs_by_elapsed_time_across_both_transitions() -> None:
    spring = ticks(Cron("0 * * * *", BERLIN), z("2026-03-28T23:30"), z("2026-03-29T02:30"))
    assert spring == [z("2026-03-29T00:00"), z("2026-03-29T01:00"), z("2026-03-29T02:00")]
    local = [t.astimezone(ZoneInfo(BERLIN)).hour for t in spring]
    assert local == [1, 3, 4]  # no 02:00 that night
    autumn = ticks(Cron("0 * * * *", BERLIN), z("2026-10-24T23:30"), z("2026-10-25T02:30"))
    assert autumn == [z("2026-10-25T00:00"), z("2026-10-25T01:00"), z("2026-10-25T02:00")]


def test_catch_up_across_a_transition_enqueues_each_instant_once() -> None:
    # A scheduler down over the fall-back night, catch-up "all": the two 02:00s (CEST, CET)
    # are two ticks with two keys; nothing is doubled.
    cron = Cron("0 * * * *", BERLIN)
    result = plan(cron, z("2026-10-24T23:30"), z("2026-10-25T02:30"), Catchup.parse("all"))
    assert result.enqueue == (z("2026-10-25T00:00"), z("2026-10-25T01:00"), z("2026-10-25T02:00"))
    keys = {tick_key("hourly", t) for t in result.enqueue}
    assert len(keys) == 3
    assert result.skipped is None and result.cursor == z("2026-10-25T02:30")


def test_the_second_of_two_repeated_hours_is_due_on_time() -> None:
    # A pass every five minutes through the fall-back night, catch-up "last": the tick at
    # 02:00 CET (01:00Z) must be found as the latest due tick. (Rounding the pass's time up
    # to the second in local wall-clock time lost the fold and found 02:00 CEST instead.)
    cron = Cron("0 * * * *", BERLIN)
    result = plan(cron, z("2026-10-25T00:55"), z("2026-10-25T01:00:00.5"), Catchup.parse("last"))
    assert result.enqueue == (z("2026-10-25T01:00"),)
    assert cron.last_before(z("2026-10-25T01:00:00.000001")) == z("2026-10-25T01:00")


def test_from_inside_the_repeated_hour_the_next_tick_is_tomorrow() -> None:
    # 02:45 CEST (00:45Z) ran; the cursor is at 02:30 CET (01:30Z), the second time round.
    cron = Cron("45 2 * * *", BERLIN)
    assert cron.next_after(z("2026-10-25T01:30")) == z("2026-10-26T01:45")
    result = plan(cron, z("2026-10-25T01:30"), z("2026-10-25T01:50"), Catchup.parse("all"))
    assert result.enqueue == () and result.skipped is None


def test_utc_is_the_default_zone() -> None:
    assert Cron("30 2 * * *").next_after(SPRING) == z("2026-03-29T02:30")


# --- catch-up policy ---------------------------------------------------------------------

EVERY_MINUTE = Cron("* * * * *")
CURSOR = z("2026-01-01T12:00")
NOW = z("2026-01-01T12:10:30")  # ticks 12:01 .. 12:10 are due


def test_last_enqueues_the_latest_tick_and_records_the_rest() -> None:
    result = plan(EVERY_MINUTE, CURSOR, NOW, Catchup.parse("last"))
    assert result.enqueue == (z("2026-01-01T12:10"),)
    assert result.skipped is not None
    assert (result.skipped.reason, result.skipped.count) == ("catchup", 9)
    assert (result.skipped.first, result.skipped.last) == (
        z("2026-01-01T12:01"),
        z("2026-01-01T12:09"),
    )
    assert result.skipped.listed == tuple(z(f"2026-01-01T12:0{m}") for m in range(1, 10))
    assert result.cursor == NOW


def test_a_window_keeps_the_ticks_no_older_than_it() -> None:
    result = plan(EVERY_MINUTE, CURSOR, NOW, Catchup.parse("3m"))  # since 12:07:30
    assert result.enqueue == (z("2026-01-01T12:08"), z("2026-01-01T12:09"), z("2026-01-01T12:10"))
    assert result.skipped is not None and result.skipped.count == 7
    assert result.skipped.last == z("2026-01-01T12:07")


def test_all_enqueues_every_missed_tick_in_batches() -> None:
    first = plan(EVERY_MINUTE, CURSOR, NOW, Catchup.parse("all"), batch=4)
    assert first.enqueue == tuple(z(f"2026-01-01T12:0{m}") for m in range(1, 5))
    assert first.more and first.cursor == z("2026-01-01T12:04") and first.skipped is None
    rest = plan(EVERY_MINUTE, first.cursor, NOW, Catchup.parse("all"), batch=100)
    assert len(rest.enqueue) == 6 and not rest.more and rest.cursor == NOW


def test_nothing_due_and_a_cursor_ahead_of_now_do_nothing() -> None:
    quiet = plan(EVERY_MINUTE, CURSOR, z("2026-01-01T12:00:59"), Catchup.parse("last"))
    assert quiet.enqueue == () and quiet.skipped is None
    behind = plan(EVERY_MINUTE, NOW, CURSOR, Catchup.parse("all"))
    assert behind.enqueue == () and behind.cursor == NOW


def test_a_tick_exactly_now_is_due() -> None:
    result = plan(EVERY_MINUTE, CURSOR, z("2026-01-01T12:01"), Catchup.parse("last"))
    assert result.enqueue == (z("2026-01-01T12:01"),) and result.skipped is None


def test_paused_skips_every_due_tick() -> None:
    result = plan(EVERY_MINUTE, CURSOR, NOW, Catchup.parse("all"), paused=True)
    assert result.enqueue == ()
    assert result.skipped is not None
    assert (result.skipped.reason, result.skipped.count) == ("paused", 10)
    merged = result.skipped.merge(result.skipped)
    assert merged.count == 20 and len(merged.listed) == LISTED


def test_a_huge_gap_is_counted_up_to_a_limit_and_says_so() -> None:
    seconds = Cron("* * * * * *")
    gap = skipped_between(seconds, CURSOR, CURSOR + timedelta(days=2), "catchup")
    assert gap is not None and gap.count == COUNT_LIMIT and not gap.count_complete
    assert gap.last == CURSOR + timedelta(days=2, seconds=-1)


def test_catchup_setting_is_parsed_strictly() -> None:
    assert Catchup.parse("90s").window == timedelta(seconds=90)
    assert Catchup.parse("2h").window == timedelta(hours=2)
    assert Catchup.parse(" ALL ").mode == "all"
    assert load_settings().schedule_catchup == "last"
    for bad in ("", "10", "-5m", "0s", "1w", "lastt"):
        with pytest.raises(ConfigError, match="JOBRELAY_SCHEDULE_CATCHUP"):
            load_settings(schedule_catchup=bad)


def test_cron_is_five_fields_or_six_with_seconds() -> None:
    assert check_cron("*/5  * * * *") == "*/5 * * * *"
    assert Cron(check_cron("* * * * * *")).next_after(CURSOR) == CURSOR + timedelta(seconds=1)
    for bad in ("* * * *", "61 * * * *", "* * * * * * *", "@daily"):
        with pytest.raises(ValueError):
            check_cron(bad)


# --- the library surface ------------------------------------------------------------------


def test_schedules_are_checked_when_defined() -> None:
    from pydantic import BaseModel

    class Report(BaseModel):
        team: str
        scheduled_at: datetime

    app = jobrelay.App()

    @app.job("reports.nightly", params=Report, schedule="0 2 * * *", schedule_params={"team": "a"})
    async def nightly(ctx: jobrelay.JobContext[Report], params: Report) -> None:
        return None

    app.schedule(nightly, cron="*/5 * * * *", params={"team": "b"}, timezone=BERLIN, name="b")
    assert sorted(app.schedules) == ["b", "reports.nightly"]
    keys = IdKeys(bytes(range(32)))
    job = app.schedules["b"].tick_job(z("2026-01-01T12:05"), keys)
    assert job.params == {"team": "b", "scheduled_at": "2026-01-01T12:05:00Z"}
    assert job.idempotency_key == "schedule:b:2026-01-01T12:05:00+00:00"
    assert job.job_id == app.schedules["b"].tick_job(z("2026-01-01T12:05"), keys).job_id
    for kwargs, message in (
        ({"cron": "* * *"}, "five fields"),
        ({"cron": "* * * * *", "timezone": "Mars/Olympus"}, "unknown time zone"),
        ({"cron": "* * * * *", "params": {"team": 3}}, "team"),
        ({"cron": "* * * * *", "name": "b", "params": {"team": "c"}}, "taken"),
        ({"cron": "* * * * *", "name": "x", "params": {"team": "c", "scheduled_at": "x"}}, "set"),
    ):
        with pytest.raises(ConfigError, match=message):
            app.schedule(nightly, **kwargs)  # type: ignore[arg-type]
