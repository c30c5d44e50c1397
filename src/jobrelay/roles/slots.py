"""A queue's job slots: how many of its deliveries a worker starts at once.

The broker window (``prefetch``) and the concurrency are two numbers (issue 23). The window
keeps the next deliveries at hand, so a batch of claims is ready the moment slots free up, and
lets their acks go as one frame. The slots bound what is started: a delivery is taken from
the transport only when a slot is reserved for it, so what waits for a slot is still the
transport's, unclaimed, and goes back uncounted when the consumer stops (a pause, a drain).
A job is therefore claimed only once it can run: a worker that dies never spends an attempt
of a job it had not started.

A reservation is made before the transport is asked for the next delivery and is carried by
the delivery until it starts (``started``): two consumers of one queue (a session's first and
the ones added as earlier work frees its slots) never both take the last slot.
"""

from __future__ import annotations

import asyncio


class Slots:
    def __init__(self, limit: int, busy: set[asyncio.Task[None]]) -> None:
        self.limit = limit
        self.busy = busy  # the queue's deliveries started and not yet finished
        self.reserved = 0  # taken from the transport, or being taken, and not yet started
        self._freed = asyncio.Event()

    @property
    def free(self) -> int:
        return self.limit - len(self.busy) - self.reserved

    async def reserve(self) -> None:
        """Wait for a free slot and hold it for the next delivery."""
        while self.free <= 0:
            self._freed.clear()
            await self._freed.wait()
        self.reserved += 1

    def unreserve(self) -> None:
        """The reservation was not used (the stream ended, the consumer stopped)."""
        self.reserved -= 1
        self._freed.set()

    def started(self, task: asyncio.Task[None]) -> None:
        """The reserved delivery started as ``task``: its slot is busy until it ends."""
        self.reserved -= 1
        self.busy.add(task)
        task.add_done_callback(self._ended)

    def _ended(self, task: asyncio.Task[None]) -> None:
        self.busy.discard(task)
        self._freed.set()
