"""The SQL of periodic jobs: a scheduler's pass over one schedule, the operators' pause and
resume, and the views behind ``schedules list`` and ``GET /v1/schedules``.

A pass is ONE transaction: it takes the schedule's row (``FOR UPDATE SKIP LOCKED`` on
PostgreSQL: a scheduler that finds another one mid-pass leaves the schedule to it; SQLite
serialises writers anyway), reads the store's clock, enqueues each due tick's job with the
same statements as ``enqueue`` (``new_job_steps``), records skipped ticks, and moves the
cursor. The tick's job id comes from its key (schedule name + tick instant), so a tick that
two schedulers both enqueue is still one job (the second insert writes nothing); the row
lock only keeps the skipped-tick records from being written twice.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import func, insert, select, update
from sqlalchemy.ext.asyncio import AsyncConnection

from jobrelay.domain.schedules import Cron, Plan, Skipped, skipped_between
from jobrelay.errors import IdempotencyConflict
from jobrelay.storage.drivers.new_job import steps_on
from jobrelay.storage.port import StorePort
from jobrelay.storage.records import NewJob, aware_time, jsonable
from jobrelay.storage.steps import run_async
from jobrelay.storage.tables import jobs, schedule_events, schedules

log = logging.getLogger("jobrelay.scheduler")


@dataclass(frozen=True)
class Definition:
    """What a scheduler knows of one schedule: from the app, not the database."""

    name: str
    job_type: str
    cron: Cron
    tick_job: Callable[[datetime], NewJob]


@dataclass(frozen=True)
class Enqueued:
    tick: datetime
    job_id: str
    created: bool  # False: another scheduler (or an earlier pass) had written it


@dataclass(frozen=True)
class PassResult:
    now: datetime
    enqueued: tuple[Enqueued, ...] = ()
    skipped: Skipped | None = None
    more: bool = False
    busy: bool = False  # another scheduler held the schedule: nothing done here
    paused: bool = False


@dataclass(frozen=True)
class ScheduleView:
    name: str
    job_type: str
    cron: str
    timezone: str
    cursor_at: datetime
    last_tick_at: datetime | None
    last_job_id: str | None
    last_job_state: str | None  # None: no tick yet, or the job was pruned
    paused: bool
    paused_at: datetime | None
    paused_by: str | None
    paused_reason: str | None
    skipped_while_paused: dict[str, Any] | None
    last_skipped: dict[str, Any] | None  # the latest ticks_skipped event's detail and time
    updated_at: datetime


@dataclass(frozen=True)
class PauseOutcome:
    name: str
    found: bool
    done: bool  # False: it already was in the state asked for
    skipped: Skipped | None = None


Planner = Callable[[Cron, datetime, datetime, bool], Plan]


class ScheduleQueries:
    def __init__(self, store: StorePort) -> None:
        self.store = store

    async def _now(self, conn: AsyncConnection) -> datetime:
        value = await conn.scalar(select(self.store.now_sql()))
        now = aware_time(value)
        assert now is not None
        return now

    async def advance(self, schedule: Definition, planner: Planner, scheduler: str) -> PassResult:
        """One pass over ``schedule``: enqueue its due ticks, record what it skips."""
        store = self.store
        async with store.writing() as conn:
            now = await self._now(conn)
            locked = select(schedules).where(schedules.c.name == schedule.name)
            row = (await conn.execute(locked.with_for_update(skip_locked=True))).first()
            if row is None:
                registered = await conn.execute(
                    store.upsert(schedules)
                    .values(
                        name=schedule.name,
                        job_type=schedule.job_type,
                        cron=schedule.cron.expr,
                        timezone=schedule.cron.timezone,
                        cursor_at=now,
                        created_at=now,
                        updated_at=now,
                    )
                    .on_conflict_do_nothing(index_elements=[schedules.c.name])
                    .returning(schedules.c.name)
                )
                # First sight of this schedule: its ticks start now. Otherwise another
                # scheduler holds it (or registered it a moment ago).
                return PassResult(now, busy=registered.first() is None)
            cursor = aware_time(row.cursor_at)
            assert cursor is not None
            plan = planner(schedule.cron, cursor, now, bool(row.paused))
            done: list[Enqueued] = []
            for tick in plan.enqueue:
                done.append(await self._enqueue(conn, schedule, tick, now, scheduler))
            created = [e for e in done if e.created]
            if plan.skipped is not None:
                await self._record_skipped(conn, schedule.name, plan.skipped, row, created, now)
            values: dict[str, Any] = {
                "cursor_at": max(plan.cursor, cursor),
                "job_type": schedule.job_type,
                "cron": schedule.cron.expr,
                "timezone": schedule.cron.timezone,
                "updated_at": now,
            }
            if done:
                values.update(last_tick_at=done[-1].tick, last_job_id=done[-1].job_id)
            await conn.execute(
                update(schedules).where(schedules.c.name == schedule.name).values(**values)
            )
        if created:
            store.wake_relays()
        return PassResult(now, tuple(done), plan.skipped, plan.more, paused=bool(row.paused))

    async def _enqueue(
        self,
        conn: AsyncConnection,
        schedule: Definition,
        tick: datetime,
        now: datetime,
        scheduler: str,
    ) -> Enqueued:
        job = schedule.tick_job(tick)
        try:
            job_id, created = await run_async(conn, steps_on(conn, job, now))
        except IdempotencyConflict:
            # The tick's job exists with other parameters (written by a scheduler running
            # another version of the app): it is this tick's one job all the same.
            log.warning(
                "tick %s of %s exists with other parameters",
                tick.isoformat(),
                schedule.name,
                extra={"event": "tick_conflict", "jobId": job.job_id, "schedule": schedule.name},
            )
            return Enqueued(tick, job.job_id, False)
        if created:
            await self.store.add_event(
                conn,
                job_id,
                "scheduled",
                now,
                schedule=schedule.name,
                tick=tick.isoformat(),
                delaySeconds=round((now - tick).total_seconds(), 3),
                scheduler=scheduler,
            )
        return Enqueued(tick, job_id, created)

    async def _record_skipped(
        self,
        conn: AsyncConnection,
        name: str,
        skipped: Skipped,
        row: Any,
        created: list[Enqueued],
        now: datetime,
    ) -> None:
        if skipped.reason == "paused":
            # One running record per pause (a one-second schedule paused for an hour is one
            # record, not 3,600 events); resume writes it out as an event.
            earlier = row.paused_skipped
            merged = _skipped_from(earlier).merge(skipped) if earlier else skipped
            await conn.execute(
                update(schedules)
                .where(schedules.c.name == name)
                .values(paused_skipped=merged.detail())
            )
            return
        detail = {**skipped.detail(), "jobId": created[0].job_id if created else None}
        await conn.execute(
            insert(schedule_events).values(
                schedule=name, at=now, kind="ticks_skipped", detail=jsonable(detail)
            )
        )
        if created:
            await self.store.add_event(
                conn, created[0].job_id, "ticks_skipped", now, schedule=name, **skipped.detail()
            )

    # --- operators ------------------------------------------------------------------------

    async def set_paused(self, name: str, paused: bool, *, actor: str, reason: str) -> PauseOutcome:
        """Pause or resume ``name``; resuming records the ticks the pause skipped."""
        async with self.store.writing() as conn:
            now = await self._now(conn)
            row = (
                await conn.execute(
                    select(schedules).where(schedules.c.name == name).with_for_update()
                )
            ).first()
            if row is None:
                return PauseOutcome(name, False, False)
            if bool(row.paused) == paused:
                return PauseOutcome(name, True, False)
            detail: dict[str, Any] = {"actor": actor, "reason": reason}
            skipped: Skipped | None = None
            values: dict[str, Any] = {"paused": paused, "updated_at": now}
            if paused:
                values.update(
                    paused_at=now, paused_by=actor, paused_reason=reason, paused_skipped=None
                )
            else:
                skipped = self._pause_skips(row, now)
                cursor = aware_time(row.cursor_at)
                assert cursor is not None
                values.update(
                    cursor_at=max(cursor, now),
                    paused_at=None,
                    paused_by=None,
                    paused_reason=None,
                    paused_skipped=None,
                )
                detail.update(pausedAt=_iso(row.paused_at), pausedBy=row.paused_by)
                detail["skipped"] = skipped.detail() if skipped else None
            await conn.execute(update(schedules).where(schedules.c.name == name).values(**values))
            if skipped is not None:
                await self._event(conn, name, "ticks_skipped", now, skipped.detail())
            await self._event(conn, name, "paused" if paused else "resumed", now, detail)
        return PauseOutcome(name, True, True, skipped)

    def _pause_skips(self, row: Any, now: datetime) -> Skipped | None:
        """The ticks skipped while paused: the schedulers' record, plus the ticks that came
        due since the last pass (the resume moves the cursor past them)."""
        earlier = _skipped_from(row.paused_skipped) if row.paused_skipped else None
        cursor = aware_time(row.cursor_at)
        assert cursor is not None
        # The ticks after the cursor up to and including now.
        recent = skipped_between(Cron(row.cron, row.timezone), cursor, now + _TINY, "paused")
        if earlier is None:
            return recent
        return earlier.merge(recent) if recent else earlier

    async def _event(
        self, conn: AsyncConnection, name: str, kind: str, now: datetime, detail: dict[str, Any]
    ) -> None:
        await conn.execute(
            insert(schedule_events).values(
                schedule=name, at=now, kind=kind, detail=jsonable(detail)
            )
        )

    # --- views ----------------------------------------------------------------------------

    async def views(self) -> list[ScheduleView]:
        latest_skip = (
            select(func.max(schedule_events.c.id).label("id"), schedule_events.c.schedule)
            .where(schedule_events.c.kind == "ticks_skipped")
            .group_by(schedule_events.c.schedule)
            .subquery()
        )
        query = (
            select(
                schedules,
                jobs.c.state.label("last_job_state"),
                schedule_events.c.detail.label("skip_detail"),
                schedule_events.c.at.label("skip_at"),
            )
            .select_from(
                schedules.outerjoin(jobs, jobs.c.id == schedules.c.last_job_id)
                .outerjoin(latest_skip, latest_skip.c.schedule == schedules.c.name)
                .outerjoin(schedule_events, schedule_events.c.id == latest_skip.c.id)
            )
            .order_by(schedules.c.name)
        )
        async with self.store.reading() as conn:
            rows = (await conn.execute(query)).all()
        return [_view(r) for r in rows]

    async def events(self, name: str, limit: int = 50) -> list[dict[str, Any]]:
        """The schedule's timeline, newest first."""
        query = (
            select(schedule_events.c.at, schedule_events.c.kind, schedule_events.c.detail)
            .where(schedule_events.c.schedule == name)
            .order_by(schedule_events.c.id.desc())
            .limit(limit)
        )
        async with self.store.reading() as conn:
            rows = (await conn.execute(query)).all()
        return [{"at": aware_time(r.at), "kind": r.kind, "detail": dict(r.detail)} for r in rows]


