"""The worker: take a delivery, ask the policy, commit the outcome, THEN settle the delivery.

The order is the whole point. The job row is claimed (attempt += 1, lease) before work
starts, so a worker killed mid-export still spends an attempt and a crash loop ends in
quarantine. The outcome (``succeeded`` + result key, ``retry_wait`` + an outbox row for the
delay route, or ``quarantined``) is committed before the ack or reject, so a crash between
the two leaves a redelivery that finds the job finished and is acked without redoing it.

Each claim is a token (the attempt number it produced). Every write of the run after it —
lease renewal, progress, the outcome, follow-up jobs — is fenced on that token, and the
result object is published under the same fence, so a run whose lease was taken over (a
frozen process, a second copy of the job in this very process) loses every write, records
``lease_lost`` and is acked. A lease that is lost, or can no longer be renewed before it
ends, cancels the operation.

While the database is unreachable the worker holds what it has and takes nothing new; a
database outage is not the message's fault, so nothing is released towards its delivery
limit. It resumes by itself when the database answers again.

The worker publishes nothing itself: retries and deferrals are outbox rows the relay sends.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import socket
import uuid
from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any

from jobrelay.batching import Batcher
from jobrelay.domain.messages import JobMessage, MessageDecodeError, decode
from jobrelay.domain.policy import (
    Action,
    Decision,
    InvalidPayload,
    decide,
    observe_delivery,
)
from jobrelay.domain.states import JobState
from jobrelay.errors import ConfigError, StoreError
from jobrelay.observe import logs
from jobrelay.operations.base import Registry
from jobrelay.roles.attempt import AttemptRun
from jobrelay.roles.runtime import Runtime
from jobrelay.roles.timeline import TimelineWriter
from jobrelay.storage.store import Claim, ClaimRequest, CompleteRequest, JobRecord
from jobrelay.transport.base import Delivery

log = logging.getLogger("jobrelay.worker")

# A claim can lose a race (another worker, a retry not yet due); re-read and decide again a
# few times, then defer rather than drop.
_MAX_DECISION_ROUNDS = 3
_PROBE_BACKOFF_MAX = 8.0  # seconds between database probes while it is unreachable
# A deferred copy of a job whose type or version no worker here knows carries its count.
DEFERS_HEADER = "x-jobrelay-defers"


# A claim that won: the claim, the job as claimed, and the state it was claimed from.
Claimed = tuple[Claim, JobRecord, JobState] | None


def _log_abandoned(task: asyncio.Task[None]) -> None:
    """A handler ended by something stronger than an Exception (a simulated crash, exit)."""
    if not task.cancelled() and task.exception() is not None:
        log.error("delivery abandoned: %r", task.exception(), extra={"event": "abandoned"})


def new_worker_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"


def check_queues(wanted: Sequence[str], known: Sequence[str]) -> None:
    """ConfigError (``--queue``) unless every wanted queue is one of the app's."""
    unknown = [q for q in wanted if q not in known]
    if unknown:
        raise ConfigError(
            "--queue",
            f"no job type of this app uses queue {', '.join(map(repr, unknown))} "
            f"(its queues: {', '.join(known)})",
        )


