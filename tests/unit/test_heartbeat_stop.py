"""The end of an attempt stops its heartbeat between renewals, never inside one.

A renewal cancelled inside its statement makes SQLAlchemy throw the connection away; on
aiosqlite that left a close task behind that hung the event loop's shutdown (a test
teardown stuck for 90 s; a worker's exit the same way). Deterministic: the renewal is held
inside the store until the attempt has asked the heartbeat to stop.
"""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime, timedelta
from types import SimpleNamespace
from typing import Any

from jobrelay.roles.attempt import AttemptRun


class HeldRenewal:
    def __init__(self) -> None:
        self.entered = asyncio.Event()
        self.release = asyncio.Event()
        self.cancelled = False
        self.finished = 0

    async def renew_lease(self, claim: Any, lease: timedelta, now: datetime) -> bool:
        self.entered.set()
        try:
            await self.release.wait()
        except asyncio.CancelledError:
            self.cancelled = True
            raise
        self.finished += 1
        return True


def _attempt(store: HeldRenewal) -> AttemptRun:
    rt: Any = SimpleNamespace(store=store, clock=lambda: datetime.now(UTC))
    return AttemptRun(
        rt,
        registry=None,  # type: ignore[arg-type]
        worker_id="w",
        lease=timedelta(seconds=30),
        settle=None,  # type: ignore[arg-type]
        wait_for_database=None,  # type: ignore[arg-type]
    )


async def test_a_renewal_under_way_finishes_before_the_heartbeat_ends() -> None:
    store = HeldRenewal()
    run = _attempt(store)
    claim = SimpleNamespace(job_id="j", attempt=1)
    work = asyncio.create_task(asyncio.Event().wait())
    # Granted 10 s ago with a 30 s lease: the first renewal (at a third) is due at once.
    beat = run._heartbeat(claim, time.monotonic() - 10, work, asyncio.Event())  # type: ignore[arg-type]
    run._renewing = asyncio.create_task(beat)
    await asyncio.wait_for(store.entered.wait(), 5)

    stopping = asyncio.create_task(run._stop_renewing())
    await asyncio.sleep(0)  # the stop has been asked for while the renewal is inside the store
    assert not stopping.done()
    store.release.set()
    await asyncio.wait_for(stopping, 5)

    assert not store.cancelled and store.finished == 1
    assert run._renewing is None
    work.cancel()


async def test_an_idle_heartbeat_ends_at_once_without_renewing() -> None:
    store = HeldRenewal()
    run = _attempt(store)
    claim = SimpleNamespace(job_id="j", attempt=1)
    work = asyncio.create_task(asyncio.Event().wait())
    beat = run._heartbeat(claim, time.monotonic(), work, asyncio.Event())  # type: ignore[arg-type]
    run._renewing = asyncio.create_task(beat)
    await asyncio.sleep(0)
    await asyncio.wait_for(run._stop_renewing(), 5)
    assert not store.entered.is_set() and not store.cancelled
    work.cancel()
