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

This module is the consume loop (a consumer per queue, its broker window of ``prefetch``
deliveries and its ``concurrency`` slots, the drain on SIGTERM, the outage pause); what one
delivery means is ``worker.delivery``. Each turn starts every buffered delivery a free slot
allows, so their claims go as one statement, and their completions and acks batch likewise
(``batching``, ``transport.rabbit_acks``).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import os
import socket
import uuid
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from jobrelay.errors import ConfigError, StoreDataError, StoreError
from jobrelay.library.operations import Registry
from jobrelay.runtime.heartbeat import heartbeat
from jobrelay.runtime.wiring import Runtime
from jobrelay.storage.queue_pauses import paused_queues
from jobrelay.transport.base import Delivery
from jobrelay.worker.backoff import Backoff
from jobrelay.worker.delivery import DeliveryHandler
from jobrelay.worker.failures import record_release
from jobrelay.worker.loop_watch import LoopWatch
from jobrelay.worker.queue_gate import QueueGate
from jobrelay.worker.scope import WorkerScope
from jobrelay.worker.slots import Slots, delivery_slots
from jobrelay.worker.timeline import TimelineWriter

log = logging.getLogger("jobrelay.worker")

_PROBE_BACKOFF_MAX = 8.0  # seconds between database probes while it is unreachable


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
        # The deliveries being handled, each until its settle (``idle``).
        self.in_flight: set[asyncio.Task[None]] = set()
        # Set while the database answers; cleared by an outage, which pauses consuming.
        self._database_up = asyncio.Event()
        self._database_up.set()
        self._probe: asyncio.Task[None] | None = None
        self.timeline = TimelineWriter(rt.store)
        # The operators' queue pauses (``jobrelay queues pause``), polled while running.
        self.gate = QueueGate(
            lambda: paused_queues(rt.store), self.queues, rt.settings.queue_pause_poll_seconds
        )
        self.deliveries = DeliveryHandler(
            WorkerScope.open(
                rt,
                registry,
                self.worker_id,
                self.lease,
                timeline=self.timeline,
                wait_for_database=self._wait_for_database,
            )
        )

    @property
    def idle(self) -> bool:
        """No delivery in hand and every timeline event written: what ``jobrelay.testing``'s
        ``drain`` waits for before it reads the jobs."""
        return not self.in_flight and self.timeline.idle

    # --- the consume loop -------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        """Consume until ``stop`` is set, then drain: finish and settle what is in flight.

        One consumer per queue, each with ``prefetch`` slots of its own, so a queue of slow
        jobs never starves another; all of them hand deliveries to the same handling. The
        consumers stop together (``stop``, or one of them ending or failing), and only then
        is what is in flight drained. The hot statements' connections are open before the
        worker says it started and stay open until the drain is over.
        """
        async with self.rt.store.hot_connections():
            await self._run(stop)

    async def _run(self, stop: asyncio.Event) -> None:
        prefetch = self.rt.settings.prefetch
        concurrency = min(self.rt.settings.concurrency, prefetch)
        in_flight = self.in_flight
        log.info(
            "worker started",
            extra={
                "event": "worker_started",
                "worker": self.worker_id,
                "prefetch": prefetch,
                "concurrency": concurrency,
                "queues": list(self.queues),
            },
        )
        halt = asyncio.Event()  # stop is set, or a consumer ended: every consumer stops
        settings = self.rt.settings
        watchdog = LoopWatch(self.rt.metrics, settings.loop_lag_warn_seconds, self.worker_id)
        # What the worker starts is stopped on every way out, a failed startup included, and
        # each of these even when one before it fails or is cancelled (last in, first out).
        async with contextlib.AsyncExitStack() as started:
            started.callback(self._log_stopped)
            beating = await started.enter_async_context(contextlib.AsyncExitStack())
            started.push_async_callback(self.timeline.close)
            started.callback(watchdog.stop)
            watchdog.start()
            started.callback(self.deliveries.threads.close)
            started.push_async_callback(self.deliveries.leases.close)
            self.timeline.start_batching()
            await self.gate.refresh()
            watching = asyncio.create_task(self.gate.watch())
            started.callback(watching.cancel)
            await beating.enter_async_context(
                heartbeat(self.rt, self.worker_id, "worker", self.queues)
            )
            await self._consume_all(stop, prefetch, concurrency, halt, in_flight)

    def _log_stopped(self) -> None:
        turns = self.deliveries.scope.turns
        log.info(
            "worker stopped",
            extra={
                "event": "worker_stopped",
                "handled": self.handled,
                # Claims in a slot lent by a pending completion (``worker.slots``): in that
                # completion's statement, or after its commit.
                "claimsBesideLender": turns.beside,
                "claimsAfterLender": turns.after,
            },
        )

    async def _consume_all(
        self,
        stop: asyncio.Event,
        prefetch: int,
        concurrency: int,
        halt: asyncio.Event,
        in_flight: set[asyncio.Task[None]],
    ) -> None:
        """The consumers until ``stop`` or one of them ends, then the drain."""
        consumers = [
            asyncio.create_task(self._consume(queue, prefetch, concurrency, halt, in_flight))
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
        for consumer in consumers:  # a consumer that failed fails the worker
            failure = None if consumer.cancelled() else consumer.exception()
            if failure is not None:
                raise failure

    async def _consume(
        self,
        queue: str,
        prefetch: int,
        concurrency: int,
        halt: asyncio.Event,
        in_flight: set[asyncio.Task[None]],
    ) -> None:
        """One queue's consumer, left while an operator has the queue paused and started
        again on resume. Its ``slots`` (this queue's deliveries in flight) outlive the
        sessions, so work still running from before a pause keeps its slots after the resume."""
        slots = Slots(concurrency, set())
        while await self.gate.wait_running(queue, halt):
            leave = asyncio.Event()
            watcher = asyncio.create_task(self.gate.leave_when_paused(queue, halt, leave))
            try:
                ended = await self._session(queue, prefetch, slots, leave, in_flight)
            finally:
                watcher.cancel()
            if ended:
                return

    async def _session(
        self,
        queue: str,
        prefetch: int,
        slots: Slots,
        leave: asyncio.Event,
        in_flight: set[asyncio.Task[None]],
    ) -> bool:
        """Take deliveries until ``leave``; True if a delivery stream ended.

        The broker is asked only for free slots: the session starts with one consumer whose
        prefetch is what the work from earlier sessions (``foreign``) leaves free, and adds a
        consumer for the slots each of those frees as it ends (a consumer's prefetch cannot
        grow on RabbitMQ). So after a resume it never holds messages it cannot start while
        long jobs run, messages a next pause would have to give back. Its consumers keep
        their deliveries in flight settleable after it ends (``keep_in_flight``).

        Within that window a delivery is taken from the transport only for a free slot
        (``worker.slots``): the rest wait unclaimed in the transport's prefetch, the next
        batch of claims at hand.
        """
        foreign = set(slots.busy) | slots.aside  # a delivery set aside is still unsettled
        changed = asyncio.Event()  # a foreign task ended: slots to ask the broker for

        def foreign_ended(task: asyncio.Task[None]) -> None:
            foreign.discard(task)
            changed.set()

        for task in foreign:
            task.add_done_callback(foreign_ended)
        inbox: asyncio.Queue[Delivery | BaseException] = asyncio.Queue()
        feeds: list[asyncio.Task[None]] = []
        granted = 0
        leaving = asyncio.ensure_future(leave.wait())
        try:
            while not leave.is_set():
                changed.clear()
                if (free := prefetch - len(foreign) - granted) > 0:
                    feeds.append(asyncio.create_task(self._feed(queue, free, inbox, slots)))
                    granted += free
                waits: set[asyncio.Future[Any]] = {leaving, asyncio.ensure_future(changed.wait())}
                getting: asyncio.Future[Any]
                if self._database_up.is_set():
                    getting = asyncio.ensure_future(inbox.get())
                else:  # the outage pause: what we hold stays held; take nothing new
                    getting = asyncio.ensure_future(self._database_up.wait())
                waits.add(getting)
                try:
                    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    for waiting in waits - {leaving}:
                        waiting.cancel()
                if not getting.done() or getting.cancelled():
                    continue
                item = getting.result()
                if item is True:  # the database is back
                    continue
                # What else is buffered starts in this same turn: their claims go together
                # in one statement (the claim batcher takes a turn's requests at once).
                taken = [item]
                while not inbox.empty():
                    taken.append(inbox.get_nowait())
                ends = [each for each in taken if isinstance(each, BaseException)]
                for each in taken:
                    if not isinstance(each, BaseException):
                        self._start(each, slots, in_flight)
                for end in ends:  # how a consumer ended, once what it delivered started
                    if isinstance(end, StopAsyncIteration):
                        log.warning(
                            "delivery stream ended",
                            extra={"event": "consume_ended", "queue": queue},
                        )
                        return True
                    raise end
        finally:
            leaving.cancel()
            for task in foreign:
                task.remove_done_callback(foreign_ended)
            for feed in feeds:
                feed.cancel()
            await asyncio.gather(*feeds, return_exceptions=True)
            # Handed out just as the session ended: started like the rest (handle() holds it
            # while the database is away), never dropped.
            while not inbox.empty():
                if not isinstance(left := inbox.get_nowait(), BaseException):
                    self._start(left, slots, in_flight)  # its slot was reserved
        return False

    async def _feed(
        self,
        queue: str,
        prefetch: int,
        inbox: asyncio.Queue[Delivery | BaseException],
        slots: Slots,
    ) -> None:
        """One consumer of a session: its deliveries into ``inbox``, each with a slot
        reserved for it, then how it ended."""
        deliveries = self.rt.transport.consume(prefetch, queue=queue, keep_in_flight=True)
        try:
            while True:
                await slots.reserve()
                try:
                    delivery = await anext(deliveries)
                except BaseException:
                    slots.unreserve()
                    raise
                inbox.put_nowait(delivery)
        except StopAsyncIteration:
            inbox.put_nowait(StopAsyncIteration())
        except Exception as exc:
            inbox.put_nowait(exc)
        finally:
            with contextlib.suppress(Exception):
                await deliveries.aclose()  # type: ignore[attr-defined]

    def _start(self, delivery: Delivery, slots: Slots, in_flight: set[asyncio.Task[None]]) -> None:
        context = contextvars.copy_context()
        context.run(delivery_slots.set, slots)  # a def job waiting for a thread sets it aside
        task = asyncio.create_task(self._handle_safely(delivery), context=context)
        slots.started(task)
        in_flight.add(task)
        task.add_done_callback(in_flight.discard)
        task.add_done_callback(_log_abandoned)

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
        backoff = Backoff()
        try:
            while True:
                try:
                    await self.handle(delivery)
                    return
                except StoreDataError:
                    raise  # the database refused the data: the same steps would fail again
                except StoreError as exc:
                    # Not this message's fault: hold it (no release, so its delivery limit is
                    # untouched), pause consuming, and handle it again once the database
                    # answers, pausing longer each time it fails again (no hot loop). Every
                    # step of handle() is guarded, so starting over is safe.
                    log.warning(
                        "database unreachable, holding the delivery: %s",
                        exc,
                        extra={"event": "delivery_held"},
                    )
                    await self._wait_for_database()
                    await backoff.wait()
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
            await record_release(self.rt, delivery, exc, self.worker_id)
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

    async def handle(self, delivery: Delivery) -> None:
        """Handle one delivery (see ``worker.delivery``); the consume loop calls this."""
        await self.deliveries.handle(delivery)
