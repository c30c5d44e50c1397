"""The worker's threads for plain ``def`` jobs: taken before the claim, abandoned, replaced.

A ``def`` job's delivery takes a thread (``take``) before its job is claimed, so a job that
waits for a thread waits unclaimed: no lease, no attempt spent, no time limit running (its
limit starts with its body, which starts at once on the thread it holds). The body runs on
that thread (``ThreadSlot.run``); a claim that is not won gives the thread back unused.

A thread cannot be interrupted. When an attempt ends without its body (its time limit, a
lost lease, an operator's cancel, the worker stopping), the body is *abandoned*: it runs on
until it returns, and what it returns is discarded. Each abandonment is counted
(``jobrelay_sync_threads_abandoned_total``, and ``..._running`` while it runs) and logged
at WARNING naming the job. Up to ``JOBRELAY_SYNC_ABANDONED_MAX`` abandoned bodies still
running, each is replaced: its slot is given to a new thread, so ``JOBRELAY_SYNC_THREADS``
jobs keep running beside them. Past that cap an abandoned body keeps its slot until it
returns; once every slot is held so, ``def`` jobs wait unclaimed and the worker says so at
ERROR (restart it to get its threads back; its ``async def`` jobs run on meanwhile: a
delivery waiting for a thread gives its job slot up, ``Slots.set_aside``, and keeps only its
place in the broker window).
The executor is sized for both (threads + cap), so a taken slot always has a thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
from collections.abc import Callable
from typing import Any

from jobrelay.observe.metrics import Metrics
from jobrelay.worker.slots import delivery_slots

log = logging.getLogger("jobrelay.worker")

THREAD_PREFIX = "jobrelay-sync"


class SyncThreads:
    """One worker's bounded pool of threads for ``def`` job bodies."""

    def __init__(self, size: int, abandoned_max: int, metrics: Metrics) -> None:
        self.size = size
        self.abandoned_max = abandoned_max
        self.metrics = metrics
        self.held = 0  # slots taken: for a claim, by a body, or by an abandoned body past the cap
        self.replaced = 0  # abandoned bodies still running whose slot a new thread took
        self.capped = 0  # abandoned bodies still running that keep their slot
        self._freed = asyncio.Event()
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._said_exhausted = False

    async def take_aside(self) -> ThreadSlot:
        """``take``, for a delivery holding a job slot: while no thread is free, it gives
        its slot up (``Slots.set_aside``), so the worker's async def jobs keep running, and
        takes one back once it has its thread, before it is claimed."""
        slots, task = delivery_slots.get(), asyncio.current_task()
        if slots is None or task is None or self.held < self.size or task in slots.lent:
            # A delivery that lent its slot and runs again (its completion failed) runs in
            # the lent slot, whose borrower waits for its outcome: it takes no other.
            return await self.take()
        slots.set_aside(task)
        thread = await self.take()
        try:
            await slots.take_back(task)
        except BaseException:
            thread.release()
            raise
        return thread

    async def take(self) -> ThreadSlot:
        """Wait for a free thread and hold it for the next ``def`` job's claim and body."""
        while self.held >= self.size:
            if self.capped >= self.size and not self._said_exhausted:
                self._said_exhausted = True
                log.error(
                    "no thread for def jobs: %d abandoned def job bodies still hold every "
                    "thread, past JOBRELAY_SYNC_ABANDONED_MAX=%d; def jobs wait unclaimed until "
                    "one returns (restart the worker to get its threads back)",
                    self.capped + self.replaced,
                    self.abandoned_max,
                    extra={"event": "sync_threads_exhausted", "abandoned": self.capped},
                )
            self._freed.clear()
            await self._freed.wait()
        self.held += 1
        return ThreadSlot(self)

    def close(self) -> None:
        """The worker stopped: no new body starts; running ones end by themselves."""
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)

    def _executor_for_bodies(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(
                self.size + self.abandoned_max, thread_name_prefix=THREAD_PREFIX
            )
        return self._executor

    def _free(self) -> None:
        self.held -= 1
        self._said_exhausted = False
        self._freed.set()


class ThreadSlot:
    """One taken thread: ``run`` a body on it once, or ``release`` it unused."""

    def __init__(self, pool: SyncThreads) -> None:
        self._pool = pool
        self._state = "taken"  # → running → ended, or → replaced / capped → ended

    def release(self) -> None:
        """Give the thread back if no body was started on it (a claim not won)."""
        if self._state == "taken":
            self._state = "ended"
            self._pool._free()

    async def run(self, job_id: str, body: Callable[[], Any]) -> Any:
        """Run ``body`` on this thread; cancelled while it runs, the body is abandoned."""
        assert self._state == "taken", self._state
        loop = asyncio.get_running_loop()
        future = self._pool._executor_for_bodies().submit(body)
        self._state = "running"

        def returned(_: concurrent.futures.Future[Any]) -> None:  # on the body's thread
            with contextlib.suppress(RuntimeError):  # the loop is closed: the worker is gone
                loop.call_soon_threadsafe(self._ended, job_id)

        future.add_done_callback(returned)
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            if not future.cancel() and not future.done():  # cancel(): only if not started
                self._abandon(job_id)
            raise

    def _abandon(self, job_id: str) -> None:
        pool = self._pool
        pool.metrics.threads_abandoned.inc()
        pool.metrics.threads_abandoned_running.inc()
        replaced = pool.replaced < pool.abandoned_max
        if replaced:
            self._state = "replaced"
            pool.replaced += 1
            pool._free()
        else:
            self._state = "capped"
            pool.capped += 1
        log.warning(
            "def job %s abandoned in its thread: its attempt ended, its body runs on until it "
            "returns (a thread cannot be interrupted); %d abandoned bodies running, %s",
            job_id,
            pool.replaced + pool.capped,
            "its thread replaced"
            if replaced
            else f"past JOBRELAY_SYNC_ABANDONED_MAX={pool.abandoned_max}: it keeps its thread",
            extra={
                "event": "thread_abandoned",
                "jobId": job_id,
                "abandoned": pool.replaced + pool.capped,
                "replaced": replaced,
            },
        )

    def _ended(self, job_id: str) -> None:
        pool = self._pool
        state, self._state = self._state, "ended"
        if state == "running":
            pool._free()
            return
        pool.metrics.threads_abandoned_running.dec()
        if state == "replaced":
            pool.replaced -= 1
        else:
            pool.capped -= 1
            pool._free()
        log.info(
            "abandoned def job %s returned; its thread is free",
            job_id,
            extra={"event": "thread_returned", "jobId": job_id},
        )
