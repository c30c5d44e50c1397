"""The worker's loop watchdog: say when blocking code holds the event loop, and whose it is.

Every ``async def`` job of a worker, its lease renewals, claims, acks and time limits share
one event loop. A job that blocks it (``time.sleep``, a synchronous HTTP client, a CPU-bound
loop) stops all of them until it returns: its own time limit cannot fire (the attempt is then
failed when it returns, ``RunStop.overran``), and every other job waits behind it. Nothing in
the loop can notice that, so a thread does: every ``_TICK_SECONDS`` it asks the loop to answer
(``call_soon_threadsafe``) and measures how late the answer comes. The lag goes to the
``jobrelay_event_loop_lag_seconds`` histogram; a lag past ``JOBRELAY_LOOP_LAG_WARN_SECONDS``
is logged at WARNING while the loop is still blocked, naming the job the loop is running
(its task, ``job_task_name``) and the other ``async def`` jobs on it, and counted in
``jobrelay_event_loop_blocked_total``. Within one stall it is logged again when a job is
found running that was not named (a lag of the machine warned about naming none, then a
job blocking the loop before it answered), counted once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time

from jobrelay.observe.metrics import Metrics
from jobrelay.storage.store import JobRecord

log = logging.getLogger("jobrelay.worker")

_TICK_SECONDS = 0.25  # how often the loop is asked to answer
_JOB_TASK = "jobrelay-job"  # the name of an async job's task: jobrelay-job:<id>:<type>
_THREAD_JOB_TASK = "jobrelay-def-job"  # a def job's (it waits on the loop, never blocks it)


def job_task_name(job: JobRecord, operation: object) -> str:
    """The name of a running attempt's task, which the watchdog reads to name the job."""
    kind = _THREAD_JOB_TASK if getattr(operation, "in_thread", False) else _JOB_TASK
    return f"{kind}:{job.id}:{job.type}"


def _job_of(task: asyncio.Task[object] | None) -> tuple[str, str] | None:
    if task is None:
        return None
    kind, _, rest = task.get_name().partition(":")
    if kind != _JOB_TASK:
        return None
    job_id, _, job_type = rest.partition(":")
    return job_id, job_type


class LoopWatch:
    """A daemon thread measuring the lag of one event loop (``start`` on the loop, ``stop``)."""

    def __init__(self, metrics: Metrics, warn_seconds: float, worker_id: str) -> None:
        self.metrics = metrics
        self.warn_seconds = warn_seconds
        self.worker_id = worker_id
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._thread = threading.Thread(
            target=self._watch, args=(loop,), name="jobrelay-loop-watch", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _watch(self, loop: asyncio.AbstractEventLoop) -> None:
        while not self._stop.wait(_TICK_SECONDS):
            answered = threading.Event()
            asked = time.monotonic()
            try:
                loop.call_soon_threadsafe(answered.set)
            except RuntimeError:  # the loop is closed: the worker is gone
                return
            if not answered.wait(self.warn_seconds):
                named = self._blocked(loop, time.monotonic() - asked)
                while not answered.wait(_TICK_SECONDS):
                    if self._stop.is_set() or loop.is_closed():
                        return
                    # Still the same stall, but a job now runs in it (a lag of the machine
                    # just before a job blocked the loop was warned about naming none): say
                    # it again, so the block is named.
                    current = _job_of(asyncio.current_task(loop))
                    if current is not None and current != named:
                        named = self._blocked(loop, time.monotonic() - asked, again=True)
            self.metrics.loop_lag.observe(time.monotonic() - asked)

    def _blocked(
        self, loop: asyncio.AbstractEventLoop, lag: float, *, again: bool = False
    ) -> tuple[str, str] | None:
        """Said while the loop is still blocked, so the job named is the one blocking it;
        the job named (counted once per stall: ``again`` names the job found later in it)."""
        if not again:
            self.metrics.loop_blocked.inc()
        current = _job_of(asyncio.current_task(loop))
        on_loop: list[tuple[str, str]] = []
        # Read from this thread while the loop is blocked: it changes no task meanwhile. A
        # rare race with a finishing task's removal is not worth a wrong warning either.
        with contextlib.suppress(RuntimeError):
            on_loop = [job for task in asyncio.all_tasks(loop) if (job := _job_of(task))]
        jobs = sorted(set(on_loop), key=lambda job: job != current)
        if current is not None:
            culprit = f"job {current[0]} ({current[1]}) is running"
        else:
            culprit = "no job's own task is running (a task a job started, or the worker)"
        log.warning(
            "event loop blocked for %.1f s so far: %s; blocking code in an async def job "
            "stops every job, lease renewal and time limit of this worker",
            lag,
            culprit,
            extra={
                "event": "loop_blocked",
                "worker": self.worker_id,
                "seconds": round(lag, 3),
                "jobId": current[0] if current else None,
                "jobIds": [job_id for job_id, _ in jobs],
                "types": sorted({job_type for _, job_type in jobs}),
            },
        )
        return current
