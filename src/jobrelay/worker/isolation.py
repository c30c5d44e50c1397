"""Suspects run alone: a job that may have killed its worker never takes a neighbour along.

A job whose last attempt ended with its worker lost (its lease expired, or the reconciler
ended that attempt ``worker_lost``) is a suspect: it may be what killed the worker, or only
a neighbour of what did. Claimed beside other jobs again, a job that kills every worker it
runs in would take them with it on each of its attempts, until they too were quarantined.

So a worker process runs a suspect alone: the suspect's turn waits until every run of this
process has ended, and no other claim starts until the suspect's run ends. A poison job then
dies alone on each attempt after its first and is quarantined when its attempts are used;
each healthy job it was claimed beside pays that first death only, and runs alone next.
Deliveries waiting for a turn are not claimed (no attempt, no lease). The suspect's storage
claims (``transitions.CLAIM``) refuse a suspect in the claims made without a read,
so it always comes here first.

A little jitter before a suspect's turn in a busy worker: the suspects of one death come
back together, and on several workers they would otherwise all stop the others' work in the
same instant. In an idle worker a suspect endangers nobody and takes its turn at once.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from jobrelay.domain.disclosure import WORKER_LOST
from jobrelay.domain.states import JobState
from jobrelay.storage.store import JobRecord

# Seconds, at most, a suspect waits before it asks for its turn.
SOLO_JITTER = 0.5


def is_suspect(job: JobRecord) -> bool:
    """What ``claims.suspect`` says in SQL, for a job the policy found ready to run."""
    if job.state is JobState.RUNNING:  # ready to run only with its lease expired
        return True
    lost = (job.public_error or "").startswith(f"{WORKER_LOST}:")
    return job.state is JobState.RETRY_WAIT and lost


class Isolation:
    """The runs of one worker process: any number together, or one suspect alone.

    A suspect waiting for its turn closes the door to new runs (else a busy worker would
    never be idle for it); the runs already going finish first.
    """

    def __init__(self, jitter: float = SOLO_JITTER) -> None:
        self._jitter = jitter
        self._running = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._open = asyncio.Event()  # no suspect running or waiting
        self._open.set()
        self._waiting = 0
        self._turn = asyncio.Lock()  # one suspect at a time

    @property
    def running(self) -> int:
        return self._running

    @asynccontextmanager
    async def shared(self) -> AsyncIterator[None]:
        """A run beside others; waits while a suspect runs or waits for its turn."""
        while not self._open.is_set():
            await self._open.wait()
        self._running += 1
        self._idle.clear()
        try:
            yield
        finally:
            self._running -= 1
            if self._running == 0:
                self._idle.set()

    @asynccontextmanager
    async def alone(self) -> AsyncIterator[None]:
        """A suspect's run: after every other run of this process ended, and before any new."""
        if self._jitter > 0 and (self._running or self._waiting):
            # Only when it must wait anyway: alone in an idle worker it endangers nobody.
            await asyncio.sleep(random.uniform(0, self._jitter))
        self._waiting += 1
        self._open.clear()
        try:
            async with self._turn:
                await self._idle.wait()
                yield
        finally:
            self._waiting -= 1
            if self._waiting == 0:
                self._open.set()


__all__ = ["SOLO_JITTER", "Isolation", "is_suspect"]
