"""A suspect runs alone in its worker: after the runs going, before any new one."""

from __future__ import annotations

import asyncio

from jobrelay.worker.isolation import Isolation


async def _settle() -> None:
    """Let every ready task run until it waits (no I/O here: a few loop turns suffice)."""
    for _ in range(20):
        await asyncio.sleep(0)


async def test_a_suspect_waits_for_the_runs_going_and_holds_back_new_ones() -> None:
    isolation = Isolation(jitter=0)
    order: list[str] = []
    first_may_end = asyncio.Event()
    suspect_runs = asyncio.Event()
    suspect_may_end = asyncio.Event()

    async def healthy(name: str, until: asyncio.Event | None = None) -> None:
        async with isolation.shared():
            order.append(f"{name} starts")
            if until is not None:
                await until.wait()
            order.append(f"{name} ends")

    async def suspect() -> None:
        async with isolation.alone():
            order.append("suspect starts")
            suspect_runs.set()
            await suspect_may_end.wait()
            order.append("suspect ends")

    going = asyncio.create_task(healthy("going", first_may_end))
    await _settle()
    alone = asyncio.create_task(suspect())
    await _settle()  # the suspect is waiting for its turn
    later = asyncio.create_task(healthy("later"))
    await _settle()
    assert order == ["going starts"]  # neither the suspect nor a newcomer started
    first_may_end.set()
    await asyncio.wait_for(suspect_runs.wait(), 5)
    assert isolation.running == 0  # nothing runs beside it
    suspect_may_end.set()
    await asyncio.wait_for(asyncio.gather(going, alone, later), 5)
    assert order == [
        "going starts",
        "going ends",
        "suspect starts",
        "suspect ends",
        "later starts",
        "later ends",
    ]


async def test_runs_go_together_while_no_suspect_waits() -> None:
    isolation = Isolation()
    together = asyncio.Barrier(3)

    async def healthy() -> None:
        async with isolation.shared():
            await together.wait()  # all three inside at once, or this never returns

    await asyncio.wait_for(asyncio.gather(*(healthy() for _ in range(3))), 5)
    assert isolation.running == 0


async def test_an_idle_worker_gives_a_suspect_its_turn_at_once() -> None:
    isolation = Isolation(jitter=60)  # a jitter would time this out: none when idle

    async def suspect() -> None:
        async with isolation.alone():
            pass

    await asyncio.wait_for(suspect(), 5)