_TINY = timedelta(microseconds=1)


def _skipped_from(detail: dict[str, Any]) -> Skipped:
    return Skipped(
        reason=detail["reason"],
        count=int(detail["count"]),
        first=datetime.fromisoformat(detail["first"]),
        last=datetime.fromisoformat(detail["last"]),
        listed=tuple(datetime.fromisoformat(t) for t in detail.get("ticks", ())),
        count_complete=bool(detail.get("countComplete", True)),
    )


def _iso(value: Any) -> str | None:
    at = aware_time(value)
    return at.isoformat() if at else None


def _view(r: Any) -> ScheduleView:
    cursor = aware_time(r.cursor_at)
    updated = aware_time(r.updated_at)
    assert cursor is not None and updated is not None
    last_skipped = None
    if r.skip_detail is not None:
        last_skipped = {**dict(r.skip_detail), "at": _iso(r.skip_at)}
    return ScheduleView(
        name=r.name,
        job_type=r.job_type,
        cron=r.cron,
        timezone=r.timezone,
        cursor_at=cursor,
        last_tick_at=aware_time(r.last_tick_at),
        last_job_id=r.last_job_id,
        last_job_state=r.last_job_state,
        paused=bool(r.paused),
        paused_at=aware_time(r.paused_at),
        paused_by=r.paused_by,
        paused_reason=r.paused_reason,
        skipped_while_paused=dict(r.paused_skipped) if r.paused_skipped else None,
        last_skipped=last_skipped,
        updated_at=updated,
    )
