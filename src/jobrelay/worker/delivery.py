"""One delivery: decode it, claim its job, run it, commit the outcome, THEN settle it.

The happy path is one statement: a claim guarded on exactly the policy's "ready to run"
needs no read first (batched with the other deliveries in flight). When it
loses, the job is read and the policy decides what the delivery means: a duplicate of a
finished job (acked), a retry not yet due, a lease held elsewhere (deferred), attempts used
up or a bad copy (quarantined). Messages of a type or version this worker does not know are
deferred for a newer worker. Every settle comes after the commit that holds its outcome.

A claim is one autocommit statement: it can commit while its answer is lost (the connection
drops). The retried claim then loses to this worker's own live lease, so before deciding
anything the handler looks for its own claim (its ``claimed`` event: this worker, the job's
current attempt, the lease still this worker's) and runs that one, unless another delivery
in this process holds the same job; otherwise the attempt would be spent without a run.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections import Counter
from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from datetime import datetime
from typing import Any

from jobrelay.domain.messages import JobMessage, MessageDecodeError, decode, outbox_id_of
from jobrelay.domain.policy import (
    Action,
    AttemptsExhausted,
    Decision,
    InvalidPayload,
    decide,
    observe_delivery,
)
from jobrelay.domain.states import JobState
from jobrelay.domain.unknown_types import DEFERS_HEADER, judge_unknown
from jobrelay.errors import StoreDataError, StoreError
from jobrelay.observe import logs, tracing
from jobrelay.observe.scrub import scrub
from jobrelay.storage.store import (
    Claim,
    Claimed,
    ClaimRequest,
    JobRecord,
)
from jobrelay.transport.base import Delivery
from jobrelay.worker.attempt import AttemptRun
from jobrelay.worker.backoff import Backoff
from jobrelay.worker.isolation import Isolation, is_suspect
from jobrelay.worker.scope import WorkerScope
from jobrelay.worker.threads import SyncThreads, ThreadSlot

log = logging.getLogger("jobrelay.worker")

# A claim can lose a race (another worker, a retry not yet due); re-read and decide again a
# few times, then defer rather than drop.
_MAX_DECISION_ROUNDS = 3

# The def job's thread the delivery being handled took before its claim (its run's body's).
_thread: ContextVar[ThreadSlot | None] = ContextVar("jobrelay_def_thread", default=None)


class DeliveryHandler:
    """What the worker does with each delivery; it holds no state between deliveries
    beyond its scope's (the batchers concurrent deliveries share, the lease renewer) and the
    jobs it holds now."""

    def __init__(self, scope: WorkerScope) -> None:
        self.scope = scope
        rt = self.rt = scope.rt
        self.registry = scope.registry
        self.worker_id = scope.worker_id
        self.lease = scope.lease
        self.leases = scope.leases
        settings = rt.settings  # the threads of def jobs (worker.threads)
        self.threads = SyncThreads(settings.sync_threads, settings.sync_abandoned_max, rt.metrics)
        # Runs together, or a suspect alone (``worker.isolation``).
        self.isolation = Isolation()
        # Deliveries of each job being claimed or run in this process (a lost claim's reply
        # is adopted only by the one delivery that holds the job here).
        self._holding: Counter[str] = Counter()

    async def handle(self, delivery: Delivery) -> None:
        """Handle one delivery under its ``run`` span (``observe.tracing``), which its log
        lines carry."""
        self.rt.metrics.deliveries.inc()
        if delivery.redelivered:
            self.rt.metrics.redeliveries.inc()
        with logs.bound():  # what it binds (job id, attempt) ends with it
            await self._handle(delivery)

    async def _handle(self, delivery: Delivery) -> None:
        meta: dict[str, Any] = {
            "redelivered": delivery.redelivered,
            "deliveryCount": delivery.delivery_count,
        }
        # Which message this is: every event the delivery writes names it, and the timeline
        # puts them after that message's ``published`` (domain/timeline.py).
        outbox_id = outbox_id_of(delivery.headers)
        if outbox_id is not None:
            meta["outboxId"] = outbox_id
        try:
            message = decode(delivery.body, self.registry.types)
        except MessageDecodeError as exc:
            with tracing.running(exc.job_id, "unknown", "", delivery.headers):
                if exc.unknown and exc.job_id is not None:
                    await self._unknown(delivery, exc, exc.job_id, meta)
                else:
                    await self._invalid(delivery, exc.reason, exc.job_id, meta)
            return
        queue = getattr(self.registry.get(message.type), "queue", "")
        with tracing.running(message.job_id, message.type, queue, delivery.headers):
            await self._decoded(delivery, message, meta)

    async def _decoded(self, delivery: Delivery, message: JobMessage, meta: dict[str, Any]) -> None:
        logs.bind(jobId=message.job_id)
        # A def job's thread is taken before its claim: waiting for one, it is not claimed.
        thread = await self.threads.take_aside() if self._in_thread(message.type) else None
        held = _thread.set(thread)
        self._holding[message.job_id] += 1
        try:
            await self._claim_and_run(delivery, message, meta)
        finally:
            _thread.reset(held)
            if thread is not None:
                thread.release()  # unless a body was started on it
            self._holding[message.job_id] -= 1
            if self._holding[message.job_id] <= 0:
                del self._holding[message.job_id]

    def _in_thread(self, job_type: str) -> bool:
        return bool(getattr(self.registry.get(job_type), "in_thread", False))

    async def _claim_and_run(
        self, delivery: Delivery, message: JobMessage, meta: dict[str, Any]
    ) -> None:
        # The happy path first: a claim guarded on exactly "ready to run" needs no read.
        async def claim() -> Claimed:
            request = ClaimRequest(message.job_id, message.type, self.worker_id, meta)
            return await self.scope.claim(request)

        async with self.isolation.shared():
            claimed = await self._claim(message.job_id, claim)
            if claimed is not None:
                await self._run(delivery, *claimed)
                return
        for _ in range(_MAX_DECISION_ROUNDS):
            job = await self.rt.store.get_job(message.job_id)
            if job is None:
                await self._invalid(delivery, "unknown job", None, meta)
                return
            if job.type != message.type:
                await self._invalid(
                    delivery, f"type {message.type} != job type {job.type}", job.id, meta
                )
                return
            if job.cancel_requested_at is not None and await self._end_abandoned(delivery, job):
                return
            observation = observe_delivery(job.view(), self._seen_at(job))
            if isinstance(observation, AttemptsExhausted):
                observation = await self._with_last_release(job.id, observation)
            if await self._act(delivery, message, job, decide(observation), meta):
                return
        await self._defer(
            delivery, message.job_id, message.encode(), "claim kept losing races", None
        )

    async def _end_abandoned(self, delivery: Delivery, job: JobRecord) -> bool:
        """A running job an operator cancelled whose lease expired (its worker died): end it
        ``cancelled`` now, as the reconciler would, and ack (``storage.cancels``)."""
        if not await self.rt.store.end_abandoned(job.id, self.rt.clock()):
            return False  # its worker still holds it (the policy defers), or it moved on
        await self.scope.settle(delivery, job.id, Action.ACK, job.attempt)
        return True

    async def _with_last_release(
        self, job_id: str, observation: AttemptsExhausted
    ) -> AttemptsExhausted:
        """The reason the last attempt's delivery was released, if its worker recorded one
        after the attempt's claim (a rare path: read the timeline only here)."""
        last_release: str | None = None
        for event in await self.rt.store.events(job_id):
            if event.kind == "claimed":
                last_release = None
            elif event.kind == "released":
                last_release = scrub(str(event.detail.get("reason") or "an error"))
        return dataclasses.replace(observation, last_release=last_release)

    def _seen_at(self, job: JobRecord) -> datetime:
        """The store's clock when the row was read: leases and due times are judged by it."""
        return job.observed_at or self.rt.clock()

    async def _act(
        self,
        delivery: Delivery,
        message: JobMessage,
        job: JobRecord,
        decision: Decision,
        meta: dict[str, Any],
    ) -> bool:
        """Carry out a delivery-time decision; False when a guard lost and we must re-read."""
        now = self.rt.clock()
        match decision.action:
            case Action.ACK:
                if decision.event == "duplicate_acked":
                    # Counted before its event commits: whoever reads the event reads the
                    # count with it (a test saw the event a loop turn before the count).
                    self.rt.metrics.duplicates_acked.inc()
                await self.rt.store.record_event(
                    job.id, decision.event, now, reason=decision.reason, **meta
                )
                # A duplicate of a success: its hooks may not have run.
                if decision.event == "duplicate_acked" and job.state is JobState.SUCCEEDED:
                    await self.scope.run_hooks(decision.event, job, job.attempt)
                await self.scope.settle(delivery, job.id, Action.ACK, job.attempt)
                return True
            case Action.DEFER:
                reason = decision.reason or "deferred"
                await self._defer(delivery, job.id, message.encode(), reason, job)
                return True
            case Action.REJECT:
                if decision.new_state is not None:
                    # Guarded on exactly what the policy saw (state, attempt, lease): a lease
                    # renewed meanwhile, or a new claim, makes this lose and we look again.
                    quarantined = await self.rt.store.quarantine(
                        job.id,
                        decision.reason or "",
                        now,
                        seen=job.view(),
                        public=decision.public,
                        **meta,
                    )
                    if not quarantined:
                        return False
                    self.rt.metrics.quarantined(job.state.value, decision.reason or "")
                    await self.scope.run_hooks("quarantined", job, job.attempt, decision.reason)
                else:
                    await self.rt.store.record_event(
                        job.id, decision.event, now, reason=decision.reason, **meta
                    )
                await self.scope.settle(delivery, job.id, Action.REJECT, job.attempt)
                return True
            case Action.RUN:

                async def claim() -> Claimed:
                    won = await self.rt.store.claim_job(
                        job.id, self.worker_id, now, self.lease, seen=job.view(), **meta
                    )
                    return None if won is None else (won, job, job.state)

                # A suspect (its last attempt's worker was lost) is claimed and run alone.
                suspect = is_suspect(job)
                if suspect:
                    log.info(
                        "suspect: its last attempt's worker was lost; run alone in this worker",
                        extra={"event": "suspect_alone", "jobId": job.id, "attempt": job.attempt},
                    )
                turn = self.isolation.alone() if suspect else self.isolation.shared()
                async with turn:
                    claimed = await self._claim(job.id, claim)
                    if claimed is None:
                        return False
                    await self._run(delivery, *claimed)
                return True
        raise AssertionError(decision)  # pragma: no cover

    async def _claim(self, job_id: str, claim: Callable[[], Awaitable[Claimed]]) -> Claimed:
        """A claim that survives a lost answer: retried through an outage, and a claim of
        ours that committed unseen is found and taken up instead of lost to our own lease.

        A refusal of the data (``StoreDataError``) is not an outage and is not retried here.
        """
        backoff = Backoff()
        while True:
            try:
                claimed = await claim()
                if claimed is not None:
                    # Tests: the claim committed, then the connection dropped (reply lost).
                    await self.rt.faults.ahit("claim.after_commit")
                return claimed
            except StoreDataError:
                raise
            except StoreError as exc:
                log.warning(
                    "claim not answered, the database is unreachable: %s",
                    exc,
                    extra={"event": "claim_held", "jobId": job_id},
                )
                await self.scope.wait_for_database()
                await backoff.wait()
                own = await self._own_claim(job_id)
                if own is not None:
                    return own

    async def _own_claim(self, job_id: str) -> Claimed:
        """The claim this worker made of ``job_id`` whose answer it never saw, if it holds.

        Ours means: ``running`` at an attempt whose ``claimed`` event is this worker's, the
        lease this worker's and live by the store's clock, and no other delivery in this
        process holding the job (a second copy claiming or running it). The lease is renewed
        at once: the lease renewer counts it from now, and the outage may have eaten into it.
        """
        job = await self.rt.store.get_job(job_id)
        if job is None or job.state is not JobState.RUNNING or job.lease_owner != self.worker_id:
            return None
        if job.lease_expires_at is None or job.lease_expires_at <= self._seen_at(job):
            return None
        claim = Claim(job.id, job.attempt, self.worker_id)
        if not await self.rt.store.committed_by(claim, "claimed"):
            return None
        if self._holding[job_id] != 1:
            return None
        if not await self.rt.store.renew_lease(claim, self.lease, self.rt.clock()):
            return None
        log.info(
            "claim committed unseen, running it",
            extra={"event": "claim_recovered", "jobId": job_id, "attempt": job.attempt},
        )
        from_state = JobState.QUEUED if job.attempt == 1 else JobState.RETRY_WAIT
        return claim, job, from_state

    async def _run(
        self, delivery: Delivery, claim: Claim, job: JobRecord, claimed_from: JobState
    ) -> None:
        self.rt.metrics.transition(claimed_from.value, JobState.RUNNING.value)
        logs.bind(attempt=claim.attempt)
        tracing.annotate(
            **{"jobrelay.attempt": claim.attempt, **tracing.account_attribute(job.account_id)}
        )
        tracing.event("claimed", detail={"attempt": claim.attempt, "worker": self.worker_id})
        run = AttemptRun(self.scope, thread=_thread.get())
        await run.run(delivery, job, claim)

    async def _defer(
        self,
        delivery: Delivery,
        job_id: str,
        body: bytes,
        reason: str,
        job: JobRecord | None,
        headers: dict[str, str] | None = None,
        detail: dict[str, Any] | None = None,
    ) -> None:
        delay = self._defer_delay(job)
        await self.rt.store.defer(
            job_id, body, delay, reason, self.rt.clock(), headers=headers, **(detail or {})
        )
        await self.scope.settle(delivery, job_id, Action.ACK, job.attempt if job else 0)

    def _defer_delay(self, job: JobRecord | None) -> int:
        """The shortest retry tier that outlasts the other worker's lease, else the longest."""
        tiers = self.rt.topology.tiers
        if job is None or job.lease_expires_at is None:
            return tiers[0]
        remaining = math.ceil((job.lease_expires_at - self._seen_at(job)).total_seconds())
        return next((t for t in tiers if t >= remaining), tiers[-1])

    async def _unknown(
        self, delivery: Delivery, exc: MessageDecodeError, job_id: str, meta: dict[str, Any]
    ) -> None:
        """A type or version this worker does not know, for an existing job: defer it
        (``domain.unknown_types``: quarantining at once would punish the job for our age)."""
        job = await self.rt.store.get_job(job_id)
        if job is None:
            await self._invalid(delivery, f"{exc.reason} (and no such job)", None, meta)
            return
        if job.state.is_terminal:
            decision = decide(observe_delivery(job.view(), self._seen_at(job)))
            message = JobMessage(job.id, job.type)
            await self._act(delivery, message, job, decision, meta)
            return
        verdict = judge_unknown(
            self.worker_id,
            job.type,
            exc.unknown_type,
            exc.reason,
            delivery.headers.get(DEFERS_HEADER),
            self.rt.settings.delivery_limit,
        )
        if verdict.quarantine:
            await self._invalid(delivery, verdict.reason, job_id, meta, unknown=True)
            return
        await self._defer(
            delivery,
            job_id,
            delivery.body,
            verdict.reason,
            None,
            headers=verdict.headers,
            detail=verdict.detail,
        )

    async def _invalid(
        self,
        delivery: Delivery,
        reason: str,
        job_id: str | None,
        meta: dict[str, Any],
        *,
        unknown: bool = False,
    ) -> None:
        job = await self.rt.store.get_job(job_id) if job_id else None
        decision = decide(InvalidPayload(reason, job.state if job else None, unknown))
        now = self.rt.clock()
        if job is not None:
            if decision.new_state is not None:
                # Guarded on the job as read: a good copy that claimed it since wins.
                if await self.rt.store.quarantine(
                    job.id,
                    decision.reason or reason,
                    now,
                    seen=job.view(),
                    public=decision.public,
                    **meta,
                ):
                    self.rt.metrics.quarantined(job.state.value, decision.reason or reason)
                    await self.scope.run_hooks(
                        "quarantined", job, job.attempt, decision.reason or reason
                    )
            else:
                await self.rt.store.record_event(job.id, decision.event, now, reason=reason, **meta)
        log.warning(
            "invalid message rejected: %s",
            reason,
            extra={"event": "invalid_message", "jobId": job_id, "reason": reason},
        )
        if job is not None:
            await self.scope.settle(delivery, job.id, Action.REJECT, job.attempt)
        else:
            await self.rt.faults.ahit("worker.before_ack")
            await delivery.reject()
