"""The worker's lease renewer stops between renewals, never inside one.

A renewal cancelled inside its statement makes SQLAlchemy throw the connection away; on
aiosqlite that leaves a close task behind that can hang the event loop's shutdown. Neither a
claim's release (its outcome committed) nor the renewer's close cancels a renewal under way.
Deterministic: the renewal is held inside the store until the test lets it go.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from types import SimpleNamespace
from typing import Any

import pytest

from jobrelay.errors import StoreBusy, StoreError
from jobrelay.storage.records import Renewed
from jobrelay.storage.store import Claim
from jobrelay.worker.leases import LeaseRenewer


class HeldRenewal:
    renewal_blocks_takeover = False

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


class Answering:
    """A store whose every renewal gives ``answer`` (a ``Renewed``) or raises it."""

    renewal_blocks_takeover = False

    def __init__(self, answer: Renewed | BaseException) -> None:
        self.answer = answer
        self.calls = 0
        self.answered = asyncio.Event()
        self._called = asyncio.Condition()

    async def renew_leases(
        self, claims: Sequence[Claim], lease: timedelta, now: datetime
    ) -> Renewed:
        self.calls += 1
        if self.calls >= 2:
            self.answered.set()
        async with self._called:
            self._called.notify_all()
        if isinstance(self.answer, BaseException):
            raise self.answer
        return self.answer

    async def called(self, times: int) -> None:
        """Until the store has been asked ``times`` times in all (20 s at most)."""
        async with asyncio.timeout(20), self._called:
            await self._called.wait_for(lambda: self.calls >= times)


async def test_a_renewal_racing_its_own_completion_reports_no_lost_lease(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The work is done and its completion committed just before the renewal ran: the
    renewal no longer finds the claim running. Not a lost lease (the fenced outcome write
    says whether it won): no warning, nothing set."""
    store = Answering(Renewed())
    renewer = LeaseRenewer(
        SimpleNamespace(store=store, clock=lambda: datetime.now(UTC)),  # type: ignore[arg-type]
        timedelta(seconds=30),
    )
    work = asyncio.create_task(asyncio.sleep(0))
    await work  # the work is done: its outcome is being written
    lost = asyncio.Event()
    caplog.set_level(logging.DEBUG, logger="jobrelay.worker")
    renewer.hold(Claim("j", 1, "w"), time.monotonic() - 10, work, lost)
    await store.called(1)
    await renewer.close()
    assert not lost.is_set()
    assert [r for r in caplog.records if getattr(r, "event", None) == "lease_lost"] == []


async def test_a_failed_renewal_says_why_even_when_the_error_has_no_text(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """``TimeoutError()`` has an empty text: the line names the error's kind instead."""
    store = Answering(TimeoutError())
    renewer = LeaseRenewer(
        SimpleNamespace(store=store, clock=lambda: datetime.now(UTC)),  # type: ignore[arg-type]
        timedelta(seconds=30),
    )
    work = asyncio.create_task(asyncio.Event().wait())
    caplog.set_level(logging.WARNING, logger="jobrelay.worker")
    renewer.hold(Claim("j", 1, "w"), time.monotonic() - 10, work, asyncio.Event())
    await asyncio.wait_for(store.answered.wait(), 10)
    await renewer.close()
    work.cancel()
    failed = [r for r in caplog.records if getattr(r, "event", None) == "lease_renew_failed"]
    assert failed
    for record in failed:
        assert "TimeoutError" in record.getMessage(), record.getMessage()


async def test_a_renewal_that_cannot_reach_the_database_stops_the_run() -> None:
    """The database cannot be reached at all: once the lease may have ended, the run is
    stopped (another worker may take the job over), as before."""
    store = Answering(StoreError("database write failed: unable to open database file"))
    renewer = LeaseRenewer(
        SimpleNamespace(store=store, clock=lambda: datetime.now(UTC)),  # type: ignore[arg-type]
        timedelta(seconds=3),
    )
    work = asyncio.create_task(asyncio.Event().wait())
    lost = asyncio.Event()
    renewer.hold(Claim("j", 1, "w"), time.monotonic() - 1, work, lost)
    await asyncio.wait_for(lost.wait(), 20)
    with contextlib.suppress(asyncio.CancelledError):
        await asyncio.wait_for(work, 5)
    assert work.cancelled()
    await renewer.close()


async def test_a_renewal_waiting_for_the_write_lock_stops_nothing() -> None:
    """SQLite answered "locked" (another connection holds the write lock past the busy
    timeout): nobody can take the claim over meanwhile either, so however long it lasts,
    the run goes on."""
    store = Answering(StoreBusy("database write failed: database is locked"))
    renewer = LeaseRenewer(
        SimpleNamespace(store=store, clock=lambda: datetime.now(UTC)),  # type: ignore[arg-type]
        timedelta(seconds=1),
    )
    work = asyncio.create_task(asyncio.Event().wait())
    lost = asyncio.Event()
    renewer.hold(Claim("j", 1, "w"), time.monotonic() - 5, work, lost)  # long past its end
    await store.called(5)
    assert not lost.is_set() and not work.done()
    store.answer = Renewed([Claim("j", 1, "w")])
    await store.called(store.calls + 1)
    assert not lost.is_set() and not work.done()
    await renewer.close()
    work.cancel()


class SlowSkipping:
    """PostgreSQL's answer for a claim whose row another transaction holds locked (its own
    completion): skipped, neither renewed nor lost; each answer takes ``delay`` seconds (a
    busy database), more than the renewer's margin and well inside the lease."""

    renewal_blocks_takeover = False

    def __init__(self, delay: float) -> None:
        self.delay = delay
        self.calls = 0
        self._called = asyncio.Condition()

    async def renew_leases(
        self, claims: Sequence[Claim], lease: timedelta, now: datetime
    ) -> Renewed:
        await asyncio.sleep(self.delay)
        self.calls += 1
        async with self._called:
            self._called.notify_all()
        return Renewed((), (), claims)

    async def called(self, times: int) -> None:
        async with asyncio.timeout(30), self._called:
            await self._called.wait_for(lambda: self.calls >= times)


async def test_a_claim_skipped_past_its_lease_is_not_lost_to_a_slow_answer() -> None:
    """A row locked past the lease (a completion's slow upload) leaves its claim's lease
    unrenewed; the renewals after it must still be judged by the database's answer, not by
    a client timeout computed from that stale lease (it was the margin: 0.3 s here, so a
    0.5 s answer lost the claim although the database said it still held the job)."""
    store = SlowSkipping(delay=0.5)
    renewer = LeaseRenewer(
        SimpleNamespace(store=store, clock=lambda: datetime.now(UTC)),  # type: ignore[arg-type]
        timedelta(seconds=3),
    )
    work = asyncio.create_task(asyncio.Event().wait())
    lost = asyncio.Event()
    renewer.hold(Claim("j", 1, "w"), time.monotonic() - 5, work, lost)  # long past its end
    answered, gone = asyncio.create_task(store.called(3)), asyncio.create_task(lost.wait())
    await asyncio.wait([answered, gone], timeout=30, return_when="FIRST_COMPLETED")
    gone.cancel()
    assert not lost.is_set(), "the claim was lost to a client timeout"
    assert answered.done() and not work.done()
    await renewer.close()
    work.cancel()
