"""The reconciler: find jobs that fell between two hand-offs, repair what is safe, report the rest.

It runs inside every ``jobrelay relay`` (one leader at a time) every ``reconcile_seconds``, and
on demand as ``jobrelay reconcile [--dry-run]``. A pass looks for six things, each at least
``reconcile_grace_seconds`` overdue so that the normal path gets its chance first:

- ``lease_expired``: ``running``, but the worker's lease ran out (it died, and no redelivery
  took the job over). Repair: ``running -> retry_wait`` due now, plus a work message; the
  next delivery claims it, or quarantines it if no attempt is left.
  A job an operator asked to cancel while it ran (``storage.cancels``) is ended
  ``cancelled`` with the operator's reason instead: its worker died before it could.
- ``retry_overdue``: ``retry_wait`` past its due time with no message of it in the outbox.
  Repair: re-send the retry as a work message, once per wait; still overdue after that, the
  pass only reports it (are workers consuming?).
- ``queued_unclaimed``: ``queued`` and unchanged for the grace period (so never claimed in
  this wait), no message of it waiting in the outbox, its newest message confirmed by the
  broker more than the grace period ago, and that message gone: its queue has moved past it
  (more of the jobs of its queue published after it were claimed than the consuming
  workers' windows could hold before it), or the live workers of its queue sat idle for the
  grace period (``storage.queue_progress``). No constant grace tells a lost message from one
  waiting its turn behind a long backlog; the queue's progress does, however deep it is.
  Usually the delivery limit dead-lettered it after repeated returns from killed workers, or
  someone purged the queue. Repair: re-send the work message, as often as it stays lost,
  with back-off: the n-th re-send of a wait once the copy before it was confirmed
  ``grace * 2^(n-1)`` ago (at most an hour apart), so a message lost twice is sent a third
  time. A surplus copy costs one extra message, never a second run: the worker acks it as a
  duplicate (or defers it while the job runs). Between re-sends the pass reports it.
- ``not_consuming``: jobs of a queue wait as above and no live worker consumes the queue (no
  worker heartbeat naming it lately). One finding per queue, and nothing re-sent: its
  messages wait in the broker, and copies would only pile up.
- Jobs of a queue an operator has paused, or resumed less than the grace period ago, are
  neither re-sent nor reported as ``retry_overdue`` or ``queued_unclaimed``: their messages
  wait in the broker on purpose, and a long pause would otherwise look like a lost message.
- ``outbox_stale``: an outbox row no broker has confirmed. Reported: the relay owns
  publishing, and the row says why it fails.
- ``quarantine_mismatch``: a message in the quarantine queue whose job is not
  ``quarantined``. Reported.

The leader also prunes (retention, ``maintenance/prune.py``) at most once a minute after a pass.

One clock: a pass reads the database's clock once (``Store.db_now``: ``now()`` on
PostgreSQL, the store's clock on SQLite) and uses that instant for every judgement and every
write it makes, never the clock of the host it runs on, so a relay host whose clock is off
neither takes a live lease nor leaves an expired one.

Every repair is a guarded transition with its ``reconciled_*`` event (``actor`` = this
reconciler) and its outbox row in one transaction, so a job that moved on meanwhile — above
all a finished one — is never overwritten; the repair just loses its guard. Two reconcilers
racing are therefore safe; leadership only saves work. Leadership on PostgreSQL is
``pg_try_advisory_lock`` held on a dedicated connection while leading. On SQLite the relay of
the one process using the file (``jobrelay up`` or a single relay) is the only reconciler.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
import uuid
from collections.abc import Awaitable, Callable
from datetime import datetime, timedelta

from jobrelay.domain.states import JobState
from jobrelay.maintenance.findings import (
    FINDINGS,
    LEASE_EXPIRED,
    NOT_CONSUMING,
    OUTBOX_STALE,
    QUARANTINE_MISMATCH,
    QUEUED_UNCLAIMED,
    RETRY_OVERDUE,
    Finding,
    Report,
)
from jobrelay.maintenance.leadership import LOCK_KEY, Leadership, PassAbandoned
from jobrelay.maintenance.prune import Pruner
from jobrelay.observe.scrub import scrub
from jobrelay.runtime.wiring import Runtime
from jobrelay.storage.queue_pauses import pauses
from jobrelay.storage.queue_progress import queue_progress
from jobrelay.storage.repairs import RepairQueries, WaitingJob

log = logging.getLogger("jobrelay.reconcile")

_BATCH = 500
_MOVED = "left alone, the job moved on meanwhile"
# The longest wait between two re-sends of a lost queued message, in seconds.
RESEND_BACKOFF_MAX = 3600.0
# How often the leader looks for tables with stale statistics (``Pruner.analyze_if_stale``).
STATISTICS_SECONDS = 2.0


def new_reconciler_id() -> str:
    return f"reconciler:{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"


def _age(since: datetime | None, now: datetime) -> str:
    if since is None:
        return "?"
    seconds = int((now - since).total_seconds())
    return f"{seconds} s" if seconds < 120 else f"{seconds // 60} min"


class Reconciler:
    def __init__(
        self,
        rt: Runtime,
        *,
        actor: str | None = None,
        batch: int = _BATCH,
        pruner: Pruner | None = None,
    ) -> None:
        self.rt = rt
        self.pruner = pruner
        self.actor = actor or new_reconciler_id()
        self.batch = batch
        self.queries = RepairQueries(rt.store)
        self._reported: set[tuple[str, str | None]] = set()

    async def run_once(
        self,
        *,
        dry_run: bool = False,
        scan_quarantine: bool = True,
        record: bool = True,
        leadership: Leadership | None = None,
    ) -> Report:
        """One pass. ``record=False`` (the overview's on-demand dry run) leaves the metrics
        and the log alone: a look is not a reconciler pass. With ``leadership`` (the run
        loop's), ``PassAbandoned`` ends the pass where its leadership was lost."""
        report = Report(dry_run=dry_run)
        term = None if leadership is None else leadership.term

        async def still_leading() -> None:
            # Before each step: never act on what was read before a failover (river#1302).
            if leadership is not None and term is not None:
                await leadership.hold(term)

        # The database's clock, read once: every judgement and every write of this pass.
        now = await self.rt.store.db_now()
        before = now - timedelta(seconds=self.rt.settings.reconcile_grace_seconds)
        await self.rt.faults.ahit("reconcile.pass")  # tests and chaos: a failover here
        await still_leading()
        await self._expired_leases(report, before, now)
        await still_leading()
        held = await self._held_queues(before)
        await self._overdue_retries(report, before, now, held)
        await still_leading()
        await self._unclaimed_queued(report, before, now, held)
        await still_leading()
        await self._stale_outbox(report, before, now)
        if scan_quarantine:
            await still_leading()
            await self._quarantine_mismatches(report)
        if not record:
            return report
        metrics = self.rt.metrics
        for kind, n in report.counts().items():
            metrics.reconcile_findings.labels(finding=kind).set(n)
        metrics.reconcile_runs.inc()
        self._log(report)
        return report

    def _log(self, report: Report) -> None:
        """Repairs at INFO; a reported finding at WARNING the first time this reconciler sees
        it, then at DEBUG while it persists, so a periodic pass does not repeat itself."""
        for finding in report.findings:
            key = (finding.kind, finding.job_id)
            if finding.repaired:
                level = logging.INFO
            else:
                level = logging.DEBUG if key in self._reported else logging.WARNING
            log.log(
                level,
                "%s: %s",
                finding.kind,
                finding.detail,
                extra={
                    "event": f"reconcile_{finding.kind}",
                    "jobId": finding.job_id,
                    "repaired": finding.repaired,
                    "dryRun": report.dry_run,
                },
            )
        self._reported = {(f.kind, f.job_id) for f in report.findings if not f.repaired}
        if report.findings:
            log.info(
                "reconcile pass: %s",
                ", ".join(f"{n} {kind}" for kind, n in report.counts().items() if n),
                extra={"event": "reconcile_pass", "repaired": report.repaired, **report.counts()},
            )

    async def _expired_leases(self, report: Report, before: datetime, now: datetime) -> None:
        for job in await self.queries.expired_leases(before, self.batch):
            cancel = job.cancel_requested_at is not None
            if report.dry_run:
                repaired = False
            elif cancel:
                repaired = await self.rt.store.end_abandoned(job.id, now)
            else:
                repaired = await self.queries.requeue_expired_lease(
                    job.id, job.lease_owner, before, now, self.actor
                )
            target = JobState.CANCELLED if cancel else JobState.RETRY_WAIT
            if repaired:
                self.rt.metrics.reconcile_repairs.labels(finding=LEASE_EXPIRED).inc()
                self.rt.metrics.transition(JobState.RUNNING.value, target.value)
            done, would = (
                ("cancelled", "would cancel") if cancel else ("re-queued", "would re-queue")
            )
            action = done if repaired else (would if report.dry_run else _MOVED)
            if cancel:
                action = f"cancel requested by {job.cancel_requested_by}: {action}"
            report.findings.append(
                Finding(
                    LEASE_EXPIRED,
                    job.id,
                    f"running attempt {job.attempt}/{job.max_attempts} on {job.lease_owner}, "
                    f"lease expired {_age(job.lease_expires_at, now)} ago: {action}",
                    repaired,
                )
            )

    async def _held_queues(self, before: datetime) -> set[str]:
        """Queues paused now, or resumed since ``before``: their messages wait on purpose."""
        return {
            name
            for name, pause in (await pauses(self.rt.store)).items()
            if pause.paused or pause.changed_at >= before
        }

    async def _overdue_retries(
        self, report: Report, before: datetime, now: datetime, held: set[str]
    ) -> None:
        for overdue in await self.queries.overdue_retries(before, self.batch):
            job = overdue.job
            if job.queue in held:
                continue
            await self._resend_once(
                report,
                RETRY_OVERDUE,
                overdue,
                f"retry of attempt {job.attempt} was due {_age(job.next_attempt_at, now)} ago",
                " and no message waits in the outbox",
                self.queries.requeue_overdue_retry,
                before,
                now,
            )

    async def _unclaimed_queued(
        self, report: Report, before: datetime, now: datetime, held: set[str]
    ) -> None:
        """A ``queued`` job is re-sent only when its message is gone, never because it waited
        longer than the grace: a backlog longer than any constant grace is normal. Gone means
        the queue has moved past it (more of the jobs published after it were claimed than
        the consuming workers' windows could hold before it), or its workers sat idle for the
        whole grace period. With no worker consuming its queue, the pass says so instead."""
        by_queue: dict[str, list[WaitingJob]] = {}
        for waiting in await self.queries.unclaimed_queued(before, self.batch):
            if waiting.job.queue not in held:
                by_queue.setdefault(waiting.job.queue, []).append(waiting)
        # A worker beats every heartbeat_seconds: one seen within three beats is alive.
        beats = 3 * self.rt.settings.heartbeat_seconds
        alive_since = now - timedelta(seconds=max(beats, self.rt.settings.reconcile_grace_seconds))
        for queue, waits in by_queue.items():
            oldest = min((w.confirmed_at or before) for w in waits)
            progress = await queue_progress(
                self.rt.store, queue, before, oldest, self.rt.settings.prefetch, alive_since
            )
            if not progress.consumers:
                self._not_consuming(report, queue, waits, now)
                continue
            for waiting in waits:
                if progress.active and not progress.moved_past(waiting.confirmed_at):
                    continue  # waiting its turn: its queue is moving and has not passed it
                await self._resend_unclaimed(report, waiting, before, now)

    def _not_consuming(
        self, report: Report, queue: str, waits: list[WaitingJob], now: datetime
    ) -> None:
        """One finding per queue: its messages wait in the broker, no copy would help."""
        oldest = min((w.confirmed_at or now) for w in waits)
        more = "" if len(waits) < self.batch else " or more"
        report.findings.append(
            Finding(
                NOT_CONSUMING,
                None,
                f"queue {queue}: {len(waits)}{more} job(s) queued, the oldest message "
                f"confirmed {_age(oldest, now)} ago, and no live worker consumes the queue: "
                "workers are not consuming (nothing re-sent; start a worker with this queue)",
            )
        )

    async def _resend_unclaimed(
        self, report: Report, waiting: WaitingJob, before: datetime, now: datetime
    ) -> None:
        grace = self.rt.settings.reconcile_grace_seconds
        job = waiting.job
        what = (
            f"queued {_age(job.updated_at, now)}, its message confirmed "
            f"{_age(waiting.confirmed_at, now)} ago and never claimed"
        )
        if waiting.resends:
            wait = min(grace * 2**waiting.resends, max(grace, RESEND_BACKOFF_MAX))
            due = (waiting.confirmed_at or now) + timedelta(seconds=wait)
            what += f", re-sent {waiting.resends} time(s) already"
            if due > now:
                report.findings.append(
                    Finding(
                        QUEUED_UNCLAIMED,
                        job.id,
                        f"{what}: next re-send in {_age(now, due)} unless it is claimed "
                        "(are workers consuming?)",
                    )
                )
                return
        repaired = not report.dry_run and await self.queries.requeue_unclaimed(
            job.id, before, now, self.actor
        )
        if repaired:
            self.rt.metrics.reconcile_repairs.labels(finding=QUEUED_UNCLAIMED).inc()
        action = "re-sent" if repaired else ("would re-send" if report.dry_run else _MOVED)
        why = ": its queue moved past it or sat idle, so the broker lost or dead-lettered it"
        report.findings.append(
            Finding(QUEUED_UNCLAIMED, job.id, f"{what}{why}: {action}", repaired)
        )

    async def _resend_once(
        self,
        report: Report,
        kind: str,
        waiting: WaitingJob,
        what: str,
        why: str,
        repair: Callable[[str, datetime, datetime, str], Awaitable[bool]],
        before: datetime,
        now: datetime,
    ) -> None:
        """Re-send a waiting job's message once; after that only report it, so a worker
        outage never piles up copies."""
        job = waiting.job
        if waiting.requeued_before:
            report.findings.append(
                Finding(
                    kind,
                    job.id,
                    f"{what}, still waiting after the reconciler re-sent it: "
                    "are workers consuming?",
                )
            )
            return
        repaired = not report.dry_run and await repair(job.id, before, now, self.actor)
        if repaired:
            self.rt.metrics.reconcile_repairs.labels(finding=kind).inc()
        action = "re-sent" if repaired else ("would re-send" if report.dry_run else _MOVED)
        report.findings.append(Finding(kind, job.id, f"{what}{why}: {action}", repaired))

    async def _stale_outbox(self, report: Report, before: datetime, now: datetime) -> None:
        for row in await self.queries.stale_outbox(before, self.batch):
            error = f", last error: {scrub(row.last_error)}" if row.last_error else ""
            report.findings.append(
                Finding(
                    OUTBOX_STALE,
                    row.job_id,
                    f"outbox row {row.id} ({row.destination}, job {row.job_state.value}) "
                    f"unpublished for {_age(row.created_at, now)} after {row.publish_attempts} "
                    f"publish attempt(s){error}: is a relay running?",
                )
            )

    async def _quarantine_mismatches(self, report: Report) -> None:
        from jobrelay.maintenance.quarantine_scan import scan_quarantine

        letters = await scan_quarantine(self.rt, self.batch)
        report.quarantine_scanned = len(letters)
        by_job: dict[str, list[str | None]] = {}
        for letter in letters:
            if letter.job_id is not None:
                by_job.setdefault(letter.job_id, []).append(letter.reason)
        states = await self.queries.states_of(by_job)
        for job_id, reasons in by_job.items():
            state = states.get(job_id)
            if state is None or state is JobState.QUARANTINED:
                continue
            why = ", ".join(sorted({r or "unknown" for r in reasons}))
            copies = f"{len(reasons)} message(s) dead-lettered ({why})"
            purge = "`jobrelay quarantine purge` removes them"
            if state in (JobState.SUCCEEDED, JobState.CANCELLED) or state is JobState.RUNNING:
                advice = f"stale copies, safe to remove: {purge}"
            else:
                advice = (
                    "if that was its only message, the reconciler re-sends it "
                    f"({QUEUED_UNCLAIMED} or {RETRY_OVERDUE}) once it has waited "
                    f"for the grace period; the copies are stale: {purge}"
                )
            report.findings.append(
                Finding(QUARANTINE_MISMATCH, job_id, f"job is {state.value} but {copies}; {advice}")
            )

    # --- periodic, with leadership ----------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        """Every ``reconcile_seconds`` while leading, until ``stop``."""
        interval = self.rt.settings.reconcile_seconds
        if interval <= 0:
            log.info("reconciler disabled", extra={"event": "reconcile_disabled"})
            await stop.wait()  # ending early would read as a crashed part of the process
            return
        # Broker-side reads on RabbitMQ touch the messages (see quarantine_scan): on demand only.
        scan = self.rt.settings.uses_local_broker
        pruner = self.pruner or Pruner(self.rt)
        next_pass = time.monotonic()
        async with Leadership(self.rt) as leadership:
            while not stop.is_set():
                leading = passing = False
                try:
                    leading = await leadership.check()
                    passing = leading and time.monotonic() >= next_pass
                    if passing:
                        next_pass = time.monotonic() + interval
                        await self.run_once(scan_quarantine=scan, leadership=leadership)
                except PassAbandoned as exc:
                    log.warning("%s", exc, extra={"event": "reconcile_pass_abandoned"})
                    next_pass = time.monotonic()  # a fresh pass, on what is read now
                except Exception:
                    log.exception("reconcile pass failed", extra={"event": "reconcile_failed"})
                try:
                    if passing:
                        await pruner.run_if_due()  # retention: see maintenance/prune.py
                except Exception:
                    log.exception("prune failed", extra={"event": "prune_failed"})
                try:
                    if leading:
                        await pruner.analyze_if_stale()
                except Exception:
                    log.exception("analyze failed", extra={"event": "analyze_failed"})
                # The leader wakes more often than it reconciles, to catch a burst's stale
                # statistics within seconds; the others only try the leadership each pass.
                wait = min(interval, STATISTICS_SECONDS) if leading else interval
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(wait):
                        await stop.wait()


__all__ = [
    "FINDINGS",
    "LOCK_KEY",
    "NOT_CONSUMING",
    "Finding",
    "Leadership",
    "PassAbandoned",
    "Reconciler",
    "Report",
]
