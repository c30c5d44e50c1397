"""The library surface: ``App``, ``@app.job``, and enqueueing inside the caller's transaction.

A job type is an async function of a ``JobContext`` and a pydantic model of its parameters
(or a plain ``def`` of a ``SyncJobContext``, run in a bounded thread pool: ``sync_context``)::

    app = jobrelay.App()

    @app.job("images.resize", params=Resize, max_attempts=5, retry_delays=(5, 30), queue="images")
    async def resize(ctx: jobrelay.JobContext[Resize], params: Resize) -> jobrelay.Result | None:
        ...

    async with engine.begin() as conn:            # the application's own transaction
        await conn.execute(insert(images).values(...))
        job_id = await resize.enqueue(conn, Resize(image_id=1, width=100), key="img-1-100")

``enqueue`` writes the job row, its outbox row and its ``accepted`` event on the caller's
connection and nothing else: it never commits, never opens a connection, and a rollback
leaves no trace. A job enqueued with ``key`` gets an id keyed with the installation's secret
(``storage/installation.py``), read on the caller's connection at most once a minute.
Parameters are validated at enqueue (``InvalidParams``, nothing written) and again when the
job runs (a stored payload that no longer validates quarantines the job
with the validation message). Each definition is also the worker's ``Operation`` for its
type, so the worker runs application jobs and the shipped ones the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import weakref
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, MutableMapping, Sequence
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel
from sqlalchemy import Engine, MetaData
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncEngine

from jobrelay.domain.backoff import Backoff
from jobrelay.domain.delays import Delay
from jobrelay.domain.queues import DEFAULT_QUEUE, QUEUE_NAME
from jobrelay.domain.states import JobState
from jobrelay.errors import ConfigError, JobFailed
from jobrelay.library.app_verbs import OperatorVerbs, run_sync
from jobrelay.library.definition_checks import check_params_model, unknown_type
from jobrelay.library.hooks import HookRegistry
from jobrelay.library.job_definition import JobDefinition as JobDefinition
from jobrelay.library.job_definition import JobFunction, P
from jobrelay.library.limits import ConcurrencyLimit, RateLimit, check_limits, check_priority
from jobrelay.library.operations import Operation, Registry
from jobrelay.library.sync_context import SyncJobFunction
from jobrelay.library.waiting import Watcher
from jobrelay.observe.scrub import scrub_text
from jobrelay.settings import Settings
from jobrelay.storage.installation import IdKeyCache
from jobrelay.storage.records import JobRecord

if TYPE_CHECKING:
    from fastapi import APIRouter

    from jobrelay.library.periodic import Schedule

AppCommand = Callable[..., int]
_NAME_MAX = 64  # jobs.type


class App(OperatorVerbs, HookRegistry):
    """A set of job types, and the settings they run with (``JOBRELAY_*`` by default); the
    operator's verbs on its jobs (``library.app_verbs``); hooks on their outcomes
    (``library.hooks``)."""

    def __init__(self, settings: Settings | None = None) -> None:
        self._settings = settings
        self._jobs: dict[str, JobDefinition[Any]] = {}
        # Kept as types are declared: every enqueue asks, and the API's accept is hot.
        self._prioritized: frozenset[str] = frozenset()
        self._builtins: list[Callable[[Settings], Operation]] = []
        self._included_types: set[str] = set()
        self._routers: list[APIRouter | Callable[[], APIRouter]] = []
        self._tables: list[MetaData] = []
        self._commands: dict[str, AppCommand] = {}
        self._schedules: dict[str, Schedule] = {}
        self._engine: AsyncEngine | None = None
        # A test's fake clock (``bind``): the time its enqueues are stamped and delayed by.
        self._clock: Callable[[], datetime] | None = None
        self._bound: AsyncEngine | None = None  # the engine ``bind`` holds the app to
        # ``wait``'s watcher per event loop (``library.waiting``).
        self._watchers: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Watcher] = (
            weakref.WeakKeyDictionary()
        )
        # The installation's id keys per database this app enqueues on (its engine).
        self._id_keys: weakref.WeakKeyDictionary[Engine, IdKeyCache] = weakref.WeakKeyDictionary()
        self._id_keys_by_name: dict[str, IdKeyCache] = {}

    @property
    def settings(self) -> Settings:
        if self._settings is None:
            self._settings = Settings()
        return self._settings

    @property
    def jobs(self) -> Mapping[str, JobDefinition[Any]]:
        return dict(self._jobs)

    @property
    def prioritized_queues(self) -> frozenset[str]:
        """The queues a type on which declared ``priority=``: all their jobs are admitted to
        the broker highest priority first."""
        return self._prioritized

    def job(
        self,
        name: str,
        *,
        params: type[P],
        max_attempts: int | None = None,
        retry_delays: tuple[int, ...] | None = None,
        retry: Backoff | None = None,
        queue: str = DEFAULT_QUEUE,
        http: bool = False,
        result_filename: Callable[[str, Mapping[str, Any]], str] | None = None,
        schedule: str | None = None,
        schedule_params: Mapping[str, Any] | None = None,
        schedule_timezone: str = "UTC",
        timeout: float | None = None,
        limits: Sequence[ConcurrencyLimit | RateLimit] = (),
        fair_by: Callable[[Any], str | None] | None = None,
        priority: int | None = None,
    ) -> Callable[[JobFunction[P] | SyncJobFunction[P]], JobDefinition[P]]:
        """Define job type ``name``; the decorated function runs it.

        ``result_filename(job_id, params)``: the result object of a succeeded job is
        downloadable at ``GET /v1/jobs/{jobId}/result`` (``text/csv``) under this file name
        (without the extension). Without it that route answers 404 for jobs of this type.

        ``retry``: a ``jobrelay.Backoff`` (exponential, capped, with jitter) instead of the
        fixed ``retry_delays``; its retries wait in the database until due (library.md).

        ``timeout``: seconds an attempt may run (else ``JOBRELAY_JOB_TIMEOUT``, else no
        limit); past it the attempt is stopped and counts as failed (``library.md``).

        ``limits``: limits per key (``ConcurrencyLimit``, ``RateLimit``): a job is handed to
        the broker only once each has room (docs/how-to/limits.md). ``fair_by(params)``: a
        key whose jobs take turns with other keys' to reach the broker, even with no limit.

        ``priority`` (0..9, higher first): its jobs' default priority inside its queue; the
        queue becomes a prioritized one, whose jobs (of every type on it) the relay hands to
        the broker highest priority first (``enqueue(priority=)`` per job; library.md).

        ``schedule``: a cron expression; the job also runs periodically with
        ``schedule_params``, as the schedule named ``name`` (``App.schedule`` for more).
        """
        if not name or len(name) > _NAME_MAX or name in self._jobs or name in self._included_types:
            raise ConfigError("@app.job", f"job name {name!r} is empty, too long or taken")
        if not QUEUE_NAME.match(queue):
            raise ConfigError("@app.job", f"queue {queue!r} must match {QUEUE_NAME.pattern}")
        if max_attempts is not None and not 1 <= max_attempts <= 100:
            raise ConfigError("@app.job", f"max_attempts must be 1..100, got {max_attempts}")
        if retry_delays is not None and (not retry_delays or min(retry_delays) < 1):
            raise ConfigError("@app.job", f"retry_delays must be positive seconds: {retry_delays}")
        if retry is not None and not isinstance(retry, Backoff):
            raise ConfigError("@app.job", f"retry must be a jobrelay.Backoff, got {retry!r}")
        if retry is not None and retry_delays is not None:
            raise ConfigError("@app.job", "give retry= (a Backoff) or retry_delays=, not both")

        if timeout is not None and (isinstance(timeout, bool) or not timeout > 0):
            raise ConfigError("@app.job", f"timeout must be positive seconds, got {timeout!r}")
        check_params_model(name, params)
        checked_limits = check_limits(name, limits)
        if priority is not None:
            check_priority("@app.job", priority)

        def define(fn: JobFunction[P] | SyncJobFunction[P]) -> JobDefinition[P]:
            definition = JobDefinition(
                self,
                name,
                fn,
                params,
                max_attempts=max_attempts,
                retry_delays=tuple(retry_delays) if retry_delays else None,
                queue=queue,
                http=http,
                result_filename=result_filename,
                timeout=timeout,
                limits=checked_limits,
                fair_by=fair_by,
                backoff=retry,
                priority=priority,
            )
            if schedule is not None:
                self.schedule(
                    definition, cron=schedule, params=schedule_params, timezone=schedule_timezone
                )
            self._jobs[name] = definition
            if priority is not None:
                self._prioritized |= {definition.queue}
            return definition

        return define

    def schedule(
        self,
        job: JobDefinition[Any],
        *,
        cron: str,
        params: BaseModel | Mapping[str, Any] | None = None,
        timezone: str = "UTC",
        name: str | None = None,
    ) -> Schedule:
        """Enqueue ``job`` with ``params`` at every tick of ``cron`` in ``timezone``.

        Every relay (and ``up``) runs a scheduler; each tick is one job, keyed by ``name``
        (default: the job's type) and the tick's time, however many schedulers run. A
        parameters model with a ``scheduled_at`` field gets the tick's time in it.
        """
        from jobrelay.library.periodic import define_schedule

        given = params.model_dump(mode="json") if isinstance(params, BaseModel) else params
        defined = define_schedule(
            job, cron=cron, params=given, timezone=timezone, name=name, where="App.schedule"
        )
        if defined.name in self._schedules:
            raise ConfigError("App.schedule", f"schedule name {defined.name!r} is taken")
        self._schedules[defined.name] = defined
        return defined

    @property
    def schedules(self) -> Mapping[str, Schedule]:
        return dict(self._schedules)

    def include(self, factory: Callable[[Settings], Operation], *, type: str | None = None) -> None:
        """Add a job type written against the lower-level ``Operation`` port
        (``factory(settings)`` builds it). Named with ``type``, a job of this app may create
        one with ``ctx.follow_up(type, params)``."""
        if type is not None:
            if not type or type in self._jobs or type in self._included_types:
                raise ConfigError("App.include", f"job name {type!r} is empty or taken")
            self._included_types.add(type)
        self._builtins.append(factory)

    @property
    def included_types(self) -> frozenset[str]:
        return frozenset(self._included_types)

    # --- what the application brings besides jobs ---------------------------------------------

    def http_router(self, router: APIRouter | Callable[[], APIRouter]) -> None:
        """Serve ``router``'s routes from the API (``jobrelay api``/``up``), before the core's.

        Its handlers use ``jobrelay.http`` (the caller, accepting jobs, problem responses).
        A function returning the router is called only when the API is built, so that a
        worker importing the app does not import FastAPI and the routes' modules.
        """
        self._routers.append(router)

    @property
    def routers(self) -> tuple[APIRouter, ...]:
        from fastapi import APIRouter

        return tuple(r if isinstance(r, APIRouter) else r() for r in self._routers)

    def command(self, name: str) -> Callable[[AppCommand], AppCommand]:
        """Provide the body of CLI command ``name`` (``jobrelay seed``, ``jobrelay demo``):
        ``fn(settings, **options) -> exit status``. The CLI declares the command and its
        options; for an app without it, the command says so and exits 2."""

        def define(fn: AppCommand) -> AppCommand:
            if name in self._commands:
                raise ConfigError("@app.command", f"command {name!r} is taken")
            self._commands[name] = fn
            return fn

        return define

    @property
    def commands(self) -> Mapping[str, AppCommand]:
        return dict(self._commands)

    def tables(self, metadata: MetaData) -> None:
        """The application's own tables, in jobrelay's database. jobrelay's migrations never
        touch them; ``create_tables`` creates the missing ones."""
        self._tables.append(metadata)

    @property
    def table_metadata(self) -> tuple[MetaData, ...]:
        """Every ``MetaData`` given to ``tables`` (what ``jobrelay db grant`` grants on)."""
        return tuple(self._tables)

    async def create_tables(self, engine: AsyncEngine) -> None:
        """Create the application's missing tables (``checkfirst``); safe to run again and
        from several processes at once. Run by every jobrelay process that opens its runtime
        for this app (``api``, ``worker``, ``up``, ``demo``) and by ``jobrelay db upgrade``."""
        for metadata in self._tables:
            try:
                async with engine.begin() as conn:
                    await conn.run_sync(metadata.create_all, checkfirst=True)
            except DBAPIError:
                # Another process created them between our check and our CREATE: fine, as
                # long as they exist now.
                async with engine.begin() as conn:
                    await conn.run_sync(metadata.create_all, checkfirst=True)

    def registry(self, settings: Settings | None = None) -> Registry:
        settings = settings or self.settings
        return Registry([*(f(settings) for f in self._builtins), *self._jobs.values()])

    @property
    def queues(self) -> tuple[str, ...]:
        """``default`` and every queue a job type of this app is routed to."""
        named = {definition.queue for definition in self._jobs.values()} - {DEFAULT_QUEUE}
        return (DEFAULT_QUEUE, *sorted(named))

    def retry_tiers(self, settings: Settings | None = None) -> tuple[int, ...]:
        """Every delay a job of this app may be retried after (the broker needs a queue each)."""
        delays = set((settings or self.settings).retry_delays)
        for definition in self._jobs.values():
            delays.update(definition.retry_delays or ())
        return tuple(sorted(delays))

    def id_key_cache(self, engine: Engine | str) -> IdKeyCache:
        """This process's copy of the id keys of the database behind ``engine`` (or named so,
        for a framework's DB-API connection: ``storage.drivers.dbapi.connection_identity``), from
        ``JOBRELAY_ID_SECRET`` of this app's settings, else the installation's row."""
        keyed: MutableMapping[Any, IdKeyCache] = (
            self._id_keys_by_name if isinstance(engine, str) else self._id_keys
        )
        cache = keyed.get(engine)
        if cache is None:
            cache = keyed[engine] = IdKeyCache(self.settings.id_secret_key)
        return cache

    # --- without a transaction of the caller's ------------------------------------------------

    def _engine_for_calls(self) -> AsyncEngine:
        if self._engine is None:
            from jobrelay.database_files import require_database
            from jobrelay.storage.engine import create_engine

            # Before SQLite would open the path: a missing ./var is "unable to open database
            # file", and a missing file would be created empty; either way the one line to
            # read is the CLI's "run `jobrelay db upgrade`".
            require_database(self.settings.database_url)
            self._engine = create_engine(self.settings.database_url)
        return self._engine

    async def enqueue(
        self,
        name: str,
        params: BaseModel | Mapping[str, Any],
        *,
        key: str | None = None,
        account: str | None = None,
        job_id: str | None = None,
        delay: Delay | None = None,
        run_at: datetime | None = None,
        after: Iterable[str] = (),
        after_failure: str = "cancel",
        priority: int | None = None,
    ) -> str:
        """Enqueue in a transaction of its own (for callers with no transaction to join);
        ``delay``, ``run_at``, ``after``, ``after_failure`` and ``priority`` as for
        ``JobDefinition.enqueue``."""
        definition = self._jobs.get(name)
        if definition is None:
            raise ConfigError("App.enqueue", unknown_type(name, self._jobs))
        async with self._engine_for_calls().begin() as conn:
            return await definition.enqueue(
                conn,
                params,
                key=key,
                account=account,
                job_id=job_id,
                delay=delay,
                run_at=run_at,
                after=after,
                after_failure=after_failure,
                priority=priority,
            )

    async def get_job(self, job_id: str) -> JobRecord | None:
        from jobrelay.storage.store import Store

        return await Store(self._engine_for_calls(), clock=self._clock).get_job(job_id)

    async def wait(self, job_id: str, timeout: float | None = None) -> JobRecord:
        """The job once it has ended (``succeeded``, ``quarantined`` or ``cancelled``), woken by
        the commit that ends it (``library.waiting``): ``TimeoutError`` after ``timeout``
        seconds (None: no limit), ``JobNotFound`` when there is no such job."""
        loop = asyncio.get_running_loop()
        watcher = self._watchers.get(loop)
        if watcher is None:
            watcher = self._watchers[loop] = Watcher(self._engine_for_calls())
        return await watcher.wait(job_id, timeout)

    async def result(self, job_id: str, timeout: float | None = None) -> Any:
        """The value the job returned (``Job.result``) once it has succeeded; ``JobFailed``
        (its state and reason) when it ended quarantined or cancelled; as ``wait`` else."""
        return _value_of(await self.wait(job_id, timeout))

    def wait_sync(self, job_id: str, timeout: float | None = None) -> JobRecord:
        """``wait`` for code with no event loop (a Django view, a script)."""
        return run_sync("App.wait_sync", self._wait_alone(job_id, timeout))

    def result_sync(self, job_id: str, timeout: float | None = None) -> Any:
        """``result`` for code with no event loop."""
        return _value_of(run_sync("App.result_sync", self._wait_alone(job_id, timeout)))

    async def _wait_alone(self, job_id: str, timeout: float | None) -> JobRecord:
        """A wait on a loop of its own, with an engine of its own (the app's is bound to
        the loop that made it)."""
        from jobrelay.database_files import require_database
        from jobrelay.storage.engine import create_engine

        require_database(self.settings.database_url)
        engine = create_engine(self.settings.database_url)
        watcher = Watcher(engine)
        try:
            return await watcher.wait(job_id, timeout)
        finally:
            await watcher.close()
            await engine.dispose()

    def now(self) -> datetime:
        """The time this app's enqueues are stamped with: the wall clock, or the fake clock
        of a test that bound the app (``bind``)."""
        return datetime.now(UTC) if self._clock is None else self._clock()

    @property
    def clock_is_fake(self) -> bool:
        """Bound to a test's fake clock: a ``delay=`` counts on it, not on the database's."""
        return self._clock is not None

    @contextlib.asynccontextmanager
    async def bind(
        self, settings: Settings, engine: AsyncEngine, clock: Callable[[], datetime] | None = None
    ) -> AsyncIterator[None]:
        """Within the block, this app's own calls (``enqueue``, ``get_job``, ``wait``, the
        operator's verbs) use ``settings`` and ``engine``, and its enqueues ``clock``: how
        ``jobrelay.testing`` points application code at a test's database. Restored after,
        ``wait``'s watcher on that engine closed."""
        if self._bound is not None:
            raise ConfigError("App.bind", "this App is bound already: one runner at a time")
        saved = (self._settings, self._engine, self._clock)
        self._settings, self._engine, self._clock = settings, engine, clock
        self._bound = engine
        try:
            yield
        finally:
            # An engine made while bound (after an ``aclose``) is this block's to dispose.
            made = self._engine if self._engine is not engine else None
            self._settings, self._engine, self._clock = saved
            self._bound = None
            watcher = self._watchers.pop(asyncio.get_running_loop(), None)
            try:
                if watcher is not None:
                    await watcher.close()
            finally:
                if made is not None:
                    await made.dispose()

    async def aclose(self) -> None:
        watcher = self._watchers.pop(asyncio.get_running_loop(), None)
        if watcher is not None:
            await watcher.close()
        if self._engine is not None and self._engine is not self._bound:
            # (A bound engine is the runner's: it outlives the application's ``aclose``.)
            with contextlib.suppress(Exception):
                await self._engine.dispose()
            self._engine = None


def _value_of(job: JobRecord) -> Any:
    if job.state is JobState.SUCCEEDED:
        return job.result
    reason = job.quarantine_reason or job.cancel_reason or job.last_error
    raise JobFailed(job.id, job.state.value, scrub_text(reason))