class Worker:
    def __init__(
        self,
        rt: Runtime,
        *,
        registry: Registry | None = None,
        worker_id: str | None = None,
        queues: Sequence[str] | None = None,
    ) -> None:
        self.rt = rt
        if registry is None:
            registry = rt.job_app().registry(rt.settings)
        self.registry = registry
        self.worker_id = worker_id or new_worker_id()
        # The queues consumed, each with a consumer and prefetch of its own (default: all).
        self.queues = tuple(dict.fromkeys(queues)) if queues else rt.topology.queues
        check_queues(self.queues, rt.topology.queues)
        self.lease = timedelta(seconds=rt.settings.lease_seconds)
        self.handled = 0
        # Set while the database answers; cleared by an outage, which pauses consuming.
        self._database_up = asyncio.Event()
        self._database_up.set()
        self._probe: asyncio.Task[None] | None = None
        self.timeline = TimelineWriter(rt.store)
        # PostgreSQL: the claims and completions of concurrent deliveries share a statement.
        self._claims: Batcher[ClaimRequest, Claimed] | None = None
        self._completions: Batcher[CompleteRequest, bool] | None = None
        if rt.settings.batching and rt.store.is_postgres:
            self._claims = Batcher(self._claim_many, key=lambda r: r.job_id)
            self._completions = Batcher(self._complete_many, key=lambda r: r.claim.job_id)

    # --- the consume loop -------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        """Consume until ``stop`` is set, then drain: finish and settle what is in flight.

        One consumer per queue, each with ``prefetch`` slots of its own, so a queue of slow
        jobs never starves another; all of them hand deliveries to the same handling. The
        consumers stop together (``stop``, or one of them ending or failing), and only then
        is what is in flight drained.
        """
        prefetch = self.rt.settings.prefetch
        in_flight: set[asyncio.Task[None]] = set()
        log.info(
            "worker started",
            extra={
                "event": "worker_started",
                "worker": self.worker_id,
                "prefetch": prefetch,
                "queues": list(self.queues),
            },
        )
        halt = asyncio.Event()  # stop is set, or a consumer ended: every consumer stops
        self.timeline.start_batching()
        consumers = [
            asyncio.create_task(self._consume(queue, prefetch, halt, in_flight))
            for queue in self.queues
        ]
        stopping = asyncio.ensure_future(stop.wait())
        hard_stop = False
        try:
            await asyncio.wait({stopping, *consumers}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            hard_stop = True  # killed, not asked to stop: abandon work like a dead process
            for consumer in consumers:
                consumer.cancel()
            raise
        finally:
            stopping.cancel()
            halt.set()
            # Each consumer stops first: what was prefetched but not started goes back to the
            # broker now, and the deliveries in flight stay settleable while they drain.
            await asyncio.gather(*consumers, return_exceptions=True)
            if in_flight:
                if hard_stop:
                    for task in in_flight:
                        task.cancel()
                else:
                    await self._drain(in_flight)
                await asyncio.gather(*in_flight, return_exceptions=True)
            if self._probe is not None:
                self._probe.cancel()
            await self.timeline.close()
            log.info("worker stopped", extra={"event": "worker_stopped", "handled": self.handled})
        for consumer in consumers:  # a consumer that failed fails the worker
            failure = None if consumer.cancelled() else consumer.exception()
            if failure is not None:
                raise failure

    async def _consume(
        self, queue: str, prefetch: int, halt: asyncio.Event, in_flight: set[asyncio.Task[None]]
    ) -> None:
        """One queue's consumer: take deliveries while a slot of its own is free."""
        slots = asyncio.Semaphore(prefetch)
        deliveries = self.rt.transport.consume(prefetch, queue=queue)
        iterator = deliveries.__aiter__()
        halting = asyncio.ensure_future(halt.wait())
        receiving: asyncio.Future[Delivery] | None = None
        try:
            while not halt.is_set():
                await slots.acquire()
                if not self._database_up.is_set():
                    # Paused: what we hold stays held; take nothing new until it is back.
                    waiting = asyncio.ensure_future(self._database_up.wait())
                    await asyncio.wait({waiting, halting}, return_when=asyncio.FIRST_COMPLETED)
                    waiting.cancel()
                    if halt.is_set():
                        slots.release()
                        break
                receiving = asyncio.ensure_future(anext(iterator))
                await asyncio.wait({receiving, halting}, return_when=asyncio.FIRST_COMPLETED)
                if not receiving.done():
                    break
                delivery = receiving.result()
                receiving = None
                task = asyncio.create_task(self._handle_safely(delivery))
                in_flight.add(task)
                task.add_done_callback(in_flight.discard)
                task.add_done_callback(_log_abandoned)
                task.add_done_callback(lambda _: slots.release())
        except StopAsyncIteration:
            log.warning("delivery stream ended", extra={"event": "consume_ended", "queue": queue})
        finally:
            halting.cancel()
            if receiving is not None and not receiving.done():
                receiving.cancel()
                with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
                    await receiving
            with contextlib.suppress(Exception):
                await deliveries.aclose()  # type: ignore[attr-defined]

    async def _drain(self, in_flight: set[asyncio.Task[None]]) -> None:
        """Let in-flight work finish for up to ``drain_seconds``, then stop it unsettled.

        What is left is neither acked nor rejected: the broker hands it out again when this
        consumer's channel closes, and its job's lease lets the next claim take over.
        """
        deadline = self.rt.settings.drain_seconds
        log.info(
            "draining",
            extra={"event": "worker_draining", "inFlight": len(in_flight), "seconds": deadline},
        )
        _, pending = await asyncio.wait(set(in_flight), timeout=deadline)
        if pending:
            log.warning(
                "drain deadline passed: %d deliveries left unsettled for redelivery",
                len(pending),
                extra={"event": "drain_deadline", "unsettled": len(pending)},
            )
            for task in pending:
                task.cancel()

    async def _handle_safely(self, delivery: Delivery) -> None:
        try:
            while True:
                try:
                    await self.handle(delivery)
                    return
                except StoreError as exc:
                    # Not this message's fault: hold it (no release, so its delivery limit is
                    # untouched), pause consuming, and handle it again once the database
                    # answers. Every step of handle() is guarded, so starting over is safe.
                    log.warning(
                        "database unreachable, holding the delivery: %s",
                        exc,
                        extra={"event": "delivery_held"},
                    )
                    await self._wait_for_database()
        except Exception as exc:
            # A bug, or the broker failed: give it back. It is redelivered (to us or another
            # worker) and the job row is unchanged or guarded, so nothing is lost and nothing
            # is done twice. Releases count towards the delivery limit, so a message that
            # always fails is quarantined by the broker instead of looping.
            log.exception("delivery released after an error", extra={"event": "delivery_error"})
            try:
                await delivery.release()
            except Exception as exc2:  # the channel is gone: the broker requeues it anyway
                log.warning(
                    "release failed: %s (after %s)", exc2, exc, extra={"event": "release_failed"}
                )
        finally:
            self.handled += 1

    async def _wait_for_database(self) -> None:
        """Block until the database answers; one probe per worker, however many wait."""
        self._database_up.clear()
        if self._probe is None or self._probe.done():
            self._probe = asyncio.create_task(self._probe_database())
        await asyncio.shield(self._probe)

    async def _probe_database(self) -> None:
        log.warning("database unreachable: consuming paused", extra={"event": "consumer_paused"})
        delay = 0.25
        while True:
            try:
                await self.rt.store.ping()
                break
            except StoreError:
                await asyncio.sleep(delay)
                delay = min(delay * 2, _PROBE_BACKOFF_MAX)
        self._database_up.set()
        log.info("database reachable again: consuming resumed", extra={"event": "consumer_resumed"})

    # --- one delivery -----------------------------------------------------------------------

    async def handle(self, delivery: Delivery) -> None:
        """Handle one delivery; its log lines carry the trace id from its ``traceparent``."""
        self.rt.metrics.deliveries.inc()
        if delivery.redelivered:
            self.rt.metrics.redeliveries.inc()
        with logs.bound(traceId=logs.trace_id(delivery.headers.get("traceparent"))):
            await self._handle(delivery)

    async def _handle(self, delivery: Delivery) -> None:
        meta = {"redelivered": delivery.redelivered, "deliveryCount": delivery.delivery_count}
        try:
            message = decode(delivery.body, self.registry.types)
        except MessageDecodeError as exc:
            if exc.unknown and exc.job_id is not None:
                await self._unknown(delivery, exc.reason, exc.job_id, meta)
            else:
                await self._invalid(delivery, exc.reason, exc.job_id, meta)
            return
        logs.bind(jobId=message.job_id)
        # The happy path first: a claim guarded on exactly "ready to run" needs no read.
        if self._claims is not None:
            request = ClaimRequest(message.job_id, message.type, self.worker_id, meta)
            claimed = await self._claims.submit(request)
        else:
            claimed = await self.rt.store.claim_delivered(
                message.job_id, message.type, self.worker_id, self.rt.clock(), self.lease, **meta
            )
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
            decision = decide(observe_delivery(job.view(), self._seen_at(job)))
            if await self._act(delivery, message, job, decision, meta):
                return
        await self._defer(
            delivery, message.job_id, message.encode(), "claim kept losing races", None
        )

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
                await self.rt.store.record_event(
                    job.id, decision.event, now, reason=decision.reason, **meta
                )
                if decision.event == "duplicate_acked":
                    self.rt.metrics.duplicates_acked.inc()
                await self._settle(delivery, job.id, Action.ACK, job.attempt)
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
                        job.id, decision.reason or "", now, seen=job.view(), **meta
                    )
                    if not quarantined:
                        return False
                    self.rt.metrics.quarantined(job.state.value, decision.reason or "")
                else:
                    await self.rt.store.record_event(
                        job.id, decision.event, now, reason=decision.reason, **meta
                    )
                await self._settle(delivery, job.id, Action.REJECT, job.attempt)
                return True
            case Action.RUN:
                claim = await self.rt.store.claim_job(
                    job.id, self.worker_id, now, self.lease, seen=job.view(), **meta
                )
                if claim is None:
                    return False
                await self._run(delivery, claim, job, job.state)
                return True
        raise AssertionError(decision)  # pragma: no cover

    async def _run(
        self, delivery: Delivery, claim: Claim, job: JobRecord, claimed_from: JobState
    ) -> None:
        self.rt.metrics.transition(claimed_from.value, JobState.RUNNING.value)
        logs.bind(attempt=claim.attempt)
        run = AttemptRun(
            self.rt,
            self.registry,
            self.worker_id,
            self.lease,
            settle=self._settle,
            wait_for_database=self._wait_for_database,
            complete=self._completions.submit if self._completions is not None else None,
        )
        await run.run(delivery, job, claim)

    async def _claim_many(self, requests: Sequence[ClaimRequest]) -> list[Claimed]:
        return await self.rt.store.claim_many(requests, self.rt.clock(), self.lease)

    async def _complete_many(self, requests: Sequence[CompleteRequest]) -> list[bool]:
        won = await self.rt.store.complete_many(requests, self.rt.clock())
        return [r.claim.job_id in won for r in requests]

    # --- settling ---------------------------------------------------------------------------

    async def _settle(self, delivery: Delivery, job_id: str, action: Action, attempt: int) -> None:
        """Ack or reject AFTER the outcome is committed, then record whether the broker took it.

        ``settle_lost``: the channel the delivery came on had closed, so the broker requeues
        the message and its redelivery is handled as a duplicate of the committed outcome.
        """
        self.rt.faults.hit("worker.before_ack")
        if action is Action.REJECT:
            taken = await delivery.reject()
            kind = "rejected"
        else:
            taken = await delivery.ack()
            kind = "ack_sent"
        detail: dict[str, Any] = {"attempt": attempt}
        if not taken:
            detail["action"] = kind
            kind = "settle_lost"
        log.info(kind, extra={"event": kind, "jobId": job_id, "attempt": attempt})
        await self.timeline.record(job_id, kind, self.rt.clock(), **detail)

    async def _defer(
        self,
        delivery: Delivery,
        job_id: str,
        body: bytes,
        reason: str,
        job: JobRecord | None,
        headers: dict[str, str] | None = None,
    ) -> None:
        delay = self._defer_delay(job)
        await self.rt.store.defer(job_id, body, delay, reason, self.rt.clock(), headers=headers)
        await self._settle(delivery, job_id, Action.ACK, job.attempt if job else 0)

    def _defer_delay(self, job: JobRecord | None) -> int:
        """The shortest retry tier that outlasts the other worker's lease, else the longest."""
        tiers = self.rt.topology.tiers
        if job is None or job.lease_expires_at is None:
            return tiers[0]
        remaining = math.ceil((job.lease_expires_at - self._seen_at(job)).total_seconds())
        return next((t for t in tiers if t >= remaining), tiers[-1])

    async def _unknown(
        self, delivery: Delivery, reason: str, job_id: str, meta: dict[str, Any]
    ) -> None:
        """A type or version this worker does not know, for an existing job: defer it.

        During a rolling deploy only the newer workers know it; quarantining here would
        punish the job for our age. Each deferral carries its count; past the delivery limit
        the job is quarantined saying no worker knew it.
        """
        job = await self.rt.store.get_job(job_id)
        if job is None:
            await self._invalid(delivery, f"{reason} (and no such job)", None, meta)
            return
        if job.state.is_terminal:
            decision = decide(observe_delivery(job.view(), self._seen_at(job)))
            message = JobMessage(job.id, job.type)
            await self._act(delivery, message, job, decision, meta)
            return
        defers = str(delivery.headers.get(DEFERS_HEADER, "0"))
        count = int(defers) if defers.isdigit() else 0
        limit = self.rt.settings.delivery_limit
        if count >= limit:
            await self._invalid(
                delivery, f"{reason}: no worker knew it after {count} deferrals", job_id, meta
            )
            return
        await self._defer(
            delivery,
            job_id,
            delivery.body,
            f"{reason} (not known to this worker; deferral {count + 1}/{limit})",
            None,
            headers={DEFERS_HEADER: str(count + 1)},
        )

    async def _invalid(
        self, delivery: Delivery, reason: str, job_id: str | None, meta: dict[str, Any]
    ) -> None:
        job = await self.rt.store.get_job(job_id) if job_id else None
        decision = decide(InvalidPayload(reason, job.state if job else None))
        now = self.rt.clock()
        if job is not None:
            if decision.new_state is not None:
                # Guarded on the job as read: a good copy that claimed it since wins.
                if await self.rt.store.quarantine(
                    job.id, decision.reason or reason, now, seen=job.view(), **meta
                ):
                    self.rt.metrics.quarantined(job.state.value, decision.reason or reason)
            else:
                await self.rt.store.record_event(job.id, decision.event, now, reason=reason, **meta)
        log.warning(
            "invalid message rejected: %s",
            reason,
            extra={"event": "invalid_message", "jobId": job_id, "reason": reason},
        )
        if job is not None:
            await self._settle(delivery, job.id, Action.REJECT, job.attempt)
        else:
            self.rt.faults.hit("worker.before_ack")
            await delivery.reject()
