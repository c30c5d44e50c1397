"""What every delivery of one worker shares, handed down the hot loop as one object.

A delivery's life reads in one direction: the consumer (``consumer``) hands it to the
delivery handler (``delivery``: decode, ask the policy, claim), which hands the claim to an
attempt (``attempt``: run, write the outcome), which settles it (``settle`` here). Each of
them is given this scope instead of callbacks into the one before (Oban's executor passes
one struct down the same way): the runtime, the job types, who the worker is, its lease,
the batchers its claims and completions share a statement in, its one lease renewer, the
timeline its settles are recorded in, and how to wait out a database outage.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from jobrelay.batching import Batcher
from jobrelay.domain.policy import Action
from jobrelay.errors import StoreDataError, StoreError
from jobrelay.library.hooks import QUARANTINED, RETRIED, SUCCEEDED, JobOutcome, call_hooks
from jobrelay.library.operations import Registry
from jobrelay.observe import tracing
from jobrelay.observe.faults import ConnectionCut
from jobrelay.runtime.wiring import Runtime
from jobrelay.storage.port import StorePort
from jobrelay.storage.store import Claimed, ClaimRequest, CompleteRequest, Completion, JobRecord
from jobrelay.transport.base import Delivery
from jobrelay.worker.leases import LeaseRenewer
from jobrelay.worker.slots import delivery_slots
from jobrelay.worker.timeline import TimelineWriter

log = logging.getLogger("jobrelay.worker")

# The most claims (or completions) sent in one statement.
BATCH_SIZE = 100


@dataclass
class WorkerScope:
    rt: Runtime
    registry: Registry
    worker_id: str
    lease: timedelta
    timeline: TimelineWriter
    leases: LeaseRenewer
    wait_for_database: Callable[[], Awaitable[None]]
    claims: Batcher[ClaimRequest, Claimed]
    completions: Batcher[CompleteRequest, Completion]

    @classmethod
    def open(
        cls,
        rt: Runtime,
        registry: Registry,
        worker_id: str,
        lease: timedelta,
        *,
        timeline: TimelineWriter,
        wait_for_database: Callable[[], Awaitable[None]],
    ) -> WorkerScope:
        """The scope of a worker: every claim and completion is a batch (a single job is a
        batch of one): those of concurrent deliveries share a statement (PostgreSQL) or a
        write transaction, so one commit (SQLite, where the commit is the cost).
        JOBRELAY_BATCHING=false: batches of 1."""
        size = BATCH_SIZE if rt.settings.batching else 1

        # A statement the database refused for one row's data is sent again row by row.
        def alone_on(exc: Exception) -> bool:
            return isinstance(exc, StoreDataError)

        async def claim_many(requests: Sequence[ClaimRequest]) -> Sequence[Claimed]:
            return await claim_with_settles(rt.store, timeline, requests, rt.clock(), lease)

        async def complete_many(requests: Sequence[CompleteRequest]) -> Sequence[Completion]:
            done = await rt.store.complete_many(requests, rt.clock())
            # Tests: the batch committed, none of its deliveries settled yet.
            try:
                await rt.faults.ahit("worker.after_complete")
            except ConnectionCut as cut:
                # ... and the server cut every session before the answer was read: the
                # outcome is unknown here, and is read back (``attempt._own_earlier_commit``).
                await rt.store.cut_sessions()
                raise StoreError(f"database write failed: {cut}") from cut
            return [done.failed.get(r.claim.job_id, r.claim.job_id in done) for r in requests]

        return cls(
            rt,
            registry,
            worker_id,
            lease,
            timeline,
            # Every running claim's lease, renewed in one statement (one renewer per worker).
            LeaseRenewer(rt, lease, rt.settings.cancel_check_seconds),
            wait_for_database,
            Batcher(
                claim_many, key=lambda r: r.job_id, max_size=size, alone_on=alone_on, span="claim"
            ),
            Batcher(
                complete_many,
                key=lambda r: r.claim.job_id,
                max_size=size,
                alone_on=alone_on,
                span="commit",
            ),
        )

    async def run_hooks(
        self, event: str, job: JobRecord, attempt: int, reason: str | None = None
    ) -> None:
        """The application's hooks for the outcome ``event`` committed (``library.hooks``):
        after the commit, before the settle. Nothing to do, and nothing read, without any."""
        kind = _HOOKED.get(event)
        app = self.rt.app
        if kind is None or app is None:
            return
        hooks = app.hooks_for(kind, job.type)
        if hooks:
            await call_hooks(hooks, JobOutcome(job, kind, attempt, reason))

    async def settle(self, delivery: Delivery, job_id: str, action: Action, attempt: int) -> None:
        """Ack or reject AFTER the outcome is committed, then record whether the broker took it.

        ``settle_lost``: the channel the delivery came on had closed, so the broker requeues
        the message and its redelivery is handled as a duplicate of the committed outcome.
        """
        _work_done(delivery)
        await self.rt.faults.ahit("worker.before_ack")
        if action is Action.REJECT:
            with tracing.step("reject", **_settle_attributes(job_id)):
                taken = await delivery.reject()
            kind = "rejected"
        else:
            with tracing.step("ack", **_settle_attributes(job_id)):
                taken = await delivery.ack()
            kind = "ack_sent"
        detail: dict[str, Any] = {"attempt": attempt}
        if not taken:
            detail["action"] = kind
            kind = "settle_lost"
        # Per job at DEBUG: the timeline writer logs one INFO line per batch of settles. A
        # settle the broker did not take is rare and worth a line of its own.
        level = logging.INFO if kind == "settle_lost" else logging.DEBUG
        log.log(level, kind, extra={"event": kind, "jobId": job_id, "attempt": attempt})
        await self.timeline.record(job_id, kind, self.rt.clock(), **detail)


async def claim_with_settles(
    store: StorePort,
    timeline: TimelineWriter,
    requests: Sequence[ClaimRequest],
    now: datetime,
    lease: timedelta,
) -> Sequence[Claimed]:
    """The claims, with the settles recorded since the last statement riding on them (no
    commit of their own): the timeline's lines only, they decide nothing. A failed claim
    gives them back to the timeline writer's own statement; one the database refused for
    its data is sent again without them, as the refusal may be an event's (its job deleted
    by retention meanwhile), and an event is never a reason for a claim to fail."""
    events = timeline.take()
    try:
        return await store.claim_many(requests, now, lease, events)
    except StoreDataError:
        timeline.give_back(events)
        if not events:
            raise
        return await store.claim_many(requests, now, lease)
    except BaseException:
        timeline.give_back(events)
        raise


# The timeline's event of an outcome -> the hooks it calls.
_HOOKED = {
    "result_saved": SUCCEEDED,
    "duplicate_acked": SUCCEEDED,  # a redelivery of a success: at least once
    "retry_scheduled": RETRIED,
    "quarantined": QUARANTINED,
}


def _work_done(delivery: Delivery) -> None:
    """What the delivery stands for is committed (its outcome, or a duplicate's answer) and
    only its settle is left, which runs nothing: its job slot, and on the local transport its
    prefetch slot, are given back now, so the next job does not wait for the ack's write.
    After the hooks (the caller ran them): a slot still bounds the application's code."""
    delivery.outcome_committed()
    slots, task = delivery_slots.get(), asyncio.current_task()
    if slots is not None and task is not None:
        slots.work_done(task)


def _settle_attributes(job_id: str) -> dict[str, str]:
    return {"messaging.operation.type": "settle", "messaging.message.id": job_id}


__all__ = ["BATCH_SIZE", "WorkerScope"]
