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

A started delivery that waits for something else than the job's own work, a ``def`` job's
delivery waiting for a thread of the worker (``worker.threads``), is set aside meanwhile: its
slot is free for the next delivery, so ``async def`` jobs run on while every thread is held,
and it takes a slot back (waiting for one) once it has its thread, before its claim.
"""

from __future__ import annotations

import asyncio
import contextvars

# The slots of the delivery a task handles (set by the consume loop; None when handled alone).
delivery_slots: contextvars.ContextVar[Slots | None] = contextvars.ContextVar(
    "delivery_slots", default=None
)


class Slots:
    def __init__(self, limit: int, busy: set[asyncio.Task[None]]) -> None:
        self.limit = limit
        self.busy = busy  # the queue's deliveries started and not yet finished
        self.reserved = 0  # taken from the transport, or being taken, and not yet started
        self.aside: set[asyncio.Task[None]] = set()  # started, holding no slot meanwhile
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

    def set_aside(self, task: asyncio.Task[None]) -> None:
        """``task`` waits for something else (a thread): its slot is free meanwhile."""
        self.busy.discard(task)
        self.aside.add(task)
        self._freed.set()

    def work_done(self, task: asyncio.Task[None]) -> None:
        """``task`` runs none of the application's code any more (its job's code returned
        with a result that is being committed, or its outcome has committed and its hooks
        have run): what is left starts no work, so its slot is free for the next delivery
        now (it stays aside, unsettled, until it ends). Called twice, the second is
        nothing."""
        if task in self.busy:
            self.set_aside(task)

    async def take_back(self, task: asyncio.Task[None]) -> None:
        """Wait for a free slot for ``task`` set aside; it is busy again (cancelled while it
        waits, it stays aside until it ends)."""
        await self.reserve()
        self.reserved -= 1
        self.aside.discard(task)
        self.busy.add(task)

    def _ended(self, task: asyncio.Task[None]) -> None:
        self.busy.discard(task)
        self.aside.discard(task)
        self._freed.set()
