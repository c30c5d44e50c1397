"""One lease renewer per worker: every running claim renewed in one fenced statement.

A claim's lease is renewed every third of it, counted for each claim from just before its
claim (on this process's monotonic clock). Instead of a heartbeat task per job, one task
wakes when the earliest renewal is due and renews every claim due by then (or within a sixth
of the lease: a little early, so claims made together stay together) in ONE statement
(``Store.renew_leases``, fenced per row on the claim), so a worker running 16 jobs sends one
renewal where it sent 16. Each claim keeps its own rules, as its heartbeat had them:

- a renewal that finds another claim holding the job loses that claim only: its run is
  cancelled (``lease_lost``), its neighbours in the statement are renewed;
- a renewal that finds an operator asked to cancel the job (``storage.cancels``) renews it
  and cancels its run (``cancelled``): so a claim is renewed at least every
  ``JOBRELAY_CANCEL_CHECK_SECONDS`` while its work runs, however long its lease;
- a renewal that finds the claim gone once its work is done is no lost lease: its outcome
  is being written (its own completion may have just committed), and that fenced write
  says whether another claim took the job; the claim is only no longer renewed;
- a renewal that waits is not lost to the wait: it is decided by the database's answer
  ("the claim holds" / "another claim holds the job"), never by how long it took, wherever
  a waiting renewal also holds off every takeover. On SQLite a renewal waits for the one
  write lock (another connection's long write transaction), which a takeover needs too, so
  it is awaited however long (``Store.renewal_blocks_takeover``), and SQLite's "still
  locked" after its busy timeout (``StoreBusy``) is asked again, never a loss. On
  PostgreSQL the renewal skips a row another transaction has locked (its own completion)
  instead of waiting on it, and that claim is asked about again soon, not lost; there a
  renewal that gets no answer before the lease may have ended is an unreachable database;
- a renewal that fails (the database cannot be reached) is tried again soon; a claim whose
  lease may have ended before a renewal succeeded is lost while its work still runs, and
  once the work is done it keeps being renewed until its outcome commits (``release``), so
  a result computed before an outage is not lost to a takeover while the database answers.

The task ends when no claim is held and starts again with the next one: nothing to start or
stop with the worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from jobrelay.errors import StoreBusy, StoreError
from jobrelay.runtime.wiring import Runtime
from jobrelay.storage.store import Claim

log = logging.getLogger("jobrelay.worker")


@dataclass
class _Held:
    claim: Claim
    work: asyncio.Task[Any]
    lost: asyncio.Event
    expires: float  # monotonic: when the lease may have ended without a renewal
    due: float  # monotonic: when it is renewed next
    cancelled: asyncio.Event | None = None  # set when an operator's cancel is learnt


class LeaseRenewer:
    def __init__(self, rt: Runtime, lease: timedelta, cancel_check: float | None = None) -> None:
        self.rt = rt
        self.lease = lease.total_seconds()
        self._lease = lease
        # How long a claim goes unrenewed: a third of the lease, or less, so a cancel
        # request is learnt within ``cancel_check`` seconds.
        self._every = min(self.lease / 3, cancel_check or self.lease)
        self._margin = min(1.0, self.lease / 10)
        self._window = min(self.lease / 6, self._every / 2)
        self._held: dict[Claim, _Held] = {}
        self._changed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.statements = 0  # renewal statements sent (tests, metrics)

    def hold(
        self,
        claim: Claim,
        granted: float,
        work: asyncio.Task[Any],
        lost: asyncio.Event,
        cancelled: asyncio.Event | None = None,
    ) -> None:
        """Renew ``claim`` from now on; ``granted`` is when its lease began (monotonic).

        When it is lost, ``lost`` is set and ``work`` cancelled; when a renewal finds an
        operator's cancel of the job, ``cancelled`` is set and ``work`` cancelled.
        """
        self._held[claim] = _Held(
            claim, work, lost, granted + self.lease, granted + self._every, cancelled
        )
        self._changed.set()
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())

    def release(self, claim: Claim) -> None:
        """The claim's outcome is committed (or its run is over): stop renewing it."""
        self._held.pop(claim, None)
        self._changed.set()

    async def close(self) -> None:
        """Stop renewing (the worker has drained), between renewals, never inside one.

        Cancelled inside its statement, the driver throws the connection away (on aiosqlite
        that leaves a close task that can hang the loop's shutdown), so a renewal under way
        is let finish; it is bounded by the lease, and only one stuck past that is cancelled.
        ``release`` never cancels anything.
        """
        self._held.clear()
        self._changed.set()
        task, self._task = self._task, None
        if task is None:
            return
        try:
            await asyncio.wait_for(asyncio.shield(task), self.lease)
        except TimeoutError:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        except asyncio.CancelledError:
            task.cancel()  # the worker is being torn down: do not leave the renewer behind
            raise

    async def _run(self) -> None:
        while self._held:
            self._changed.clear()
            wait = min(h.due for h in self._held.values()) - time.monotonic()
            if wait > 0:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(wait):
                        await self._changed.wait()
                continue  # a claim came or went: look at the earliest due again
            # A little early rather than alone: the claims made together share a statement.
            soon = time.monotonic() + self._window
            await self._renew([h for h in self._held.values() if h.due <= soon])

    async def _renew(self, due: list[_Held]) -> None:
        sent = time.monotonic()
        # How long to wait for an answer: until the first lease that is still running may
        # end. A claim whose recorded lease already passed (its row was skipped, locked by
        # its own completion, or its renewals failed) gets a third of a lease: bounding the
        # wait by its stale end would lose it to a slow answer the database still gives.
        running = [h.expires for h in due if h.expires - self._margin > sent + self._margin]
        limit = max(
            (min(running) - self._margin - sent) if running else self.lease / 3, self._margin
        )
        self.statements += 1
        claims = [h.claim for h in due]
        try:
            if self.rt.store.renewal_blocks_takeover:
                # Waiting for the write lock, as any takeover would: the answer decides.
                renewed = await self.rt.store.renew_leases(claims, self._lease, self.rt.clock())
            else:
                async with asyncio.timeout(limit):
                    renewed = await self.rt.store.renew_leases(claims, self._lease, self.rt.clock())
        except StoreBusy as exc:
            # The database answered: still locked by another writer, so no takeover either.
            log.info(
                "lease renewal waits for the database's write lock: %s",
                exc,
                extra={"event": "lease_renew_waiting", "jobs": len(due)},
            )
            for held in due:
                held.due = time.monotonic() + min(self._margin, 0.1)
            return
        except Exception as exc:
            if not isinstance(exc, StoreError | TimeoutError):
                # A bug must not end the renewal of every lease: taken as a failed renewal.
                log.exception("lease renewal raised", extra={"event": "lease_renew_failed"})
            why = _reason(exc, limit)
            for held in due:
                self._failed(held, why)
            return
        for held in due:
            if self._held.get(held.claim) is not held:
                continue  # released while the statement ran: its outcome is committed
            if held.claim in renewed:
                held.expires, held.due = sent + self.lease, sent + self._every
                if held.claim in renewed.cancel_requested:
                    self._cancel(held)
            elif held.claim in renewed.skipped:
                # Its row is locked (its own completion holds it): not lost, asked again.
                held.due = time.monotonic() + min(self.lease / 6, 1.0)
            elif held.work.done():
                # A renewal racing its own completion: the fenced outcome write decides.
                self._held.pop(held.claim, None)
            else:
                self._lose(held, "another claim holds the job")

    def _failed(self, held: _Held, why: str) -> None:
        if self._held.get(held.claim) is not held:
            return
        # While the work runs, a lease that may have ended must stop it; once the work is
        # done there is nothing to stop, so keep trying until the outcome commits (the
        # fenced write still loses if another claim took the job).
        if time.monotonic() < held.expires - self._margin or held.work.done():
            log.warning(
                "lease renewal failed: %s",
                why,
                extra={"event": "lease_renew_failed", "jobId": held.claim.job_id},
            )
            held.due = time.monotonic() + min(self.lease / 6, 1.0)
            return
        self._lose(held, f"lease could not be renewed before it ended ({why})")

    def _cancel(self, held: _Held) -> None:
        """An operator cancelled the job: stop its work (once); the lease is still ours and
        is renewed until the run has ended the job ``cancelled``."""
        if held.cancelled is None or held.cancelled.is_set() or held.work.done():
            return
        log.info(
            "cancel requested by an operator, stopping the run",
            extra={"event": "cancel_learnt", "jobId": held.claim.job_id},
        )
        held.cancelled.set()
        held.work.cancel()

    def _lose(self, held: _Held, reason: str) -> None:
        log.warning(
            "lease lost, stopping the run: %s",
            reason,
            extra={
                "event": "lease_lost",
                "jobId": held.claim.job_id,
                "attempt": held.claim.attempt,
            },
        )
        self._held.pop(held.claim, None)
        held.lost.set()
        held.work.cancel()


def _reason(exc: BaseException, limit: float) -> str:
    """Why a renewal failed, never empty (``TimeoutError()`` has no text of its own)."""
    if isinstance(exc, TimeoutError) and not str(exc):
        return f"TimeoutError: no answer from the database within {limit:.1f} s"
    return str(exc) or type(exc).__name__
