"""The worker: take a delivery, ask the policy, commit the outcome, THEN settle the delivery.

The order is the whole point. The job row is claimed (attempt += 1, lease) before work
starts, so a worker killed mid-export still spends an attempt and a crash loop ends in
quarantine. The outcome (``succeeded`` + result key, ``retry_wait`` + an outbox row for the
delay route, or ``quarantined``) is committed before the ack or reject, so a crash between
the two leaves a redelivery that finds the job finished and is acked without redoing it.

The worker publishes nothing itself: retries and deferrals are outbox rows the relay sends.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import socket
import time
import uuid
from datetime import timedelta
from typing import Any

from jobrelay import logs
from jobrelay.domain.messages import JobMessage, MessageDecodeError, decode
from jobrelay.domain.policy import (
    Action,
    Decision,
    InvalidPayload,
    Observation,
    PermanentFailure,
    ResultSaved,
    TransientFailure,
    decide,
    observe_delivery,
)
from jobrelay.domain.states import JobState
from jobrelay.errors import OperationError, PermanentError, StoreError
from jobrelay.operations.base import OperationContext, Registry, default_registry
from jobrelay.runtime import Runtime
from jobrelay.storage.store import JobRecord, NewJob
from jobrelay.transport.base import Delivery

log = logging.getLogger("jobrelay.worker")

# A claim can lose a race (another worker, a retry not yet due); re-read and decide again a
# few times, then defer rather than drop.
_MAX_DECISION_ROUNDS = 3
_STORE_BACKOFF_MAX = 8.0  # seconds a delivery is held before release while the database is down


def _log_abandoned(task: asyncio.Task[None]) -> None:
    """A handler ended by something stronger than an Exception (a simulated crash, exit)."""
    if not task.cancelled() and task.exception() is not None:
        log.error("delivery abandoned: %r", task.exception(), extra={"event": "abandoned"})


def new_worker_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"


class Worker:
    def __init__(
        self, rt: Runtime, *, registry: Registry | None = None, worker_id: str | None = None
    ) -> None:
        self.rt = rt
        self.registry = registry or default_registry(rt.settings)
        self.worker_id = worker_id or new_worker_id()
        self.lease = timedelta(seconds=rt.settings.lease_seconds)
        self.handled = 0
        self._store_failures = 0  # in a row, for the back-off before a release

    # --- the consume loop -------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        """Consume until ``stop`` is set, then drain: finish and settle what is in flight."""
        prefetch = self.rt.settings.prefetch
        slots = asyncio.Semaphore(prefetch)
        in_flight: set[asyncio.Task[None]] = set()
        log.info(
            "worker started",
            extra={"event": "worker_started", "worker": self.worker_id, "prefetch": prefetch},
        )
        deliveries = self.rt.transport.consume(prefetch)
        iterator = deliveries.__aiter__()
        stopping = asyncio.ensure_future(stop.wait())
        receiving: asyncio.Future[Delivery] | None = None
        hard_stop = False
        try:
            while not stop.is_set():
                await slots.acquire()
                receiving = asyncio.ensure_future(anext(iterator))
                await asyncio.wait({receiving, stopping}, return_when=asyncio.FIRST_COMPLETED)
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
            log.warning("delivery stream ended", extra={"event": "consume_ended"})
        except asyncio.CancelledError:
            hard_stop = True  # killed, not asked to stop: abandon work like a dead process
            raise
        finally:
            stopping.cancel()
            if receiving is not None and not receiving.done():
                receiving.cancel()
                with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
                    await receiving
            if in_flight:
                if hard_stop:
                    for task in in_flight:
                        task.cancel()
                else:
                    log.info(
                        "draining", extra={"event": "worker_draining", "inFlight": len(in_flight)}
                    )
                await asyncio.gather(*in_flight, return_exceptions=True)
            with contextlib.suppress(Exception):
                await deliveries.aclose()  # type: ignore[attr-defined]
            log.info("worker stopped", extra={"event": "worker_stopped", "handled": self.handled})

    async def _handle_safely(self, delivery: Delivery) -> None:
        try:
            await self.handle(delivery)
            self._store_failures = 0
        except Exception as exc:
            # Give it back: it is redelivered (to us or another worker) and the job row is
            # unchanged or guarded, so nothing is lost and nothing is done twice. Releases
            # count towards the delivery limit, so a message that always fails is quarantined
            # by the broker instead of looping.
            log.exception("delivery released after an error", extra={"event": "delivery_error"})
            if isinstance(exc, StoreError):
                # The database is down: not this message's fault. Released at once it would
                # bounce between workers and use up its delivery limit within a second, so
                # hold it for a growing back-off (while it holds a prefetch slot, no more
                # arrive) and release it after.
                self._store_failures += 1
                await asyncio.sleep(min(0.25 * 2**self._store_failures, _STORE_BACKOFF_MAX))
            try:
                await delivery.release()
            except Exception as exc:  # the channel is gone: the broker requeues it anyway
                log.warning("release failed: %s", exc, extra={"event": "release_failed"})
        finally:
            self.handled += 1

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
            await self._invalid(delivery, exc.reason, exc.job_id, meta)
            return
        logs.bind(jobId=message.job_id)
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
            decision = decide(observe_delivery(job.view(), self.rt.clock()))
            if await self._act(delivery, message, job, decision, meta):
                return
        await self._defer(delivery, message, "claim kept losing races", meta)

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
                await self._defer(delivery, message, decision.reason or "deferred", meta, job)
                return True
            case Action.REJECT:
                if decision.new_state is not None:
                    quarantined = await self.rt.store.quarantine(
                        job.id, decision.reason or "", now, **meta
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
                attempt = await self.rt.store.claim_job(
                    job.id, self.worker_id, now, self.lease, **meta
                )
                if attempt is None:
                    return False
                self.rt.metrics.transition(job.state.value, JobState.RUNNING.value)
                logs.bind(attempt=attempt)
                await self._run(delivery, job, attempt)
                return True
        raise AssertionError(decision)  # pragma: no cover

    async def _run(self, delivery: Delivery, job: JobRecord, attempt: int) -> None:
        log.info(
            "job claimed",
            extra={
                "event": "claimed",
                "jobId": job.id,
                "attempt": attempt,
                "worker": self.worker_id,
            },
        )
        operation = self.registry.get(job.type)
        assert operation is not None  # decode() only accepts registered types
        context = OperationContext(
            job=job,
            attempt=attempt,
            store=self.rt.store,
            results=self.rt.results,
            faults=self.rt.faults,
            report_progress=lambda done, total: self.rt.store.report_progress(
                job.id, self.worker_id, done, total, self.rt.clock()
            ),
            clock=self.rt.clock,
        )
        observation: Observation
        started = time.monotonic()
        heartbeat = asyncio.create_task(self._heartbeat(job.id))
        try:
            result = await operation.run(context)
            observation = ResultSaved(result.result_key)
        except PermanentError as exc:
            observation = PermanentFailure(str(exc))
        except (OperationError, StoreError) as exc:
            observation = self._transient(job, attempt, str(exc))
        except Exception as exc:  # an operation bug: retried, then quarantined, never a hot loop
            log.exception("operation raised", extra={"event": "operation_error", "jobId": job.id})
            observation = self._transient(job, attempt, f"unexpected {type(exc).__name__}: {exc}")
        finally:
            heartbeat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await heartbeat
        await self._commit_outcome(
            delivery,
            job,
            attempt,
            observation,
            result_meta=(result.meta if isinstance(observation, ResultSaved) else {}),
            started=started,
            follow_ups=(result.follow_ups if isinstance(observation, ResultSaved) else ()),
        )

    def _transient(self, job: JobRecord, attempt: int, error: str) -> TransientFailure:
        return TransientFailure(error, attempt, job.max_attempts, self.rt.settings.retry_delays)

    async def _commit_outcome(
        self,
        delivery: Delivery,
        job: JobRecord,
        attempt: int,
        observation: Observation,
        result_meta: dict[str, Any],
        started: float | None = None,
        follow_ups: tuple[NewJob, ...] = (),
    ) -> None:
        decision = decide(observation)
        now = self.rt.clock()
        store = self.rt.store
        if isinstance(observation, ResultSaved):
            won = await store.complete(
                job.id,
                self.worker_id,
                observation.result_key,
                {**result_meta, "attempt": attempt},
                now,
                follow_ups=follow_ups,
            )
        elif decision.action is Action.ACK:
            assert decision.retry_delay is not None
            won = await store.schedule_retry(
                job.id, self.worker_id, job.type, decision.reason or "", decision.retry_delay, now
            )
        else:
            won = await store.quarantine(
                job.id, decision.reason or "", now, worker_id=self.worker_id, attempt=attempt
            )
        log.info(
            decision.event,
            extra={
                "event": decision.event,
                "jobId": job.id,
                "attempt": attempt,
                "reason": decision.reason,
            },
        )
        self._measure(job, decision, won, started)
        if not won:
            # Our lease was taken over (we were presumed dead). The new owner has its own
            # delivery; ours is redundant. The result, if any, went to the same stable key.
            await store.record_event(
                job.id, "lease_lost", now, worker=self.worker_id, attempt=attempt
            )
            await self._settle(delivery, job.id, Action.ACK, attempt)
            return
        await self._settle(delivery, job.id, decision.action, attempt)

    def _measure(
        self, job: JobRecord, decision: Decision, won: bool, started: float | None
    ) -> None:
        metrics = self.rt.metrics
        target = decision.new_state.value if decision.new_state is not None else "unchanged"
        if started is not None:
            outcome = target if won else "lease_lost"
            metrics.job_duration.labels(type=job.type, outcome=outcome).observe(
                time.monotonic() - started
            )
        if not won:
            return
        if decision.new_state is JobState.QUARANTINED:
            metrics.quarantined(JobState.RUNNING.value, decision.reason or "")
        else:
            metrics.transition(JobState.RUNNING.value, target)
            if decision.new_state is JobState.RETRY_WAIT:
                metrics.retries.inc()

    async def _heartbeat(self, job_id: str) -> None:
        interval = self.lease.total_seconds() / 3
        while True:
            await asyncio.sleep(interval)
            now = self.rt.clock()
            try:
                held = await self.rt.store.renew_lease(
                    job_id, self.worker_id, now + self.lease, now
                )
            except StoreError as exc:
                log.warning(
                    "lease renewal failed: %s",
                    exc,
                    extra={"event": "lease_renew_failed", "jobId": job_id},
                )
                continue
            if not held:
                log.warning("lease lost", extra={"event": "lease_lost", "jobId": job_id})
                return

    # --- settling ---------------------------------------------------------------------------

    async def _settle(self, delivery: Delivery, job_id: str, action: Action, attempt: int) -> None:
        """Ack or reject AFTER the outcome is committed, then record that we did."""
        self.rt.faults.hit("worker.before_ack")
        if action is Action.REJECT:
            await delivery.reject()
            kind = "rejected"
        else:
            await delivery.ack()
            kind = "ack_sent"
        log.info(kind, extra={"event": kind, "jobId": job_id, "attempt": attempt})
        with contextlib.suppress(StoreError):
            await self.rt.store.record_event(job_id, kind, self.rt.clock(), attempt=attempt)

    async def _defer(
        self,
        delivery: Delivery,
        message: JobMessage,
        reason: str,
        meta: dict[str, Any],
        job: JobRecord | None = None,
    ) -> None:
        delay = self._defer_delay(job)
        await self.rt.store.defer(message.job_id, message.type, delay, reason, self.rt.clock())
        await self._settle(delivery, message.job_id, Action.ACK, job.attempt if job else 0)

    def _defer_delay(self, job: JobRecord | None) -> int:
        """The shortest retry tier that outlasts the other worker's lease, else the longest."""
        tiers = self.rt.topology.tiers
        if job is None or job.lease_expires_at is None:
            return tiers[0]
        remaining = math.ceil((job.lease_expires_at - self.rt.clock()).total_seconds())
        return next((t for t in tiers if t >= remaining), tiers[-1])

    async def _invalid(
        self, delivery: Delivery, reason: str, job_id: str | None, meta: dict[str, Any]
    ) -> None:
        job = await self.rt.store.get_job(job_id) if job_id else None
        decision = decide(InvalidPayload(reason, job.state if job else None))
        now = self.rt.clock()
        if job is not None:
            if decision.new_state is not None:
                if await self.rt.store.quarantine(job.id, decision.reason or reason, now, **meta):
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
