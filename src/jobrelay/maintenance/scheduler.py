"""The scheduler: turns the app's periodic schedules into jobs, in every relay and in ``up``.

No leader is elected. Every scheduler runs every schedule; what makes a tick one job is its
key (schedule name + the tick's instant), so a second scheduler's insert of the same tick
writes nothing (``storage/schedules.py``). A scheduler sleeps until the next tick of any
schedule (at most ``MAX_SLEEP``), then makes one pass over each: the ticks that came due
since the schedule's cursor are enqueued or, past ``JOBRELAY_SCHEDULE_CATCHUP``, skipped
and recorded in a ``ticks_skipped`` event. Time is the store's clock (PostgreSQL's ``now()``)
so schedulers on several hosts agree on which ticks are due.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import uuid
from datetime import datetime, timedelta

from jobrelay.domain.schedules import Catchup, Cron, Plan, plan
from jobrelay.library.periodic import Schedule
from jobrelay.runtime.wiring import Runtime
from jobrelay.storage.schedules import Definition, PassResult, ScheduleQueries

log = logging.getLogger("jobrelay.scheduler")

MAX_SLEEP = 30.0  # seconds: wakes at least this often, whatever the schedules say
ERROR_SLEEP = 1.0  # after a failed pass (the database is down): try again soon
LATE_AFTER = timedelta(seconds=5)


def scheduler_name() -> str:
    return f"scheduler:{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"


class Scheduler:
    def __init__(self, rt: Runtime, *, name: str | None = None) -> None:
        self.rt = rt
        self.name = name or scheduler_name()
        self.catchup = Catchup.parse(rt.settings.schedule_catchup)
        self.schedules: list[Schedule] = list(rt.job_app().schedules.values())
        self.queries = ScheduleQueries(rt.store)

    async def run(self, stop: asyncio.Event) -> None:
        if not self.schedules:
            await stop.wait()  # ending early would read as a crashed part of the process
            return
        log.info(
            "scheduler started: %s (catch-up: %s)",
            ", ".join(s.name for s in self.schedules),
            self.catchup,
            extra={"event": "scheduler_started", "scheduler": self.name},
        )
        while not stop.is_set():
            try:
                pause = await self.run_once()
            except Exception:
                log.exception("scheduler pass failed", extra={"event": "scheduler_failed"})
                pause = ERROR_SLEEP
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(pause):
                    await stop.wait()

    async def run_once(self) -> float:
        """One pass over every schedule; returns the seconds until the next tick is due.

        A schedule that fails (its tick's job cannot be built, a write of it fails) is
        logged and counted and the pass goes on with the others: one broken schedule must not
        starve the rest. The pass then comes back after ``ERROR_SLEEP`` to try it again.
        """
        until: float = MAX_SLEEP
        for schedule in self.schedules:
            try:
                result = await self.advance(schedule)
            except Exception:
                log.exception(
                    "schedule %s failed in this pass; the others go on",
                    schedule.name,
                    extra={"event": "schedule_failed", "schedule": schedule.name},
                )
                self.rt.metrics.schedule_failures.labels(schedule=schedule.name).inc()
                until = min(until, ERROR_SLEEP)
                continue
            wait = (schedule.cron.next_after(result.now) - result.now).total_seconds()
            until = min(until, wait)
        # A little after the tick, so the store's clock has surely reached it.
        return max(until, 0.0) + 0.005

    async def advance(self, schedule: Schedule) -> PassResult:
        """Every due tick of ``schedule`` (in batches: a long catch-up is several passes)."""
        keys = await self.rt.store.id_keys(self.rt.clock())
        definition = Definition(
            schedule.name,
            schedule.job_type,
            schedule.cron,
            lambda tick: schedule.tick_job(tick, keys),
        )
        while True:
            result = await self.queries.advance(definition, self._plan, self.name)
            self._record(schedule.name, result)
            if not result.more:
                return result

    def _plan(self, cron: Cron, cursor: datetime, now: datetime, paused: bool) -> Plan:
        return plan(cron, cursor, now, self.catchup, paused=paused)

    def _record(self, name: str, result: PassResult) -> None:
        metrics = self.rt.metrics
        for done in result.enqueued:
            if not done.created:
                continue
            delay = result.now - done.tick
            metrics.schedule_ticks_enqueued.labels(schedule=name).inc()
            metrics.schedule_tick_delay.observe(max(delay.total_seconds(), 0.0))
            metrics.transition("new", "queued")
            if delay > LATE_AFTER:
                metrics.schedule_ticks_late.labels(schedule=name).inc()
            log.info(
                "tick %s of %s enqueued",
                done.tick.isoformat(),
                name,
                extra={
                    "event": "tick_enqueued",
                    "jobId": done.job_id,
                    "schedule": name,
                    "tick": done.tick.isoformat(),
                    "delaySeconds": round(delay.total_seconds(), 3),
                },
            )
        skipped = result.skipped
        if skipped is not None:
            metrics.schedule_ticks_skipped.labels(schedule=name, reason=skipped.reason).inc(
                skipped.count
            )
            if skipped.reason == "catchup":
                log.warning(
                    "%d tick(s) of %s skipped (%s to %s): missed beyond the catch-up window %s",
                    skipped.count,
                    name,
                    skipped.first.isoformat(),
                    skipped.last.isoformat(),
                    self.catchup,
                    extra={"event": "ticks_skipped", "schedule": name, **skipped.detail()},
                )
