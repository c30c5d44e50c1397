"""One claimed attempt: run the operation under its claim, commit the outcome, settle.

Everything here happens after a successful claim, so everything is fenced on it: the lease
renewals (the worker's one renewer, ``leases``), progress (advisory: a write the database
does not take is written later, ``progress``), the outcome and the publication of
the staged result. When a renewal (or a progress report) finds the claim gone, or cannot renew
it before the lease would end, the operation is cancelled; the run then tries to record a transient
failure, which loses (``lease_lost``) if another claim holds the job. A database outage while
the outcome is written holds the delivery and retries the same fenced write, with a growing
pause between tries, and the renewer keeps renewing the lease until that write has
committed: a result computed before an outage is not lost to a takeover while the database
answers renewals. A write the database refuses for its data (``StoreDataError``: a NUL
byte, a value that is not JSON) is never retried as it is: the job is quarantined with the
reason instead, and only that job (batched neighbours are answered alone).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from typing import Any

from jobrelay.domain.backoff import LONGEST_SECONDS, SHORTEST_SECONDS
from jobrelay.domain.backoff import Backoff as RetryBackoff
from jobrelay.domain.policy import (
    Action,
    Decision,
    Observation,
    PermanentFailure,
    ResultSaved,
    TransientFailure,
    decide,
)
from jobrelay.domain.states import JobState
from jobrelay.errors import (
    OperationError,
    PermanentError,
    Retry,
    StoreDataError,
    StoreError,
)
from jobrelay.library.operations import OperationContext
from jobrelay.observe import tracing
from jobrelay.observe.scrub import scrub
from jobrelay.results.staging import StagingResults
from jobrelay.storage.storable import outcome_json
from jobrelay.storage.store import Claim, CompleteRequest, Fenced, JobRecord, NewJob
from jobrelay.transport.base import Delivery
from jobrelay.worker.backoff import Backoff
from jobrelay.worker.failures import failure_texts, failure_traceback
from jobrelay.worker.loop_watch import job_task_name
from jobrelay.worker.progress import Progress
from jobrelay.worker.scope import WorkerScope
from jobrelay.worker.stopping import RunStop, end_cancelled, time_limit
from jobrelay.worker.threads import ThreadSlot

log = logging.getLogger("jobrelay.worker")


# Stored instead when even the quarantine with the refusal's reason was refused.
_UNSTORABLE = "the outcome could not be stored (the database refused its data)"


class AttemptRun:
    """The worker's side of one claim; made per claim, holding nothing between them."""

    def __init__(self, scope: WorkerScope, *, thread: ThreadSlot | None = None) -> None:
        self.scope = scope
        self.rt = scope.rt
        self.registry = scope.registry
        self.worker_id = scope.worker_id
        self.lease = scope.lease
        self._leases = scope.leases
        self._thread = thread  # a def job's, taken before the claim (worker.threads)
        self._renewed: Claim | None = None  # held by the worker's lease renewer

    async def run(self, delivery: Delivery, job: JobRecord, claim: Claim) -> None:
        """Run the operation under the claim, then commit its outcome and settle."""
        granted = time.monotonic() - self._claim_latency_allowance()
        log.debug(  # per job at DEBUG; at INFO, the timeline writer's line per batch
            "job claimed",
            extra={
                "event": "claimed",
                "jobId": job.id,
                "attempt": claim.attempt,
                "worker": self.worker_id,
            },
        )
        operation = self.registry.get(job.type)
        assert operation is not None  # decode() only accepts registered types
        results = StagingResults(self.rt.results, claim.attempt)
        lease_lost = asyncio.Event()

        def claim_gone() -> None:  # a progress write found another claim holding the job
            lease_lost.set()
            work.cancel()

        progress = Progress(self.rt, claim, claim_gone)
        context = OperationContext(
            job=job,
            attempt=claim.attempt,
            store=self.rt.store,
            results=results,
            faults=self.rt.faults,
            report_progress=progress.report,
            clock=self.rt.clock,
            lease_lost=lease_lost,
            worker=self.worker_id,
            thread=self._thread,
        )
        observation: Observation
        result: Any = None
        started = time.monotonic()
        work = asyncio.create_task(operation.run(context), name=job_task_name(job, operation))
        stop = RunStop(work, lease_lost, time_limit(operation, self.rt.settings))
        # The renewal outlives the operation: the worker's renewer renews the lease until
        # the outcome is committed (``_commit_outcome`` releases it then), however long that
        # write is held.
        self._leases.hold(claim, granted, work, lease_lost, stop.cancelled)
        self._renewed = claim
        try:
            try:
                result = await work
                # A body that blocked the loop returns before its timer could fire: past its
                # limit is past its limit, whatever it returned (issue 34, item 5).
                if stop.overran():
                    observation = self._transient(job, claim.attempt, *stop.why())
                else:
                    observation = ResultSaved(result.result_key)
            except asyncio.CancelledError:
                current = asyncio.current_task()
                if (current is not None and current.cancelling()) or not stop.stopped:
                    await results.discard()
                    raise  # we are being stopped: leave the delivery unsettled
                observation = self._transient(job, claim.attempt, *stop.why())
            except PermanentError as exc:
                observation = PermanentFailure(*failure_texts(exc), failure_traceback(exc))
            except (OperationError, StoreError) as exc:
                asked = exc.delay if isinstance(exc, Retry) else None
                trace = failure_traceback(exc)
                observation = self._transient(job, claim.attempt, *failure_texts(exc), asked, trace)
            except Exception as exc:  # an operation bug: retried, then quarantined, no hot loop
                log.exception(
                    "operation raised", extra={"event": "operation_error", "jobId": job.id}
                )
                trace = failure_traceback(exc)
                observation = self._transient(job, claim.attempt, *failure_texts(exc), None, trace)
            # A success writes the figures still pending itself; another outcome first.
            if isinstance(observation, ResultSaved):
                figures = await progress.take()
            else:
                await results.discard()
                figures = None
                await progress.flush()
            try:
                await self._commit_outcome(
                    delivery, job, claim, observation, result, results, started, figures
                )
            except BaseException:
                await results.discard()
                raise
        finally:
            progress.close()
            stop.close()
            self._stop_renewing()

    def _stop_renewing(self) -> None:
        if self._renewed is not None:
            self._leases.release(self._renewed)
            self._renewed = None

    def _claim_latency_allowance(self) -> float:
        # The store set the lease end when it ran the claim, a moment before we saw the
        # answer: count our lease from a little earlier than now, never later.
        return min(1.0, self.lease.total_seconds() / 10)

    def _transient(
        self,
        job: JobRecord,
        attempt: int,
        error: str,
        public: str,
        asked: float | None = None,
        trace: str | None = None,
    ) -> TransientFailure:
        """A transient failure; ``asked``: the next delay the job asked for (``Retry(delay=)``),
        as this topology can wait it (``Topology.retry_delay``), else the type's delays;
        ``trace``: where it raised (``worker.failures``)."""
        operation = self.registry.get(job.type)
        delays = getattr(operation, "retry_delays", None) or self.rt.settings.retry_delays
        backoff: RetryBackoff | None = getattr(operation, "backoff", None)
        delay: float | None = None
        if asked is not None:
            # A back-off's retry is held in the database: it waits exactly what was asked.
            held = backoff is not None
            delay = (
                min(LONGEST_SECONDS, max(SHORTEST_SECONDS, asked))
                if held
                else self.rt.topology.retry_delay(asked)
            )
        draw = random.uniform(-1.0, 1.0) if backoff is not None and backoff.jitter else 0.0
        return TransientFailure(
            error,
            attempt,
            job.max_attempts,
            delays,
            public,
            delay,
            asked,
            trace,
            backoff=backoff,
            draw=draw,
        )

    async def _commit_outcome(
        self,
        delivery: Delivery,
        job: JobRecord,
        claim: Claim,
        observation: Observation,
        result: Any,
        results: StagingResults,
        started: float | None = None,
        progress: tuple[int, int] | None = None,
    ) -> None:
        """Write the outcome, fenced on the claim, retrying through a database outage;
        ``progress``: the figures a success writes (``Progress.take``).

        An outage is retried (after the database answers, and a growing pause between
        failures); a refusal of the data becomes a quarantine with its reason; the lease is
        renewed meanwhile, and the renewal stops once the write has committed.
        """
        in_doubt = False  # a try failed mid-way: its commit may have landed unseen
        backoff = Backoff()
        refusals = 0
        while True:
            decision = decide(observation)
            try:
                fenced = await self._write_outcome(
                    job, claim, observation, decision, result, results, progress
                )
                if not fenced.won and in_doubt:
                    fenced = await self._own_earlier_commit(claim, decision, fenced)
                break
            except StoreDataError as exc:
                # Not an outage: the same write would fail forever. Store why instead.
                refusals += 1
                if refusals > 2:
                    raise
                log.warning(
                    "outcome refused by the database, quarantining the job: %s",
                    exc,
                    extra={"event": "outcome_refused", "jobId": job.id},
                )
                await results.discard()
                reason = scrub(f"{_UNSTORABLE}: {exc}") if refusals == 1 else _UNSTORABLE
                observation = PermanentFailure(reason)
            except StoreError as exc:
                in_doubt = True
                log.warning(
                    "outcome not written, the database is unreachable: %s",
                    exc,
                    extra={"event": "outcome_held", "jobId": job.id},
                )
                await self.scope.wait_for_database()
                await backoff.wait()
            except OperationError as exc:  # the staged result could not be published
                await results.discard()
                trace = failure_traceback(exc)
                observation = self._transient(job, claim.attempt, *failure_texts(exc), None, trace)
        self._stop_renewing()
        won = fenced.won
        if won:
            # A success is counted in the line per batch of settles (DEBUG per job); a retry
            # or a quarantine keeps its own INFO line.
            log.log(
                logging.DEBUG if decision.event == "result_saved" else logging.INFO,
                decision.event,
                extra={
                    "event": decision.event,
                    "jobId": job.id,
                    "attempt": claim.attempt,
                    "reason": decision.reason,
                },
            )
        self._measure(job, decision, won, started)
        self._trace(decision, observation, won)
        if not won:
            await results.discard(lost=True)
            if await end_cancelled(self.rt, claim, fenced):  # an operator cancelled it
                await self.scope.settle(delivery, claim.job_id, Action.ACK, claim.attempt)
            else:
                await self._lease_lost(delivery, claim, fenced)
            return
        # A success's decision names its result key, not a reason.
        said = None if decision.event == "result_saved" else decision.reason
        await self.scope.run_hooks(decision.event, job, claim.attempt, said)
        await self.scope.settle(delivery, job.id, decision.action, claim.attempt)

    def _trace(self, decision: Decision, observation: Observation, won: bool) -> None:
        """The outcome on the run's span: its name, and for a failure the account's reason
        as the status (the operators' text as the exception event, as their logs carry it).
        The retry's or quarantine's timeline event was added when it was written
        (``add_event``); the batched success's statement is no one job's, so it is added
        here, with the outcome's time."""
        if not won:
            tracing.annotate(**{"jobrelay.outcome": "fenced"})
            return
        tracing.annotate(**{"jobrelay.outcome": decision.event})
        if decision.event == "result_saved":
            tracing.event("result_saved", self.rt.clock())
        elif decision.reason:
            tracing.failed(decision.public or decision.reason, getattr(observation, "error", None))

    async def _write_outcome(
        self,
        job: JobRecord,
        claim: Claim,
        observation: Observation,
        decision: Decision,
        result: Any,
        results: StagingResults,
        progress: tuple[int, int] | None = None,
    ) -> Fenced:
        store = self.rt.store
        now = self.rt.clock()
        if isinstance(observation, ResultSaved):
            # Where this attempt stored it (on S3 a key of its own, uploaded by now).
            key = results.recorded_key(observation.result_key)
            # The operation's own meta, as it gave it: the attempt is the event's
            # (``result_saved``), never mixed into the application's dict.
            meta = dict(result.meta)
            outcome_json(key, meta)  # StoreDataError: refused before sent
            request = CompleteRequest(
                claim,
                key,
                meta,
                publish=results.publish if results.staged else None,
                follow_ups=tuple[NewJob, ...](result.follow_ups),
                result_value=result.value_json,
                progress=progress,
            )
            answer = await self.scope.complete(request, job.type)
            if isinstance(answer, Exception):
                raise answer  # the staged result could not be published: nothing committed
            return Fenced(True) if answer else await self._current(job.id)
        if decision.action is Action.ACK:
            assert decision.retry_delay is not None
            return await store.schedule_retry(
                claim,
                job.type,
                decision.reason or "",
                decision.retry_delay,
                now,
                hold=decision.held or self.rt.hold_retries,
                public=decision.public,
                asked_delay=getattr(observation, "asked_delay", None),
                traceback=getattr(observation, "traceback", None),
            )
        won = await store.quarantine(
            job.id,
            decision.reason or "",
            now,
            claim=claim,
            public=decision.public,
            traceback=getattr(observation, "traceback", None),
            attempt=claim.attempt,
        )
        return Fenced(True) if won else await self._current(job.id)

    async def _own_earlier_commit(self, claim: Claim, decision: Decision, lost: Fenced) -> Fenced:
        """A retried outcome lost its fence: did an earlier try of OURS commit it?

        Only this claim's own event counts (same attempt and worker): another delivery may
        have moved the job to the same state at the same attempt (attempts exhausted).
        """
        if lost.current_attempt != claim.attempt or lost.current_state is not decision.new_state:
            return lost
        if await self.rt.store.committed_by(claim, decision.event):
            return Fenced(True)
        return lost

    async def _current(self, job_id: str) -> Fenced:
        job = await self.rt.store.get_job(job_id)
        if job is None:
            return Fenced(False)
        return Fenced(False, job.attempt, job.state)

    async def _lease_lost(self, delivery: Delivery, claim: Claim, fenced: Fenced) -> None:
        """Our claim was superseded: record both tokens, change nothing else, ack.

        The claim that holds the job now has its own delivery; ours is redundant.
        """
        log.warning(
            "lease lost",
            extra={
                "event": "lease_lost",
                "jobId": claim.job_id,
                "attempt": claim.attempt,
                "currentAttempt": fenced.current_attempt,
            },
        )
        with contextlib.suppress(StoreError):
            await self.rt.store.record_event(
                claim.job_id,
                "lease_lost",
                self.rt.clock(),
                worker=self.worker_id,
                attempt=claim.attempt,
                currentAttempt=fenced.current_attempt,
                currentState=fenced.current_state.value if fenced.current_state else None,
            )
        await self.scope.settle(delivery, claim.job_id, Action.ACK, claim.attempt)

    def _measure(
        self, job: JobRecord, decision: Decision, won: bool, started: float | None
    ) -> None:
        metrics = self.rt.metrics
        target = decision.new_state.value if decision.new_state is not None else "unchanged"
        if started is not None:
            outcome = target if won else "lease_lost"
            metrics.job_took(job.type, outcome, time.monotonic() - started)
        if not won:
            return
        if decision.new_state is JobState.QUARANTINED:
            metrics.quarantined(JobState.RUNNING.value, decision.reason or "")
        else:
            metrics.transition(JobState.RUNNING.value, target)
            if decision.new_state is JobState.RETRY_WAIT:
                metrics.retries.inc()
