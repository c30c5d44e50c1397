"""``run_jobs`` and ``enqueued``: an application's jobs run in the test's own process, on a
database of the test's own, with the code that runs them in production.

Nothing here is a stand-in. The runner opens the same runtime a ``jobrelay worker`` opens, on
a fresh embedded database (SQLite + the local transport) or on the PostgreSQL + RabbitMQ a
test names, and runs the real relay and the real worker as tasks: every claim, fenced
outcome, retry, follow-up and ``after=`` release goes through the statements it goes through
in production. What a test gets besides is control of time (a ``FakeClock`` that the store,
the relay, the worker, the scheduler and the app's enqueues all read) and ``drain``, which
waits until everything enqueued so far has ended, moving the clock past the delays unless
told to honour them.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import dataclasses
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Mapping
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from sqlalchemy import and_, func, or_, select
from sqlalchemy.ext.asyncio import AsyncEngine

from jobrelay.domain.limits import RATE, Bucket, JobLimit
from jobrelay.domain.states import JobState
from jobrelay.errors import ConfigError, JobNotFound
from jobrelay.library.app import App
from jobrelay.library.job_definition import JobDefinition
from jobrelay.maintenance.scheduler import Scheduler
from jobrelay.relay.publisher import Relay
from jobrelay.runtime.wiring import Runtime, build_transport, open_runtime
from jobrelay.settings import Settings
from jobrelay.storage.engine import SCHEMA_HEAD, upgrade_async
from jobrelay.storage.records import EventRecord, JobRecord
from jobrelay.storage.tables import jobs as jobs_table
from jobrelay.storage.tables import limit_buckets
from jobrelay.testing.clock import FakeClock
from jobrelay.transport.base import Transport
from jobrelay.worker.consumer import Worker

# Quicker polls than production's: a test waits on them. Everything else is the default.
_TEST_SETTINGS: dict[str, Any] = {"relay_poll_seconds": 0.02, "queue_pause_poll_seconds": 0.2}
_LOOK_EVERY = 0.005  # seconds between a drain's looks at the database
_STOP_SECONDS = 15.0

# One migrated database per schema revision and process, copied for each runner: migrating
# takes far longer than a copy.
_templates: dict[str, Path] = {}


class DrainTimeout(AssertionError):
    """``drain`` gave up: jobs were still queued or running after its ``timeout``."""


async def _fresh_sqlite(directory: Path) -> str:
    template = _templates.get(SCHEMA_HEAD)
    if template is None or not template.exists():
        home = Path(tempfile.mkdtemp(prefix="jobrelay-template-"))
        atexit.register(shutil.rmtree, home, True)
        template = home / "jobrelay.db"
        await upgrade_async(f"sqlite:///{template}")
        _templates[SCHEMA_HEAD] = template
    path = directory / "jobrelay.db"
    shutil.copy(template, path)
    return f"sqlite:///{path}"


class Runner:
    """An app's jobs, run in this process (``run_jobs``) or only recorded (``enqueued``).

    ``engine`` is the test's database (enqueue on ``engine.begin()`` as the application does
    on its own); ``app.enqueue``, ``app.get_job``, ``app.wait`` and the operator's verbs reach
    it too while the runner is open. ``clock`` is the fake clock every part reads.
    """

    def __init__(self, app: App, rt: Runtime, clock: FakeClock, *, running: bool) -> None:
        self.app = app
        self.rt = rt
        self.clock = clock
        self._running = running
        self._stops: list[asyncio.Event] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._worker: Worker | None = None
        self._transport: Transport | None = None
        schedules = app.schedules
        self._scheduler = Scheduler(rt) if running and schedules else None

    @property
    def engine(self) -> AsyncEngine:
        return self.rt.engine

    @property
    def settings(self) -> Settings:
        return self.rt.settings

    # --- running ------------------------------------------------------------------------------

    async def _start(self) -> None:
        """The relay, and a worker on a transport connection of its own (as a process has);
        the schedules' cursors set at the clock's first time."""
        if self._scheduler is not None:
            await self._scheduler.run_once()
        self._transport = build_transport(self.settings, self.engine, self.clock, self.app)
        await self._transport.connect()
        self._worker = Worker(dataclasses.replace(self.rt, transport=self._transport))
        for role in (Relay(self.rt).run, self._worker.run):
            stop = asyncio.Event()
            self._stops.append(stop)
            self._tasks.append(asyncio.create_task(role(stop)))

    async def _stop(self) -> None:
        """Stop the relay and the worker (each finishes what it holds), whatever state the
        test left them in; a role that does not stop in time is cancelled."""
        for stop in self._stops:
            stop.set()
        try:
            if self._tasks:
                _, late = await asyncio.wait(self._tasks, timeout=_STOP_SECONDS)
                for task in late:
                    task.cancel()
                await asyncio.gather(*self._tasks, return_exceptions=True)
        finally:
            if self._transport is not None:
                await self._transport.close()

    def _check_roles(self) -> None:
        """A relay or worker that ended on its own failed: say why, not "drain timed out"."""
        for task in self._tasks:
            if task.done():
                if not task.cancelled() and task.exception() is not None:
                    raise task.exception()  # type: ignore[misc]
                raise RuntimeError("the runner's relay or worker stopped on its own")

    async def drain(self, *, skip_delays: bool = True, timeout: float = 30.0) -> None:
        """Run everything enqueued so far, and what it leads to (retries, follow-ups, jobs
        that run ``after=`` them), until no job is queued, running or due.

        ``skip_delays`` (default): when only waiting jobs are left (a retry's back-off, a
        ``delay=``, a ``run_at``), the clock is moved to the first one's time and the drain
        goes on, so a test never sleeps. ``skip_delays=False`` honours them: the drain
        returns with those jobs still waiting; ``advance`` the clock, then drain again.
        The app's schedules fire for the ticks the clock has passed. ``DrainTimeout`` after
        ``timeout`` seconds of real time with jobs still queued or running.
        """
        if not self._running or self._worker is None:
            raise ConfigError("drain", "this runner runs nothing (enqueued(app)): use run_jobs")
        deadline = time.monotonic() + timeout
        # Once, for the time the test gave: a jump the drain makes to skip a delay fires no
        # tick (a tick's job could add a delay to skip, and so on without end); the next
        # drain's pass catches up on them under the catch-up policy, as a scheduler would.
        if self._scheduler is not None:
            await self._scheduler.run_once()
        while True:
            self._check_roles()
            busy, next_due = await self._pending()
            if self._worker.idle and skip_delays:
                if not busy and next_due is not None:
                    self._move(next_due)
                elif busy and (refill := await self._rate_refill()) is not None:
                    self._move(refill)  # only jobs held by a rate are left: its next token
            if not busy and self._worker.idle and (next_due is None or not skip_delays):
                return
            if time.monotonic() > deadline:
                raise DrainTimeout(await self._stuck(timeout))
            await asyncio.sleep(_LOOK_EVERY)

    def _move(self, to: datetime) -> None:
        self.clock.move_to(to)
        self._wake()

    def _wake(self) -> None:
        """The relay and the local transport's consumers look again now: rows fell due."""
        self.rt.store.wake_relays()
        wake = getattr(self._transport, "wake_consumers", None)
        if wake is not None:
            wake()

    async def _pending(self) -> tuple[int, datetime | None]:
        """How many jobs are queued, running or due; and the time the first waiting one is."""
        jobs, now = jobs_table, self.clock()
        due = or_(
            and_(
                jobs.c.state.in_([JobState.QUEUED.value, JobState.RUNNING.value]),
                or_(jobs.c.run_at.is_(None), jobs.c.run_at <= now),
            ),
            and_(jobs.c.state == JobState.RETRY_WAIT.value, jobs.c.next_attempt_at <= now),
        )
        async with self.engine.connect() as conn:
            busy = int(await conn.scalar(select(func.count()).where(due)) or 0)
            delayed = await conn.scalar(
                select(func.min(jobs.c.run_at)).where(
                    jobs.c.state == JobState.QUEUED.value, jobs.c.run_at > now
                )
            )
            retry = await conn.scalar(
                select(func.min(jobs.c.next_attempt_at)).where(
                    jobs.c.state == JobState.RETRY_WAIT.value, jobs.c.next_attempt_at > now
                )
            )
        times = [t for t in (delayed, retry) if t is not None]
        return busy, min(times) if times else None

    async def _rate_refill(self) -> datetime | None:
        """When every job left is held back by a rate limit (the worker is idle): the time
        the first of their buckets has a whole token again, as the relay will compute it;
        None when some job is held by something else, or a token is there already."""
        jobs, now = jobs_table, self.clock()
        async with self.engine.connect() as conn:
            held = (
                await conn.execute(
                    select(jobs.c.limits, jobs.c.throttled_at, jobs.c.admitted_at).where(
                        jobs.c.state.in_([JobState.QUEUED.value, JobState.RETRY_WAIT.value]),
                        or_(jobs.c.run_at.is_(None), jobs.c.run_at <= now),
                        or_(jobs.c.next_attempt_at.is_(None), jobs.c.next_attempt_at <= now),
                    )
                )
            ).all()
            buckets = {r.limit_id: r for r in await conn.execute(select(limit_buckets))}
        waits: list[float] = []
        for row in held:
            if row.admitted_at is not None or row.throttled_at is None or not row.limits:
                return None  # on its way to a worker, or not held: nothing to wait for
            for limit in (JobLimit.from_json(one) for one in row.limits):
                if limit.kind != RATE or limit.per_second is None or limit.burst is None:
                    continue
                bucket = buckets.get(limit.limit_id)
                tokens = (
                    limit.burst
                    if bucket is None
                    else Bucket(float(bucket.tokens), bucket.at.timestamp()).refilled(
                        now.timestamp(), limit.per_second, limit.burst
                    )
                )
                if tokens < 1.0:
                    waits.append((1.0 - tokens) / limit.per_second)
        if not waits:
            return None
        return now + timedelta(seconds=min(waits) + 0.001)

    async def _stuck(self, timeout: float) -> str:
        left = [j for j in await self.jobs() if not j.state.is_terminal]
        shown = ", ".join(
            f"{j.type} {j.id} {j.state.value}"
            + (" (held by its limits: advance the clock for a rate)" if j.throttled_at else "")
            for j in left[:5]
        )
        return f"drain: after {timeout:g} s, {len(left)} job(s) had not ended: {shown}"

    def advance(self, by: float | timedelta) -> datetime:
        """Move the clock forward (seconds, or a ``timedelta``); returns the new time."""
        moved = self.clock.advance(by)
        self._wake()
        return moved

    # --- reading ------------------------------------------------------------------------------

    async def jobs(
        self,
        *,
        type: str | JobDefinition[Any] | None = None,
        state: JobState | str | None = None,
    ) -> list[JobRecord]:
        """The jobs in the test's database, oldest first; ``type`` (a name or a definition)
        and ``state`` narrow them."""
        query = select(jobs_table.c.id).order_by(jobs_table.c.created_at, jobs_table.c.id)
        if type is not None:
            name = type.type if isinstance(type, JobDefinition) else type
            query = query.where(jobs_table.c.type == name)
        if state is not None:
            try:
                wanted = JobState(state)
            except ValueError:
                names = ", ".join(s.value for s in JobState)
                raise ConfigError("jobs", f"state {state!r} is none of {names}") from None
            query = query.where(jobs_table.c.state == wanted.value)
        async with self.engine.connect() as conn:
            ids = list((await conn.scalars(query)).all())
        found = [await self.rt.store.get_job(job_id) for job_id in ids]
        return [job for job in found if job is not None]

    async def job(self, job_id: str) -> JobRecord:
        """The job ``job_id``; ``JobNotFound`` when there is none."""
        job = await self.rt.store.get_job(job_id)
        if job is None:
            raise JobNotFound(job_id)
        return job

    async def events(self, job_id: str) -> list[EventRecord]:
        """The job's timeline, as ``jobrelay job show`` prints it."""
        return list(await self.rt.store.events(job_id))


