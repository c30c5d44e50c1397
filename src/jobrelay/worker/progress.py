"""A running attempt's progress: advisory, never the job's failure (issue 34, item 6), and
no commit of its own for a job that ends soon (issue 41, item 4).

A report is written by a task, not by the report: at the earliest ``_FIRST_WRITE_SECONDS``
after the claim, then at most every ``_WRITE_EVERY_SECONDS``, with the newest figures. What
is still unwritten when the job succeeds is written by the success's own statement
(``CompleteRequest.progress``); before another outcome, it is written once more (``flush``).
So an export of a few milliseconds costs no progress commit, and one of minutes shows its
progress within a second, as before.

A progress write is fenced on the claim like every write of the run, but nothing depends on
it landing: a write the database does not take (a blip, a dropped connection) is logged and
tried again after a pause with the newest figures. The job body never sees the failure, so
a 0.3 s blip does not cost every job that reports progress an attempt. Only the database's
answer "another claim holds the job" stops the run, as a lost lease does.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from jobrelay.errors import StoreError
from jobrelay.runtime.wiring import Runtime
from jobrelay.storage.store import Claim

log = logging.getLogger("jobrelay.worker")

# A job done within this of its claim writes its progress with its success, in one commit.
_FIRST_WRITE_SECONDS = 0.25
_WRITE_EVERY_SECONDS = 0.5  # then at most this often: the figures are the newest at each
_RETRY_FIRST_SECONDS = 0.5  # then doubling: a blip is over by then, an outage is not hammered
_RETRY_MAX_SECONDS = 5.0
_FLUSH_PAUSES = (0.25, 0.5, 1.0, 0.0)  # the pause after each failed try of the last write


class Progress:
    """The progress reports of one attempt; ``report`` is what ``ctx.progress`` calls."""

    def __init__(self, rt: Runtime, claim: Claim, lost: Callable[[], None]) -> None:
        self.rt = rt
        self.claim = claim
        self._lost = lost  # the claim is gone: stop the run as a lost lease would
        self._gone = False
        self._pending: tuple[int, int] | None = None  # the newest figures not yet written
        self._writer: asyncio.Task[None] | None = None
        # The writer is started by a timer once a write is due: a job done before then
        # never has one (no task, no wait: measured, ~2 % of a drain worker's samples).
        self._timer: asyncio.TimerHandle | None = None
        self._stopping = asyncio.Event()  # the writer stops, between two writes
        self._next_write = time.monotonic() + _FIRST_WRITE_SECONDS

    async def report(self, done: int, total: int) -> None:
        """Keep ``done``/``total`` for the writer (started when a write is due, unless one
        is under way); raises ``CancelledError`` once a write found another claim holding
        the job."""
        if self._gone:
            raise asyncio.CancelledError
        self._pending = (done, total)
        if self._timer is not None or self._stopping.is_set():
            return
        if self._writer is None or self._writer.done():
            wait = max(self._next_write - time.monotonic(), 0.0)
            self._timer = asyncio.get_running_loop().call_later(wait, self._start_writer)

    def _start_writer(self) -> None:
        self._timer = None
        if not self._stopping.is_set() and self._pending is not None:
            self._writer = asyncio.create_task(self._write_when_due())

    async def take(self) -> tuple[int, int] | None:
        """The figures not yet written, for the success's own statement; the writer is
        stopped first (a write under way is waited for, never cancelled)."""
        await self._stop_writer()
        figures, self._pending = self._pending, None
        return figures

    async def flush(self) -> None:
        """A write still pending gets a few more tries before an outcome other than a
        success is committed (the outcome's own write waits out an outage anyway), then is
        given up with the log.

        A write under way is waited for, never cancelled: cancelled inside its statement,
        the driver throws the connection away (on aiosqlite that leaves a close task that
        can hang the loop's shutdown). Its statement is bounded by the database's own
        timeouts."""
        await self._stop_writer()
        for pause in _FLUSH_PAUSES:
            if self._pending is None or await self._write() is not None:
                return
            await asyncio.sleep(pause)

    def close(self) -> None:
        """The attempt ended: no more writes; a write under way finishes by itself."""
        self._stop_writes()

    def _stop_writes(self) -> None:
        """No write starts from here on: the timer is cancelled, a writer stops at its next
        wait."""
        self._stopping.set()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    async def _stop_writer(self) -> None:
        self._stop_writes()
        writer, self._writer = self._writer, None
        if writer is not None:
            await asyncio.wait({writer})  # cancelled meanwhile, the writer still ends by itself

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
            self._gone = True
            self._lost()
            return False
        return True

    async def _write_when_due(self) -> None:
        """Write the newest figures once due, again after a pause while the database does
        not take them, until nothing is pending or the attempt ends."""
        pause = _RETRY_FIRST_SECONDS
        while self._pending is not None:
            wait = self._next_write - time.monotonic()
            if wait > 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stopping.wait(), wait)
            if self._stopping.is_set():
                return
            written = await self._write()
            if written is False:
                return
            if written is None:
                self._next_write = time.monotonic() + pause
                pause = min(pause * 2, _RETRY_MAX_SECONDS)
            else:
                self._next_write = time.monotonic() + _WRITE_EVERY_SECONDS
