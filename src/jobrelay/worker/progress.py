"""A running attempt's progress: advisory, never the job's failure (issue 34, item 6).

A progress write is fenced on the claim like every write of the run, but nothing depends on
it landing: a write the database does not take (a blip, a dropped connection) is logged and
written later with the newest figures (a retry after a pause, or the next report, whichever
comes first), and once more just before the outcome is committed. The job body never sees
the failure, so a 0.3 s blip does not cost every job that reports progress an attempt. Only
the database's answer "another claim holds the job" stops the run, as a lost lease does.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from jobrelay.errors import StoreError
from jobrelay.runtime.wiring import Runtime
from jobrelay.storage.store import Claim

log = logging.getLogger("jobrelay.worker")

_RETRY_FIRST_SECONDS = 0.5  # then doubling: a blip is over by then, an outage is not hammered
_RETRY_MAX_SECONDS = 5.0
_FLUSH_PAUSES = (0.25, 0.5, 1.0, 0.0)  # the pause after each failed try of the last write


class Progress:
    """The progress reports of one attempt; ``report`` is what ``ctx.progress`` calls."""

    def __init__(self, rt: Runtime, claim: Claim, lost: Callable[[], None]) -> None:
        self.rt = rt
        self.claim = claim
        self._lost = lost  # the claim is gone: stop the run as a lost lease would
        self._pending: tuple[int, int] | None = None  # the newest figures not yet written
        self._retry: asyncio.Task[None] | None = None
        self._stopping = asyncio.Event()  # the retry stops, between two writes

    async def report(self, done: int, total: int) -> None:
        """Write ``done``/``total`` now, or leave it to the retry under way; raises
        ``CancelledError`` only when another claim holds the job."""
        self._pending = (done, total)
        if self._retry is not None and not self._retry.done():
            return  # the retry writes the newest figures
        written = await self._write()
        if written is None:
            self._retry = asyncio.create_task(self._retry_until_written())
        elif not written:
            raise asyncio.CancelledError

    async def flush(self) -> None:
        """A write still pending gets a few more tries before the outcome is committed (the
        outcome's own write waits out an outage anyway), then is given up with the log.

        A retry's write under way is waited for, never cancelled: cancelled inside its
        statement, the driver throws the connection away (on aiosqlite that leaves a close
        task that can hang the loop's shutdown). Its statement is bounded by the database's
        own timeouts."""
        retry = self._stop_retry()
        if retry is not None:
            await asyncio.wait({retry})  # cancelled meanwhile, the retry still ends by itself
            self._retry = None
        for pause in _FLUSH_PAUSES:
            if self._pending is None or await self._write() is not None:
                return
            await asyncio.sleep(pause)

    def close(self) -> None:
        """The attempt ended: no more retries; a write under way finishes by itself."""
        self._stop_retry()

    def _stop_retry(self) -> asyncio.Task[None] | None:
        self._stopping.set()
        return self._retry  # kept referenced until it ends

    async def _write(self) -> bool | None:
        """True: written (or nothing to write); False: the claim is lost; None: not taken."""
        figures = self._pending
        if figures is None:
            return True
        try:
            held = await self.rt.store.report_progress(self.claim, *figures, self.rt.clock())
        except StoreError as exc:
            log.warning(
                "progress not recorded, the database did not take it (written later): %s",
                str(exc) or type(exc).__name__,
                extra={"event": "progress_held", "jobId": self.claim.job_id},
            )
            return None
        if self._pending == figures:
            self._pending = None
        if not held:
            self._lost()
            return False
        return True

    async def _retry_until_written(self) -> None:
        pause = _RETRY_FIRST_SECONDS
        while self._pending is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), pause)
            if self._stopping.is_set():
                return
            pause = min(pause * 2, _RETRY_MAX_SECONDS)
            if await self._write() is False:
                return
