"""A job type's back-off (``jobrelay.Backoff``): the delay per attempt and draw, and the
decision table's use of it."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from jobrelay import App, Backoff, ConfigError
from jobrelay.domain.backoff import SHORTEST_SECONDS
from jobrelay.domain.policy import TransientFailure, decide
from jobrelay.domain.states import JobState


def test_the_delay_grows_by_the_factor_and_stops_at_the_cap() -> None:
    backoff = Backoff(base=5, factor=2, max=60, jitter=0)
    assert [backoff.delay(a, 0.0) for a in range(1, 7)] == [5, 10, 20, 40, 60, 60]


def test_jitter_spreads_the_delay_by_its_fraction_either_way() -> None:
    backoff = Backoff(base=10, factor=3, max=3600, jitter=0.2)
    assert backoff.delay(2, -1.0) == pytest.approx(24)
    assert backoff.delay(2, 0.0) == pytest.approx(30)
    assert backoff.delay(2, 1.0) == pytest.approx(36)


def test_a_hundredth_attempt_does_not_overflow() -> None:
    assert Backoff(base=1, factor=100, max=3600, jitter=0).delay(100, 0.0) == 3600


@given(
    attempt=st.integers(1, 100),
    draw=st.floats(-1, 1),
    base=st.floats(0.1, 100),
    factor=st.floats(1, 10),
    jitter=st.floats(0, 0.99),
)
def test_every_delay_lies_between_the_shortest_and_the_jittered_cap(
    attempt: int, draw: float, base: float, factor: float, jitter: float
) -> None:
    backoff = Backoff(base=base, factor=factor, max=base * 50, jitter=jitter)
    delay = backoff.delay(attempt, draw)
    assert SHORTEST_SECONDS <= delay <= backoff.max * (1 + jitter) + 1e-9


@pytest.mark.parametrize(
    "kwargs",
    [
        {"base": 0},
        {"base": -1},
        {"factor": 0.5},
        {"max": 1, "base": 5},
        {"jitter": 1},
        {"jitter": -0.1},
        {"base": float("nan")},
        {"base": True},
        {"max": "60"},
    ],
)
def test_a_bad_backoff_is_refused_where_it_is_written(kwargs: dict[str, object]) -> None:
    with pytest.raises(ConfigError, match="Backoff"):
        Backoff(**kwargs)  # type: ignore[arg-type]


def test_the_table_uses_the_backoff_and_holds_the_retry() -> None:
    backoff = Backoff(base=5, factor=2, max=3600, jitter=0.5)
    decision = decide(TransientFailure("e", 3, 5, (5, 30), backoff=backoff, draw=0.5))
    assert decision.new_state is JobState.RETRY_WAIT
    assert decision.retry_delay == pytest.approx(25)  # 20 s, +50% of 0.5
    assert decision.held
    # ``Retry(delay=)`` still wins for its raise; the last attempt still quarantines.
    asked = decide(TransientFailure("e", 1, 5, (5,), delay=7.5, backoff=backoff, draw=1))
    assert asked.retry_delay == 7.5 and asked.held
    assert decide(TransientFailure("e", 5, 5, (5,), backoff=backoff)).new_state is (
        JobState.QUARANTINED
    )
    # Without one, the fixed tiers, through the delay route.
    plain = decide(TransientFailure("e", 1, 5, (5, 30)))
    assert (plain.retry_delay, plain.held) == (5, False)


def test_app_job_takes_a_backoff_or_delays_but_not_both() -> None:
    from pydantic import BaseModel

    class P(BaseModel):
        n: int = 0

    app = App()
    backoff = Backoff(base=2)

    @app.job("lab.backoff", params=P, retry=backoff)
    async def run(ctx: object, params: P) -> None:
        return None

    assert app.jobs["lab.backoff"].backoff is backoff
    with pytest.raises(ConfigError, match="not both"):
        app.job("lab.both", params=P, retry=backoff, retry_delays=(5,))
    with pytest.raises(ConfigError, match="Backoff"):
        app.job("lab.bad", params=P, retry=(5, 30))  # type: ignore[arg-type]
