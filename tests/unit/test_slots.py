"""A worker's job slots and the loans of a slot whose job is committing (issue 41)."""

from __future__ import annotations

import asyncio

from jobrelay.batching import Batcher
from jobrelay.worker.slots import Slots


async def _idle() -> None:
    await asyncio.Event().wait()


async def test_a_lent_slot_starts_the_next_delivery_whose_claim_meets_the_lenders_completion() -> (
    None
):
    """One slot. The first job's code returns and its completion waits for a statement in
    flight: the next delivery is started in the lent slot, and its claim goes in the SAME
    statement as that completion, never in one of its own before it."""
    batches: list[list[str]] = []
    release, sent = asyncio.Event(), asyncio.Event()

    async def run(requests: list[str]) -> list[str]:
        batches.append(list(requests))
        sent.set()
        await release.wait()
        return [f"done:{r}" for r in requests]

    batcher: Batcher[str, str] = Batcher(run, key=lambda r: r.split(":")[1], kind=lambda r: r[0])
    busy: set[asyncio.Task[None]] = set()
    slots = Slots(1, busy)
    await slots.reserve()
    lender = asyncio.create_task(_idle())
    slots.started(lender)
    assert slots.free == 0
    in_flight = asyncio.create_task(batcher.submit("d:0"))  # another job's, in flight
    await sent.wait()

    slots.lend(lender, "d:1")
    completion = asyncio.create_task(batcher.submit("d:1"))
    async with asyncio.timeout(5):
        await slots.reserve()  # the lent slot
    borrower = asyncio.create_task(_idle())
    slots.started(borrower)
    assert slots.free == 0
    gate = slots.gate_of(borrower)
    assert gate is not None
    claim = asyncio.create_task(batcher.submit("c:2", after=gate))
    await asyncio.sleep(0)
    release.set()
    assert await asyncio.gather(in_flight, completion, claim) == [
        "done:d:0",
        "done:d:1",
        "done:c:2",
    ]
    assert batches == [["d:0"], ["d:1", "c:2"]]
    slots.met(borrower)
    slots.work_done(lender)  # its outcome committed: the lent slot is the borrower's now
    assert slots.free == 0 and slots.gate_of(borrower) is None
    for task in (lender, borrower):
        task.cancel()
    await asyncio.gather(lender, borrower, return_exceptions=True)
    await asyncio.sleep(0)
    assert slots.free == 1


async def _lent_and_borrowed(slots: Slots) -> tuple[asyncio.Task[None], asyncio.Task[None]]:
    """A delivery started in ``slots``' one slot whose code returned (it lent its slot), and
    the delivery started in the lent slot."""
    await slots.reserve()
    lender = asyncio.create_task(_idle())
    slots.started(lender)
    slots.lend(lender, "d:1")
    await slots.reserve()
    borrower = asyncio.create_task(_idle())
    slots.started(borrower)
    return lender, borrower


async def test_a_loan_a_borrower_gives_up_unmet_goes_to_the_next_reservation() -> None:
    """A delivery started in a lent slot that sets it aside (a def job waiting for a thread)
    before its claim: the next delivery in that slot waits for the same lender."""
    slots = Slots(1, set())
    lender, first = await _lent_and_borrowed(slots)
    gate = slots.gate_of(first)
    assert gate is not None
    slots.set_aside(first)
    assert slots.gate_of(first) is None and slots.free == 1
    await slots.reserve()
    second = asyncio.create_task(_idle())
    slots.started(second)
    assert slots.gate_of(second) is gate and slots.free == 0
    slots.work_done(lender)
    assert gate.is_open and slots.gate_of(second) is None
    for task in (lender, first, second):
        task.cancel()
    await asyncio.gather(lender, first, second, return_exceptions=True)


async def test_a_lender_that_ends_without_committing_opens_its_loan() -> None:
    """A lender cancelled (the worker stopping) before its outcome: its slot is free as
    before, and nothing waits on its loan for ever."""
    slots = Slots(1, set())
    lender, borrower = await _lent_and_borrowed(slots)
    gate = slots.gate_of(borrower)
    assert gate is not None
    lender.cancel()
    await asyncio.gather(lender, return_exceptions=True)
    await asyncio.sleep(0)
    assert gate.is_open and slots.free == 0
    borrower.cancel()
    await asyncio.gather(borrower, return_exceptions=True)
