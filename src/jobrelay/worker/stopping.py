"""Why a run is stopped before it returns: a lost lease, an operator's cancel, or its time
limit; and how a cancelled run ends.

Both stop the run the way a lost lease does (its task is cancelled; a ``def`` job's thread
is signalled through ``ctx.cancelled`` and abandoned, ``sync_context``) and both are then
recorded as a failed attempt, fenced on the claim:

- past its time limit (``@app.job(timeout=)``, else ``JOBRELAY_JOB_TIMEOUT``) that failure
  lands, with the reason ``time limit of 2 s exceeded``, and follows the retry policy;
- after an operator's cancel (learnt by the lease renewer, ``leases``) the fence refuses it
  (``transitions.fenced``), as it refuses any outcome of a claim whose cancel was requested, even
  a success committed a moment after the request; the worker then ends the job
  ``cancelled`` with the operator's reason (``end_cancelled``) and acks. Nothing of the run
  is published: its staged result is discarded with the refused outcome, and an effect is
  never started (the effects ledger refuses a claim whose cancel was requested).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from jobrelay.domain.disclosure import INTERRUPTED, public_error
from jobrelay.domain.states import JobState
from jobrelay.errors import StoreError
from jobrelay.runtime.wiring import Runtime
from jobrelay.settings import Settings
from jobrelay.storage.store import Claim, Fenced

log = logging.getLogger("jobrelay.worker")

LEASE_LOST = "lease lost: the run was stopped"
CANCELLED = "cancelled by an operator"


def time_limit(operation: object, settings: Settings) -> float | None:
    """The job type's ``timeout=``, else ``JOBRELAY_JOB_TIMEOUT``; None: no limit."""
    own: float | None = getattr(operation, "timeout", None)
    return own if own is not None else settings.job_timeout


def time_limit_reason(limit: float) -> str:
    """``time limit of 2 s exceeded`` (the number as given: 2, 0.5)."""
    return f"time limit of {limit:g} s exceeded"


class RunStop:
    """Why one run may be stopped: its lease lost (``lease_lost``) or an operator's cancel
    (``cancelled``), both set by the lease renewer, or its time limit (a timer here)."""

    def __init__(
        self, work: asyncio.Task[Any], lease_lost: asyncio.Event, limit: float | None
    ) -> None:
        self.work = work
        self.lease_lost = lease_lost
        self.limit = limit
        self.cancelled = asyncio.Event()
        self.expired = False
        loop = asyncio.get_running_loop()
        self._started = loop.time()
        self._timer = None if limit is None else loop.call_later(limit, self._expire)

    def _expire(self) -> None:
        if not self.work.done() and not self.cancelled.is_set():
            self.expired = True
            self.work.cancel()

    def overran(self) -> bool:
        """The run returned past its limit: its timer could not fire in time (the body blocked
        the event loop). It counts as expired, as if the timer had stopped it."""
        if self.limit is not None and not self.stopped:
            elapsed = asyncio.get_running_loop().time() - self._started
            self.expired = elapsed >= self.limit
        return self.expired

    @property
    def stopped(self) -> bool:
        """The run was cancelled for one of these (else the worker itself is stopping)."""
        return self.lease_lost.is_set() or self.cancelled.is_set() or self.expired

    def why(self) -> tuple[str, str]:
        """(raw, public) of the failed attempt a stopped run is recorded as."""
        if self.lease_lost.is_set():
            return LEASE_LOST, public_error(INTERRUPTED)
        if self.cancelled.is_set():
            return CANCELLED, public_error(INTERRUPTED, CANCELLED)
        assert self.limit is not None
        reason = time_limit_reason(self.limit)
        return reason, public_error(INTERRUPTED, reason)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()


async def end_cancelled(rt: Runtime, claim: Claim, lost: Fenced) -> bool:
    """After the fence refused our outcome while our claim still holds the job (an operator
    asked to cancel it): end it ``cancelled``, fenced on the claim; True: ack the delivery.

    A failure here leaves the job running with its cancel requested: no delivery claims it
    again (``transitions.claimable``), and the reconciler ends it once the lease has expired.
    """
    if lost.current_state is not JobState.RUNNING or lost.current_attempt != claim.attempt:
        return False
    try:
        ended = await rt.store.end_cancelled(claim, rt.clock())
    except StoreError as exc:
        log.warning(
            "cancelled job not ended, the reconciler will: %s",
            exc,
            extra={"event": "cancel_held", "jobId": claim.job_id},
        )
        return True  # nothing of this claim can land any more: ack, as for a lost lease
    if ended:
        rt.metrics.transition(JobState.RUNNING.value, JobState.CANCELLED.value)
        log.info(
            "job cancelled by an operator",
            extra={"event": "cancelled", "jobId": claim.job_id, "attempt": claim.attempt},
        )
    return ended
