"""``worker.stopping.RunStop``: a job's body runs in the delivery's own task, and stopping it
(lease lost, an operator's cancel, the time limit) cancels that task only while the body runs,
taken back as the body ends, so nothing after the body ever sees it."""

from __future__ import annotations

import asyncio

import pytest

from jobrelay.worker.stopping import RunStop


async def test_the_body_runs_in_the_callers_task_named_for_the_job_meanwhile() -> None:
    me = asyncio.current_task()
    assert me is not None
    own = me.get_name()
    stop = RunStop(asyncio.Event(), None)

    async def body() -> tuple[asyncio.Task[object] | None, str]:
        current = asyncio.current_task()
        return current, current.get_name() if current else ""

    task, name = await stop.run(body(), "jobrelay-job:j1:t")
    assert task is me and name == "jobrelay-job:j1:t"
    assert me.get_name() == own and stop.done()


async def test_the_time_limit_stops_the_body_and_the_cancel_goes_no_further() -> None:
    stop = RunStop(asyncio.Event(), 0.01)
    with pytest.raises(asyncio.CancelledError):
        await stop.run(asyncio.Event().wait(), "jobrelay-job:j1:t")
    me = asyncio.current_task()
    assert me is not None and me.cancelling() == 0
    assert stop.expired and stop.stopped
    await asyncio.sleep(0)  # the task goes on: no cancel left pending for the next await


async def test_a_body_that_swallows_the_stop_leaves_no_cancel_for_the_commit_after_it() -> None:
    """A body that catches CancelledError and returns: the outcome's commit that follows in
    the same task must not be cancelled by the stop the body swallowed."""
    stop = RunStop(asyncio.Event(), None)
    entered = asyncio.Event()

    async def body() -> str:
        entered.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            return "swallowed"
        return "never"

    async def lose_the_lease() -> None:
        await entered.wait()
        stop.lease_lost.set()
        stop.cancel()

    losing = asyncio.create_task(lose_the_lease())
    assert await stop.run(body(), "jobrelay-job:j1:t") == "swallowed"
    await losing
    me = asyncio.current_task()
    assert me is not None and me.cancelling() == 0
    assert await asyncio.wait_for(asyncio.sleep(0, "committed"), 5) == "committed"


async def test_a_stop_outside_the_body_changes_nothing() -> None:
    stop = RunStop(asyncio.Event(), None)
    stop.cancel()  # before the body

    async def body() -> int:
        await asyncio.sleep(0)
        return 1

    assert await stop.run(body(), "jobrelay-job:j1:t") == 1
    stop.cancel()  # after it
    await asyncio.sleep(0)
    me = asyncio.current_task()
    assert me is not None and me.cancelling() == 0


async def test_the_workers_own_cancel_during_the_body_is_still_counted() -> None:
    """The drain deadline cancels the delivery's task: the attempt must see that it is being
    stopped (``cancelling()``), not take it for its own stop."""
    entered = asyncio.Event()

    async def delivery() -> int:
        stop = RunStop(asyncio.Event(), None)

        async def body() -> None:
            entered.set()
            await asyncio.Event().wait()

        try:
            await stop.run(body(), "jobrelay-job:j1:t")
        except asyncio.CancelledError:
            me = asyncio.current_task()
            assert me is not None
            return me.cancelling()
        return -1

    task = asyncio.create_task(delivery())
    await entered.wait()
    task.cancel()
    assert await task == 1


async def test_a_body_can_use_asyncio_timeout_across_its_awaits() -> None:
    """``asyncio.timeout`` cancels the task that entered it: the body's whole life is one
    task, so a timeout entered before the body's first await stops the body itself."""
    stop = RunStop(asyncio.Event(), None)

    async def body() -> str:
        try:
            async with asyncio.timeout(0.01):
                await asyncio.Event().wait()
        except TimeoutError:
            return "timed out"
        return "never"

    assert await stop.run(body(), "jobrelay-job:j1:t") == "timed out"
    assert not stop.stopped
