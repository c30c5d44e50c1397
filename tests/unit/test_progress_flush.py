"""A progress write under way is never cancelled inside its statement (issue 34): a driver
cancelled mid-statement throws its connection away (aiosqlite then leaves a close task that
can hang shutdown). ``flush`` before the outcome waits for the retry's write under way, and
``close`` stops the retry between writes only."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from types import SimpleNamespace
from typing import Any

from jobrelay.errors import StoreError
from jobrelay.library import sync_context
from jobrelay.library.sync_context import SyncJobContext
from jobrelay.worker import progress as progress_module
from jobrelay.worker.progress import Progress


class _Store:
    """Progress writes: the first fails (a blip), the second (the retry's) hangs in its
    statement until ``release``; later ones land at once."""

    def __init__(self) -> None:
        self.calls = 0
        self.in_statement = asyncio.Event()
        self.release = asyncio.Event()
        self.cancelled_inside = False
        self.written: list[tuple[int, int]] = []
        self.landed = asyncio.Event()

    async def report_progress(self, claim: Any, done: int, total: int, now: datetime) -> bool:
        self.calls += 1
        if self.calls == 1:
            raise StoreError("a blip")
        if self.calls == 2:
            self.in_statement.set()
            try:
                await self.release.wait()
            except asyncio.CancelledError:
                self.cancelled_inside = True
                raise
        self.written.append((done, total))
        self.landed.set()
        return True


def _progress(store: _Store) -> Progress:
    rt: Any = SimpleNamespace(store=store, clock=lambda: datetime.now(UTC))
    claim: Any = SimpleNamespace(job_id="j1", attempt=1)
    return Progress(rt, claim, lambda: None)


async def _retry_in_its_statement(store: _Store, progress: Progress, monkeypatch: Any) -> None:
    monkeypatch.setattr(progress_module, "_RETRY_FIRST_SECONDS", 0.01)
    await progress.report(1, 2)  # not taken: the retry writes it later
    await asyncio.wait_for(store.in_statement.wait(), 30)


async def test_flush_waits_for_the_retrys_write_under_way(monkeypatch: Any) -> None:
    store = _Store()
    progress = _progress(store)
    await _retry_in_its_statement(store, progress, monkeypatch)

    flushing = asyncio.create_task(progress.flush())
    await asyncio.sleep(0.05)  # flush runs meanwhile; the write under way must be left alone
    store.release.set()
    await asyncio.wait_for(flushing, 30)

    assert not store.cancelled_inside
    assert store.written == [(1, 2)]  # written once, by the retry


async def test_close_leaves_the_write_under_way_to_finish(monkeypatch: Any) -> None:
    store = _Store()
    progress = _progress(store)
    await _retry_in_its_statement(store, progress, monkeypatch)

    progress.close()  # the attempt was stopped
    await asyncio.sleep(0.05)
    store.release.set()
    await asyncio.wait_for(store.landed.wait(), 30)  # the retry's write ends by itself

    assert not store.cancelled_inside
    assert store.written == [(1, 2)]


async def test_a_def_jobs_progress_stops_waiting_without_cancelling_the_write(
    monkeypatch: Any,
) -> None:
    monkeypatch.setattr(sync_context, "PROGRESS_WAIT_SECONDS", 0.05)
    in_statement, release, landed = asyncio.Event(), asyncio.Event(), asyncio.Event()
    cancelled_inside: list[bool] = []

    async def slow_progress(done: int, total: int) -> None:  # a write the database holds
        in_statement.set()
        try:
            await release.wait()
        except asyncio.CancelledError:
            cancelled_inside.append(True)
            raise
        landed.set()

    ctx: Any = SimpleNamespace(
        job_id="j1", job_type="t", attempt=1, params=None, account=None, log=None,
        progress=slow_progress,
    )  # fmt: skip
    sync_ctx = SyncJobContext(ctx, asyncio.get_running_loop())
    await asyncio.to_thread(sync_ctx.progress, 1, 2)  # gives up waiting, the body goes on
    assert in_statement.is_set()
    await asyncio.sleep(0.05)  # what the thread left behind runs meanwhile
    release.set()
    await asyncio.wait_for(landed.wait(), 30)  # the write lands after all
    assert cancelled_inside == []
