"""The worker's lease renewer stops between renewals, never inside one.

A renewal cancelled inside its statement makes SQLAlchemy throw the connection away; on
aiosqlite that leaves a close task behind that can hang the event loop's shutdown. Neither a
claim's release (its outcome committed) nor the renewer's close cancels a renewal under way.
Deterministic: the renewal is held inside the store until the test lets it go.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from types import SimpleNamespace
from typing import Any

from jobrelay.roles.leases import LeaseRenewer
from jobrelay.storage.records import Renewed
from jobrelay.storage.store import Claim


class HeldRenewal:
    def __init__(self) -> None:
        self.entered = asyncio.Event()
        self.release = asyncio.Event()
        self.cancelled = False
        self.sizes: list[int] = []

    async def renew_leases(
        self, claims: Sequence[Claim], lease: timedelta, now: datetime
    ) -> Renewed:
        self.sizes.append(len(claims))
        self.entered.set()
        try:
            await self.release.wait()
        except asyncio.CancelledError:
            self.cancelled = True
            raise
        return Renewed(claims)


def _renewer(store: HeldRenewal) -> LeaseRenewer:
    rt: Any = SimpleNamespace(store=store, clock=lambda: datetime.now(UTC))
    return LeaseRenewer(rt, timedelta(seconds=30))


async def test_a_renewal_under_way_finishes_before_the_renewer_closes() -> None:
    store = HeldRenewal()
    renewer = _renewer(store)
    work = asyncio.create_task(asyncio.Event().wait())
    # Granted 10 s ago with a 30 s lease: the first renewal (at a third) is due at once.
    for attempt in (1, 2):
        claim = Claim(f"j{attempt}", 1, "w")
        renewer.hold(claim, time.monotonic() - 10, work, asyncio.Event())
    await asyncio.wait_for(store.entered.wait(), 5)
    renewer.release(Claim("j1", 1, "w"))  # an outcome committed meanwhile: nothing cancelled

    closing = asyncio.create_task(renewer.close())
    await asyncio.sleep(0)
    assert not closing.done()
    store.release.set()
    await asyncio.wait_for(closing, 5)

    assert not store.cancelled and store.sizes == [2]  # both claims in one statement
    assert not work.done()  # a released or renewed claim's work is never cancelled
    work.cancel()


async def test_an_idle_renewer_ends_with_its_last_claim() -> None:
    store = HeldRenewal()
    renewer = _renewer(store)
    work = asyncio.create_task(asyncio.Event().wait())
    claim = Claim("j", 1, "w")
    renewer.hold(claim, time.monotonic(), work, asyncio.Event())
    await asyncio.sleep(0)
    renewer.release(claim)
    await asyncio.wait_for(renewer.close(), 5)
    assert store.sizes == [] and not store.cancelled
    work.cancel()