@contextlib.asynccontextmanager
async def run_jobs(
    app: App,
    *,
    database_url: str | None = None,
    broker_url: str = "local",
    start: datetime | None = None,
    settings: Mapping[str, Any] | None = None,
    _running: bool = True,
) -> AsyncIterator[Runner]:
    """``app``'s jobs, run in this process by the real relay and worker until the block ends.

    Default: a fresh embedded database (SQLite + the local transport) in a temporary
    directory, deleted after. ``database_url``/``broker_url``: PostgreSQL + RabbitMQ instead
    (the database is migrated; give each test a database and vhost of its own, as the
    runner's jobs are all the jobs it finds there). ``start``: the fake clock's first time.
    ``settings``: more ``Settings`` fields (``{"max_attempts": 5}``). Results are written
    under the temporary directory.
    """
    if not isinstance(app, App):
        raise ConfigError("run_jobs", f"run_jobs takes a jobrelay.App, not {app!r}")
    directory = Path(tempfile.mkdtemp(prefix="jobrelay-test-"))
    try:
        if database_url is None:
            url = await _fresh_sqlite(directory)
        else:
            url = database_url
            await upgrade_async(url)
        chosen = Settings(
            **{
                **_TEST_SETTINGS,
                "database_url": url,
                "broker_url": broker_url,
                "results_url": f"file://{directory / 'results'}",
                **(settings or {}),
            }
        )
        clock = FakeClock(start)
        async with open_runtime(chosen, clock=clock, app=app) as opened:
            # Every retry waits in the database: on RabbitMQ a delay queue would wait in real
            # time, and its message would come before the fake clock says the retry is due.
            rt = dataclasses.replace(opened, hold_retries=True)
            runner = Runner(app, rt, clock, running=_running)
            async with app.bind(chosen, rt.engine, clock):
                try:
                    if _running:
                        await runner._start()
                    yield runner
                finally:
                    if _running:
                        await runner._stop()
    finally:
        shutil.rmtree(directory, ignore_errors=True)


@contextlib.asynccontextmanager
async def enqueued(
    app: App,
    *,
    database_url: str | None = None,
    start: datetime | None = None,
    settings: Mapping[str, Any] | None = None,
) -> AsyncIterator[Runner]:
    """What application code enqueues, recorded and never run: a runner with no relay and no
    worker (``runner.jobs()`` reads what was written; ``drain`` is refused)."""
    async with run_jobs(
        app, database_url=database_url, start=start, settings=settings, _running=False
    ) as runner:
        yield runner


__all__ = ["DrainTimeout", "Runner", "enqueued", "run_jobs"]
