"""Schedules for operators — list, timeline, pause, resume — shared by the CLI, the admin HTTP
API and the console.

Pause and resume are audited like replay and cancel: each writes a ``paused`` / ``resumed``
event on the schedule's timeline with ``actor`` and ``reason``, and logs it. A paused schedule
keeps its ticks coming due; the schedulers skip them and count them, and the resume writes
them out as a ``ticks_skipped`` event (reason ``paused``). Resuming never catches up the
paused ticks: the next tick after the resume is the first one enqueued. A pause first brings
the schedule up to date (one scheduler pass), so ticks that came due before it are not the
pause's to skip.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from jobrelay.domain.schedules import Cron
from jobrelay.runtime.wiring import Runtime
from jobrelay.storage.schedules import PauseOutcome, ScheduleQueries, ScheduleView

log = logging.getLogger("jobrelay.operator")


@dataclass(frozen=True)
class ScheduleRow:
    """A schedule as ``schedules list`` shows it: the stored view and its next tick."""

    view: ScheduleView
    next_tick: datetime | None  # None while paused
    defined: bool  # False: the app this process loaded has no such schedule (any more)

    def as_dict(self) -> dict[str, Any]:
        v = self.view
        return {
            "name": v.name,
            "jobType": v.job_type,
            "cron": v.cron,
            "timezone": v.timezone,
            "paused": v.paused,
            "pausedAt": _iso(v.paused_at),
            "pausedBy": v.paused_by,
            "pausedReason": v.paused_reason,
            "skippedWhilePaused": v.skipped_while_paused,
            "nextTick": _iso(self.next_tick),
            "lastTick": _iso(v.last_tick_at),
            "lastJobId": v.last_job_id,
            "lastJobState": v.last_job_state,
            "lastSkipped": v.last_skipped,
            "handledUntil": _iso(v.cursor_at),
            "definedByApp": self.defined,
        }


def _iso(value: datetime | None) -> str | None:
    return value.isoformat() if value is not None else None


def pause_refusal(name: str, outcome: PauseOutcome, paused: bool) -> str:
    if not outcome.found:
        return f"no schedule {name!r} (a schedule appears once a relay or `up` has run it)"
    return f"schedule {name!r} is already {'paused' if paused else 'running'}"


class ScheduleOperator:
    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
        self.queries = ScheduleQueries(rt.store)

    async def rows(self) -> list[ScheduleRow]:
        now = await self.rt.store.db_now()
        defined = set(self.rt.job_app().schedules)
        out = []
        for view in await self.queries.views():
            upcoming = None
            if not view.paused:
                upcoming = Cron(view.cron, view.timezone).next_after(max(now, view.cursor_at))
            out.append(ScheduleRow(view, upcoming, view.name in defined))
        return out

    async def events(self, name: str, limit: int = 50) -> list[dict[str, Any]]:
        return await self.queries.events(name, limit)

    async def set_paused(self, name: str, paused: bool, *, actor: str, reason: str) -> PauseOutcome:
        if paused:
            await self._bring_up_to_date(name)
        outcome = await self.queries.set_paused(name, paused, actor=actor, reason=reason)
        action = "pause" if paused else "resume"
        if outcome.done:
            self.rt.metrics.operator_actions.labels(action=f"schedule_{action}").inc()
            skipped = outcome.skipped.count if outcome.skipped else 0
            log.info(
                "schedule %s %s by %s",
                name,
                "paused" if paused else f"resumed ({skipped} tick(s) skipped while paused)",
                actor,
                extra={
                    "event": f"schedule_{'paused' if paused else 'resumed'}",
                    "schedule": name,
                    "actor": actor,
                    "reason": reason,
                },
            )
        else:
            log.info(
                "%s refused: %s",
                action,
                pause_refusal(name, outcome, paused),
                extra={"event": f"schedule_{action}_refused", "schedule": name, "actor": actor},
            )
        return outcome

    async def _bring_up_to_date(self, name: str) -> None:
        """Before a pause, one scheduler pass over the schedule (when this process's app
        defines it): ticks that came due before the pause but that no scheduler handled yet
        (none was running) are enqueued or skipped as ``catchup`` says, not counted as
        skipped by the pause."""
        from jobrelay.maintenance.scheduler import Scheduler

        schedule = self.rt.job_app().schedules.get(name)
        if schedule is not None:
            await Scheduler(self.rt).advance(schedule)
