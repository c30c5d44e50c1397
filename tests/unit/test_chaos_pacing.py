"""The soak's pacing (``chaos.clients.Pacer``): the load follows the fault plan, so a fault
that needs work to reach its point begins with work on its way, however slow the machine."""

from __future__ import annotations

import asyncio
import time

import pytest

from jobrelay.chaos.clients import Pacer


def test_submissions_are_spread_over_the_steps_in_proportion_to_their_estimates() -> None:
    pace = Pacer([2.0, 8.0], 10)
    assert [pace.place(i) for i in (0, 1, 2, 9)] == [(0, 0.0), (0, 1.0), (1, 0.0), (1, 7.0)]


async def test_a_steps_share_is_due_from_when_the_step_began_not_from_its_estimate() -> None:
    """CI (the failover soak): the faults ran slower than their estimates, the submissions,
    paced by the clock alone, were all sent 20 s before the last fault that needed work, and
    that fault never fired. A step begun late releases its share late."""
    pace = Pacer([10.0, 10.0], 4)
    await pace.begin(0)
    first = pace.begun[0]
    assert first is not None
    assert pace.due_at(1) == pytest.approx(first + 5.0)
    assert pace.due_at(2) is None  # the second fault has not begun: its share waits
    waiting = asyncio.create_task(pace.wait(2))
    for _ in range(5):
        await asyncio.sleep(0)  # let the waiter run up to its wait
    assert not waiting.done()

    late = time.monotonic()  # the second fault begins late, whatever the clock estimated
    await pace.begin(1)
    await asyncio.wait_for(waiting, timeout=5)
    due = pace.due_at(2)
    assert due is not None and due >= late
    assert pace.due_at(3) == pytest.approx(due + 5.0)


async def test_a_later_step_begins_the_earlier_ones_and_extra_steps_change_nothing() -> None:
    pace = Pacer([1.0, 1.0, 1.0], 3)
    await pace.begin(2)
    assert all(b is not None for b in pace.begun)
    before = list(pace.begun)
    await pace.begin(1)
    await pace.begin(7)  # a fault beyond the pacer's steps (--rate: one step)
    assert pace.begun == before


async def test_retries_stop_only_once_the_last_step_and_the_patience_are_over() -> None:
    pace = Pacer([0.0, 0.0], 2)
    assert not pace.overdue(0.0)  # the plan has not reached its last step
    await pace.begin(1)
    assert not pace.overdue(60.0)
    assert pace.overdue(-1.0)
