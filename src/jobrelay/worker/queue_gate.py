"""Which of its queues a worker may consume now: the operators' pause flags, polled.

A worker reads ``queue_pauses`` every ``queue_pause_poll_seconds`` (default 2 s) and keeps
one pair of events per queue: ``running`` is set while it may consume the queue, ``paused``
while it may not. Its consumer for a paused queue leaves (``basic.cancel`` on RabbitMQ, the
claims given back on the local transport, so what was prefetched and not started goes back
to the broker unacked, not failed); the work in flight finishes as usual; on resume a new
consumer starts. A poll that fails (the database is away) keeps the last answer: the
worker's own outage handling decides what happens then. Until a first poll has succeeded
there is no answer, and a queue with no answer counts as paused: a worker whose first read
fails does not start consuming a queue an operator paused; it retries every poll.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence

from jobrelay.errors import StoreError

log = logging.getLogger("jobrelay.worker")


class QueueGate:
    def __init__(
        self, read: Callable[[], Awaitable[set[str]]], queues: Sequence[str], poll: float
    ) -> None:
        self._read = read
        self._poll = poll
        # Neither set: not known yet (no read has succeeded), so not consumed.
        self._running = {q: asyncio.Event() for q in queues}
        self._paused = {q: asyncio.Event() for q in queues}

    async def refresh(self) -> None:
        try:
            paused = await self._read()
        except StoreError as exc:
            log.debug("queue pauses unreadable, keeping the last: %s", exc)
            return
        for queue, running in self._running.items():
            known = running.is_set() or self._paused[queue].is_set()
            if queue in paused and not self._paused[queue].is_set():
                log.info("queue %s paused: consumer leaves", queue, extra=_event("paused", queue))
                running.clear()
                self._paused[queue].set()
            elif queue not in paused and not running.is_set():
                if known:
                    log.info("queue %s resumed: consuming", queue, extra=_event("resumed", queue))
                self._paused[queue].clear()
                running.set()

    async def watch(self) -> None:
        """Poll until cancelled."""
        while True:
            await asyncio.sleep(self._poll)
            await self.refresh()

    def is_paused(self, queue: str) -> bool:
        return self._paused[queue].is_set()

    def is_known(self, queue: str) -> bool:
        """Whether a read has said if ``queue`` is paused (until then it is not consumed)."""
        return self._running[queue].is_set() or self._paused[queue].is_set()

    async def wait_running(self, queue: str, halt: asyncio.Event) -> bool:
        """Until ``queue`` may be consumed (True) or ``halt`` is set (False)."""
        return await _first(self._running[queue], halt)

    async def leave_when_paused(
        self, queue: str, halt: asyncio.Event, leave: asyncio.Event
    ) -> None:
        """Set ``leave`` once ``queue`` is paused or ``halt`` is set."""
        await _first(self._paused[queue], halt)
        leave.set()


def _event(what: str, queue: str) -> dict[str, str]:
    return {"event": f"queue_{what}", "queue": queue}


async def _first(wanted: asyncio.Event, halt: asyncio.Event) -> bool:
    if halt.is_set():
        return False
    if wanted.is_set():
        return True
    waits = {asyncio.ensure_future(wanted.wait()), asyncio.ensure_future(halt.wait())}
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await w
    return not halt.is_set()
