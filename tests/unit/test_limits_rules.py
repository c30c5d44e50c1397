"""The admission rules of limits per key (``domain.limits``): pure, so checked exhaustively
here; the store and the relay apply them (``tests/integration/test_limits.py``)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from jobrelay.domain.limits import (
    CONCURRENCY,
    PRIORITY,
    RATE,
    Bucket,
    Candidate,
    JobLimit,
    LimitError,
    Override,
    admit,
    default_burst,
    in_turns,
    limit_id,
    limiting,
    parse_rate,
    priority_limit,
    split_id,
)


def conc(key: str, n: int = 2) -> JobLimit:
    return JobLimit(limit_id("report.export", key), CONCURRENCY, max=n)


def rate(per_second: float, burst: float, key: str | None = None) -> JobLimit:
    return JobLimit(limit_id("smtp", key), RATE, per_second=per_second, burst=burst)


@pytest.mark.parametrize(
    ("text", "parsed"),
    [("10/second", (10, 1.0)), ("30/minute", (30, 60.0)), (" 1 / hour ", (1, 3600.0))],
)
def test_a_rate_reads_as_count_and_period(text: str, parsed: tuple[int, float]) -> None:
    assert parse_rate(text) == parsed


@pytest.mark.parametrize("text", ["0/second", "10/day", "ten/second", "10", "", "-1/minute"])
def test_a_bad_rate_is_refused_saying_the_form(text: str) -> None:
    with pytest.raises(LimitError, match="N/second"):
        parse_rate(text)


def test_the_default_burst_is_one_seconds_worth_and_at_least_one() -> None:
    assert default_burst(10, 1.0) == 10.0
    assert default_burst(30, 60.0) == 1.0


def test_a_limit_id_names_the_limit_and_the_key() -> None:
    assert split_id(limit_id("report.export", "acme")) == ("report.export", "acme")
    assert split_id(limit_id("smtp", None)) == ("smtp", None)


def test_a_concurrency_limit_admits_up_to_its_max_counting_held_slots() -> None:
    jobs = [Candidate(f"j{i}", (conc("acme"),), i) for i in range(5)]
    answer = admit(jobs, {conc("acme").limit_id: 1}, {}, 0.0)
    assert answer.admitted == ["j0"]
    assert set(answer.held) == {"j1", "j2", "j3", "j4"}


def test_keys_take_turns_so_a_backlog_delays_another_key_by_one_round() -> None:
    backlog = [Candidate(f"a{i}", (conc("a", 100),), i) for i in range(50)]
    late = [Candidate(f"b{i}", (conc("b", 100),), 100 + i) for i in range(3)]
    order = [c.job_id for c in in_turns(backlog + late)]
    assert order[:6] == ["a0", "b0", "a1", "b1", "a2", "b2"]
    assert admit(backlog + late, {}, {}, 0.0, room=4).admitted == ["a0", "b0", "a1", "b1"]


def test_a_rate_limit_spends_its_burst_then_refills_at_its_rate() -> None:
    limit = rate(2.0, 3.0)
    jobs = [Candidate(f"j{i}", (limit,), i) for i in range(10)]
    first = admit(jobs, {}, {}, 0.0)
    assert first.admitted == ["j0", "j1", "j2"] and first.buckets[limit.limit_id] == 0.0
    bucket = Bucket(first.buckets[limit.limit_id], 0.0)
    later = admit(jobs[3:], {}, {limit.limit_id: bucket}, 1.0)  # one second: two tokens
    assert later.admitted == ["j3", "j4"]


def test_a_job_is_admitted_only_when_every_limit_has_room() -> None:
    both = (conc("acme", 5), rate(1.0, 1.0, "acme"))
    jobs = [Candidate(f"j{i}", both, i) for i in range(3)]
    answer = admit(jobs, {}, {}, 0.0)
    assert answer.admitted == ["j0"]
    assert answer.held["j1"].kind == RATE
    assert (conc("acme", 5).limit_id, 1) not in answer.held.items()


def test_an_override_replaces_the_declared_max_by_id_or_by_name() -> None:
    jobs = [Candidate(f"j{i}", (conc("acme", 1),), i) for i in range(5)]
    by_name = {"report.export": Override(max=3)}
    assert len(admit(jobs, {}, {}, 0.0, by_name).admitted) == 3
    by_id = {conc("acme").limit_id: Override(max=4), "report.export": Override(max=3)}
    assert len(admit(jobs, {}, {}, 0.0, by_id).admitted) == 4


@given(
    held=st.integers(0, 5),
    maximum=st.integers(1, 5),
    waiting=st.integers(0, 20),
    room=st.one_of(st.none(), st.integers(0, 20)),
)
def test_never_more_slots_than_the_max(
    held: int, maximum: int, waiting: int, room: int | None
) -> None:
    limit = conc("k", maximum)
    jobs = [Candidate(f"j{i}", (limit,), i) for i in range(waiting)]
    answer = admit(jobs, {limit.limit_id: held}, {}, 0.0, room=room)
    expected = max(0, min(waiting, maximum - held, room if room is not None else waiting))
    assert len(answer.admitted) == expected
    assert set(answer.admitted).isdisjoint(answer.held)


def test_a_higher_priority_is_admitted_before_any_lower_one_of_its_queue() -> None:
    queue = priority_limit("default")
    assert queue.to_json() == {"id": "queue:default", "kind": PRIORITY}
    assert JobLimit.from_json(queue.to_json()) == queue
    backlog = [Candidate(f"low{i}", (queue,), i) for i in range(50)]
    urgent = Candidate("urgent", (queue,), 99, priority=9)
    middle = Candidate("middle", (queue,), 98, priority=5)
    order = [c.job_id for c in in_turns([*backlog, middle, urgent])]
    assert order[:4] == ["urgent", "middle", "low0", "low1"]
    # Only ``priority_ahead`` of the queue's jobs are admitted and not yet ended: the rest
    # wait in the database, where a later urgent job still goes first.
    answer = admit([*backlog, urgent], {}, {}, 0.0, priority_ahead=4)
    assert answer.admitted == ["urgent", "low0", "low1", "low2"]
    assert answer.held["low3"] == queue
    full = admit([urgent], {queue.limit_id: 4}, {}, 0.0, priority_ahead=4)
    assert full.admitted == [] and full.held["urgent"] == queue


def test_keys_take_turns_and_priority_orders_each_keys_jobs() -> None:
    queue = priority_limit("default")
    a = [Candidate(f"a{i}", (conc("a", 100), queue), i) for i in range(5)]
    b = [Candidate(f"b{i}", (conc("b", 100), queue), 10 + i) for i in range(3)]
    b.append(Candidate("b-urgent", (conc("b", 100), queue), 20, priority=9))
    order = [c.job_id for c in in_turns(a + b)]
    # Never compared across keys: a's oldest keeps its turn; b's urgent one leads b's.
    assert order[:4] == ["a0", "b-urgent", "a1", "b0"]
    assert not limiting((queue,)) and limiting((conc("a"), queue))
    # Another queue's priority is never weighed against this one's.
    other = Candidate("other-9", (priority_limit("reports"),), 30, priority=9)
    order = [c.job_id for c in in_turns([Candidate("q0", (queue,), 1), other])]
    assert order == ["q0", "other-9"]
