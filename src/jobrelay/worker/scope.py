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

from jobrelay.batching import Batcher, Gate
from jobrelay.domain.policy import Action
from jobrelay.errors import StoreDataError, StoreError
from jobrelay.library.hooks import QUARANTINED, RETRIED, SUCCEEDED, JobOutcome, call_hooks
from jobrelay.library.operations import Registry
from jobrelay.observe import tracing
from jobrelay.observe.faults import ConnectionCut
from jobrelay.runtime.wiring import Runtime
from jobrelay.storage.outcomes import Completed
from jobrelay.storage.port import StorePort
from jobrelay.storage.store import Claimed, ClaimRequest, CompleteRequest, Completion, JobRecord
from jobrelay.transport.base import Delivery
from jobrelay.worker.leases import LeaseRenewer
from jobrelay.worker.slots import delivery_slots
from jobrelay.worker.timeline import TimelineWriter

log = logging.getLogger("jobrelay.worker")

# The most claims (or completions) sent in one statement.
BATCH_SIZE = 100

# What a turn is asked, and what each request of it is answered.
Turned = ClaimRequest | CompleteRequest
TurnAnswer = Claimed | Completion


@dataclass
class WorkerScope:
    rt: Runtime
    registry: Registry
    worker_id: str
    lease: timedelta
    timeline: TimelineWriter
    leases: LeaseRenewer
    wait_for_database: Callable[[], Awaitable[None]]
    # The claims and the completions pending at once, a turn a commit.
    turns: Batcher[Turned, TurnAnswer]

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
        write transaction, so one commit (SQLite, where the commit is the cost). The claims
        and completions pending at once are one turn: one statement for both, or the
        completions' write transaction when one has a step of its own (a staged result to
        publish, follow-ups), the claims riding in it. JOBRELAY_BATCHING=false: batches of 1."""
        size = BATCH_SIZE if rt.settings.batching else 1

        # A statement the database refused for one row's data is sent again row by row.
        def alone_on(exc: Exception) -> bool:
            return isinstance(exc, StoreDataError)

        async def turn(requests: Sequence[Turned]) -> Sequence[TurnAnswer]:
            claims = [r for r in requests if isinstance(r, ClaimRequest)]
            completions = [r for r in requests if isinstance(r, CompleteRequest)]
            claimed, done = await turn_with_settles(
                rt.store, timeline, claims, completions, rt.clock(), lease
            )
            answers = iter(claimed)
            if completions:
                done = await _after_complete(rt, done, completions)
            return [
                next(answers) if isinstance(r, ClaimRequest) else _answer(done, r) for r in requests
            ]

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
                turn,
                # A job's claim and its completion never share a turn (one statement updates
                # a row once): a redelivered copy's claim waits for the next.
                key=_job_id,
                max_size=size,
                kind=type,
                alone_on=alone_on,
                span=lambda r: "claim" if isinstance(r, ClaimRequest) else "commit",
            ),
        )

    async def claim(self, request: ClaimRequest) -> Claimed:
        """The delivery's claim, in the worker's next turn; in a slot lent by a job whose
        completion is pending, beside that completion or after it (``worker.slots``)."""
        slots, task = delivery_slots.get(), asyncio.current_task()
        if slots is None or task is None:
            answer = await self.turns.submit(request)
        else:
            answer = await self.turns.submit(request, after=slots.gate_of(task))
            slots.met(task)
        assert not isinstance(answer, (bool, Exception))
        return answer

    async def complete(self, request: CompleteRequest, job_type: str) -> Completion:
        """The attempt's completion: in the worker's next turn, its slot lent to the next
        delivery meanwhile (``_lend``)."""
        answer = await self.turns.submit(request, lends=self._lend(request, job_type))
        assert isinstance(answer, (bool, Exception))
        return answer

    def _lend(self, request: CompleteRequest, job_type: str) -> Gate | None:
        """The job's code has returned and only its completion is left: the slot goes to
        the next delivery now, whose claim then meets the completion in one statement,
        rather than waiting for this commit before its claim even left (issue 41). Not for
        a type with outcome hooks of any kind: hooks run after the commit, and a slot
        bounds them too (a success's, or a quarantine's when the database refuses this
        outcome)."""
        app = self.rt.app
        if app is not None and any(app.hooks_for(kind, job_type) for kind in _OUTCOMES):
            return None
        slots, task = delivery_slots.get(), asyncio.current_task()
        if slots is None or task is None:
            return None
        return slots.lend(task, request)

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


async def turn_with_settles(
    store: StorePort,
    timeline: TimelineWriter,
    claims: Sequence[ClaimRequest],
    completions: Sequence[CompleteRequest],
    now: datetime,
    lease: timedelta,
) -> tuple[list[Claimed], Completed]:
    """The turn, with the settles recorded since the last statement riding on it (no
    commit of their own): the timeline's lines only, they decide nothing. A failed turn
    gives them back to the timeline writer's own statement; one the database refused for
    its data is sent again without them, as the refusal may be an event's (its job deleted
    by retention meanwhile), and an event is never a reason for a claim to fail."""
    events = timeline.take()
    try:
        return await store.turn(claims, completions, now, lease, events)
    except StoreDataError:
        timeline.give_back(events)
        if not events:
            raise
        return await store.turn(claims, completions, now, lease)
    except BaseException:
        timeline.give_back(events)
        raise


async def _after_complete(
    rt: Runtime, done: Completed, requests: Sequence[CompleteRequest]
) -> Completed:
    """Tests: the completions committed, none of their deliveries settled yet (fault
    ``worker.after_complete``). A cut there (the server ending every session before the
    answer was read) leaves the outcome unknown, to be read back
    (``attempt._own_earlier_commit``): each completion is answered with the error."""
    try:
        await rt.faults.ahit("worker.after_complete")
    except ConnectionCut as cut:
        await rt.store.cut_sessions()
        error = StoreError(f"database write failed: {cut}")
        error.__cause__ = cut
        return Completed((), {r.claim.job_id: error for r in requests})
    return done


def _answer(done: Completed, request: CompleteRequest) -> Completion:
    job_id = request.claim.job_id
    return done.failed.get(job_id, job_id in done)


def _job_id(request: Turned) -> str:
    return request.job_id if isinstance(request, ClaimRequest) else request.claim.job_id


# The timeline's event of an outcome -> the hooks it calls.
_HOOKED = {
    "result_saved": SUCCEEDED,
    "duplicate_acked": SUCCEEDED,  # a redelivery of a success: at least once
    "retry_scheduled": RETRIED,
    "quarantined": QUARANTINED,
}
# Every kind of outcome hook: a type with any of them keeps its slot to the end.
_OUTCOMES = frozenset(_HOOKED.values())


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
