"""One job type of an ``App`` (``@app.job``): its params model, how to enqueue it (in the
caller's transaction, async or sync) and, for the worker, how to run it (``async def`` on the
loop, ``def`` in the app's thread pool).
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any, Generic, Protocol, TypeVar, cast

from pydantic import BaseModel, ValidationError
from sqlalchemy import Connection, Engine
from sqlalchemy.ext.asyncio import AsyncConnection

from jobrelay.domain import delays
from jobrelay.domain.backoff import Backoff
from jobrelay.domain.delays import Delay, RunTime
from jobrelay.domain.dependencies import dependencies_of
from jobrelay.domain.ids import IdKeys, follow_up_job_id, keyed_job_id, request_hash, uuid7
from jobrelay.domain.limits import priority_limit
from jobrelay.errors import ConfigError, IdempotencyConflict, InvalidParams, PermanentError
from jobrelay.library.context import JobContext, JobType
from jobrelay.library.definition_checks import (
    check_job_signature,
    field_errors,
)
from jobrelay.library.enqueue_on import on_async, on_sync
from jobrelay.library.job_run import named_follow_up, operation_result
from jobrelay.library.limits import Limit, job_limits, job_priority
from jobrelay.library.operations import OperationContext, OperationResult
from jobrelay.library.sync_context import SyncJobFunction, run_in_thread, runs_in_thread
from jobrelay.observe import tracing
from jobrelay.settings import Settings
from jobrelay.storage.drivers.dbapi import (
    DBAPIConnection,
)
from jobrelay.storage.drivers.new_job import new_job_steps
from jobrelay.storage.drivers.new_jobs import new_jobs_steps
from jobrelay.storage.installation import IdKeyCache
from jobrelay.storage.records import NewJob, work_destination
from jobrelay.storage.steps import Steps

P = TypeVar("P", bound=BaseModel)
JobFunction = Callable[[JobContext[P], P], Awaitable[Any]]


class Owner(Protocol):
    """What a definition needs of the ``App`` that defined it (the app imports this module,
    so the definition sees it through this)."""

    @property
    def settings(self) -> Settings: ...
    @property
    def included_types(self) -> frozenset[str]: ...
    @property
    def prioritized_queues(self) -> frozenset[str]: ...
    def now(self) -> datetime: ...
    @property
    def clock_is_fake(self) -> bool: ...
    def id_key_cache(self, engine: Engine | str) -> IdKeyCache: ...


class JobDefinition(Generic[P]):
    """One job type of an ``App``: how to enqueue it, and (for the worker) how to run it."""

    def __init__(
        self,
        app: Owner,
        name: str,
        fn: JobFunction[P] | SyncJobFunction[P],
        params: type[P],
        *,
        max_attempts: int | None,
        retry_delays: tuple[int, ...] | None,
        queue: str,
        http: bool,
        result_filename: Callable[[str, Mapping[str, Any]], str] | None = None,
        timeout: float | None = None,
        limits: tuple[Limit, ...] = (),
        fair_by: Callable[[Any], str | None] | None = None,
        backoff: Backoff | None = None,
        priority: int | None = None,
    ) -> None:
        self.app = app
        self.type = name
        self.fn = fn
        self.in_thread = runs_in_thread(name, fn)  # a plain def: on a worker's thread
        check_job_signature(name, fn, params)  # the model: App.job, before the decorator
        self.params_model = params
        self._max_attempts = max_attempts
        self.retry_delays = retry_delays
        self.backoff = backoff  # instead of the delays: the worker's ``_transient``
        # Its jobs' default priority in its queue; given, the queue is a prioritized one.
        self.priority = priority
        self.queue = queue
        self.http = http
        self.result_filename = result_filename
        self.timeout = timeout  # seconds an attempt may run (the worker's ``worker.stopping``)
        self.limits = limits  # limits per key (``library.limits``), applied at admission
        self.fair_by = fair_by

    def __repr__(self) -> str:
        return f"<jobrelay job {self.type}>"

    @property
    def max_attempts(self) -> int:
        return self.max_attempts_under(self.app.settings)

    def max_attempts_under(self, settings: Settings) -> int:
        """The definition's own ``max_attempts``, else ``settings.max_attempts``."""
        return self._max_attempts or settings.max_attempts

    # --- enqueue ---------------------------------------------------------------------------

    def parse(self, params: P | Mapping[str, Any]) -> P:
        """The parameters as the model, or ``InvalidParams`` naming each bad field."""
        if isinstance(params, self.params_model):
            params = params.model_dump(mode="json")
        try:
            return self.params_model.model_validate(params)
        except ValidationError as exc:
            raise InvalidParams(self.type, field_errors(exc)) from None

    def new_job(
        self,
        params: P | Mapping[str, Any],
        *,
        key: str | None = None,
        account: str | None = None,
        job_id: str | None = None,
        headers: Mapping[str, str] | None = None,
        max_attempts: int | None = None,
        keys: IdKeys | None = None,
        when: RunTime = delays.NOW,
        after: Iterable[str] = (),
        after_failure: str = "cancel",
        priority: int | None = None,
    ) -> NewJob:
        """The job to write. Its id: ``job_id``; else, with ``key``, keyed with ``keys`` (the
        installation's, required then: ``Store.id_keys``), and also the id under the previous
        secret while that one counts; else a fresh UUIDv7. ``when``: its run time
        (``domain.delays.resolve``), part of the request hash as it was asked for, as are
        ``after`` and ``after_failure`` (``dependencies_of``). ``priority``: in its queue,
        else the type's (``job_priority``)."""
        parsed = self.parse(params)
        limits = job_limits(self.type, self.limits, parsed, self.fair_by)
        prioritized = self.queue in self.app.prioritized_queues
        rank = job_priority(self.type, self.queue, prioritized, priority, self.priority)
        if prioritized:
            limits = (*limits, priority_limit(self.queue))
        stored = parsed.model_dump(mode="json")
        deps = dependencies_of(after, after_failure, self.app.settings.max_dependencies)
        previous = None
        if job_id is None and key is not None:
            if keys is None:
                raise ConfigError("enqueue", "a job with key= needs the installation's id keys")
            job_id, previous = keys.derive(lambda s: keyed_job_id(s, self.type, account, key))
        elif job_id is None:
            job_id = uuid7()
        return NewJob(
            job_id=job_id,
            type=self.type,
            account_id=account,
            params=stored,
            request_hash=request_hash(account, self.type, stored, when.requested, deps.requested),
            max_attempts=max_attempts or self.max_attempts,
            idempotency_key=key,
            headers=headers,
            destination=work_destination(self.queue),
            queue=self.queue,
            previous_job_id=previous,
            run_at=when.due,
            delay=when.delay,
            limits=limits,
            after=deps.ids,
            after_failure=deps.after_failure,
            priority=rank,
        )

    async def enqueue(
        self,
        conn: AsyncConnection,
        params: P | Mapping[str, Any],
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
        """Write the job on ``conn`` (the caller's open transaction); returns its id.

        The same ``key`` with the same parameters returns the same id and writes nothing;
        with other parameters it raises ``IdempotencyConflict``. ``job_id`` replaces the
        id derived from ``key`` (an application with its own id scheme); the same id with
        the same parameters is again the same job.

        ``delay`` (seconds or a ``timedelta``) or ``run_at`` (an aware ``datetime``) hold the
        job until then: it is not published, so no worker holds it while it waits. A bad one
        raises ``InvalidRunTime`` before anything is written; the run time is part of the
        request (the same key with another run time is an ``IdempotencyConflict``).

        ``after`` (job ids): the job is ``waiting`` until every one of them has ended, and
        is queued by the transaction that commits the last one's outcome, exactly once. One
        that ends ``quarantined`` or ``cancelled`` cancels it, naming that job, unless
        ``after_failure="run"``. Ids that do not exist (or, with ``account``, are another
        account's) raise ``InvalidDependencies`` before anything is written.
        """
        return await on_async(
            "enqueue",
            conn,
            lambda database, dialect: self._enqueue_steps(
                database,
                dialect,
                params,
                key,
                account,
                job_id,
                self._when(delay, run_at),
                after,
                after_failure,
                priority,
            ),
        )

    def enqueue_sync(
        self,
        conn: Connection | DBAPIConnection,
        params: P | Mapping[str, Any],
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
        """``enqueue`` for a synchronous application: on a SQLAlchemy ``Connection``, or on
        the DB-API connection a framework holds (psycopg 3, sqlite3: Django's
        ``connection.connection`` inside ``transaction.atomic()``), never committed here."""
        when = self._when(delay, run_at)
        return on_sync(
            "enqueue_sync",
            conn,
            lambda database, dialect: self._enqueue_steps(
                database,
                dialect,
                params,
                key,
                account,
                job_id,
                when,
                after,
                after_failure,
                priority,
            ),
            keyed=key is not None,
        )

    async def enqueue_many(
        self,
        conn: AsyncConnection,
        params: Sequence[P | Mapping[str, Any]],
        *,
        keys: Sequence[str | None] | None = None,
        account: str | None = None,
        delay: Delay | None = None,
        run_at: datetime | None = None,
        after: Iterable[str] = (),
        after_failure: str = "cancel",
        priority: int | None = None,
    ) -> list[str]:
        """Many jobs of this type on ``conn`` (the caller's open transaction), in statements
        of many rows (a few round trips for thousands of jobs); their ids, in order.

        Each is what ``enqueue`` would write: ``keys`` (one per job, or None) make each
        idempotent as ``key`` does, and ``delay``, ``run_at``, ``after``, ``after_failure``
        apply to every job. Every job's parameters are checked before anything is written:
        one bad one raises ``InvalidParams`` naming its index, and nothing is written. A
        job with ``after=`` is written on its own (its dependencies are read and locked).
        """
        return await on_async(
            "enqueue_many",
            conn,
            lambda database, dialect: self._enqueue_many_steps(
                database,
                dialect,
                params,
                keys,
                account,
                self._when(delay, run_at),
                after,
                after_failure,
                priority,
            ),
        )

    def enqueue_many_sync(
        self,
        conn: Connection | DBAPIConnection,
        params: Sequence[P | Mapping[str, Any]],
        *,
        keys: Sequence[str | None] | None = None,
        account: str | None = None,
        delay: Delay | None = None,
        run_at: datetime | None = None,
        after: Iterable[str] = (),
        after_failure: str = "cancel",
        priority: int | None = None,
    ) -> list[str]:
        """``enqueue_many`` for a synchronous application, on the connections
        ``enqueue_sync`` takes."""
        when = self._when(delay, run_at)
        return on_sync(
            "enqueue_many_sync",
            conn,
            lambda database, dialect: self._enqueue_many_steps(
                database, dialect, params, keys, account, when, after, after_failure, priority
            ),
            keyed=keys is not None and any(k is not None for k in keys),
        )

    def _enqueue_many_steps(
        self,
        database: Engine | str,
        dialect: str,
        params: Sequence[P | Mapping[str, Any]],
        keys: Sequence[str | None] | None,
        account: str | None,
        when: RunTime,
        after: Iterable[str],
        after_failure: str,
        priority: int | None = None,
    ) -> Steps[list[str]]:
        if isinstance(params, Mapping | BaseModel) or not isinstance(params, Sequence):
            raise ConfigError("enqueue_many", "params must be a list of parameters, one per job")
        if keys is not None and len(keys) != len(params):
            raise ConfigError(
                "enqueue_many", f"keys has {len(keys)} items for {len(params)} jobs: one per job"
            )
        now = self.app.now()
        id_keys = None
        if keys is not None and any(k is not None for k in keys):
            id_keys = yield from self.app.id_key_cache(database).steps(now)
        after = tuple(after)
        batch = []
        for index, one in enumerate(params):
            try:
                batch.append(
                    self.new_job(
                        one,
                        key=None if keys is None else keys[index],
                        account=account,
                        keys=id_keys,
                        when=when,
                        after=after,
                        after_failure=after_failure,
                        priority=priority,
                    )
                )
            except InvalidParams as exc:
                where = [
                    {**e, "field": f"[{index}]" + (f".{e['field']}" if e["field"] else "")}
                    for e in exc.errors
                ]
                raise InvalidParams(self.type, where) from None
        try:
            return (yield from new_jobs_steps(dialect, batch, now))
        except IdempotencyConflict:
            raise IdempotencyConflict(
                f"a key of this batch was already used for {self.type} with other params"
            ) from None

    def _enqueue_steps(
        self,
        database: Engine | str,
        dialect: str,
        params: P | Mapping[str, Any],
        key: str | None,
        account: str | None,
        job_id: str | None,
        when: RunTime,
        after: Iterable[str] = (),
        after_failure: str = "cancel",
        priority: int | None = None,
    ) -> Steps[str]:
        now = self.app.now()
        keys = None
        if key is not None and job_id is None:
            keys = yield from self.app.id_key_cache(database).steps(now)
        job = self.new_job(
            params,
            key=key,
            account=account,
            job_id=job_id,
            keys=keys,
            when=when,
            after=after,
            after_failure=after_failure,
            priority=priority,
        )
        try:
            written, _ = yield from new_job_steps(dialect, job, now)
        except IdempotencyConflict:
            raise IdempotencyConflict(
                f"key {key!r} was already used for {self.type} with other params"
            ) from None
        return written

    def _when(self, delay: Delay | None, run_at: datetime | None) -> RunTime:
        """The run time, checked at the call (before any statement is sent). This host's
        clock only judges whether a ``run_at`` is past; a delay is added by the database's,
        unless a test's fake clock drives the app (``App.bind``): then by that clock."""
        now = self.app.now()
        when = delays.resolve(now, delay=delay, run_at=run_at)
        if when.delay is not None and self.app.clock_is_fake:
            return dataclasses.replace(when, due=now + timedelta(seconds=when.delay), delay=None)
        return when

    # --- run (the worker's Operation) -------------------------------------------------------

    def validate(self, params: Mapping[str, Any]) -> None:
        """``InvalidParams`` naming each bad field, as ``enqueue`` would raise it."""
        try:
            self.params_model.model_validate(params)
        except ValidationError as exc:
            raise InvalidParams(self.type, field_errors(exc)) from None

    async def run(self, ctx: OperationContext) -> OperationResult:
        try:
            params = self.params_model.model_validate(ctx.job.params)
        except ValidationError as exc:
            raise PermanentError(str(InvalidParams(self.type, field_errors(exc)))) from None
        job = ctx.job

        def follow_up(target: JobType | str, p: BaseModel | Mapping[str, Any]) -> NewJob:
            if isinstance(target, JobDefinition):
                return target.new_job(
                    p,
                    account=job.account_id,
                    job_id=follow_up_job_id(job.id, target.type),
                    max_attempts=target._max_attempts or job.max_attempts,
                    # Its enqueue is a child of this run (``observe.tracing``).
                    headers=tracing.follow_up_headers(),
                )
            return named_follow_up(job, target, p, self.app.included_types)

        async def fault_point(point: str) -> None:
            await ctx.faults.ahit(point, attempt=ctx.attempt, params=job.params)

        context: JobContext[P] = JobContext(
            job_id=job.id,
            job_type=job.type,
            attempt=ctx.attempt,
            params=params,
            account=job.account_id,
            results=ctx.results,
            engine=ctx.store.engine,
            lease_lost=ctx.lease_lost,
            report_progress=ctx.report_progress,
            make_follow_up=follow_up,
            fault_point=fault_point,
            load_dependencies=lambda: ctx.store.dependencies_of(job.id),
            max_dependencies=self.app.settings.max_dependencies,
        )
        if self.in_thread:
            sync_fn = cast("SyncJobFunction[P]", self.fn)
            returned = await run_in_thread(ctx.thread, sync_fn, context, params)
        else:
            returned = self.fn(context, params)  # type: ignore[arg-type]
            if inspect.isawaitable(returned):
                returned = await returned
        return operation_result(returned, context, self.app.settings.result_max_bytes)
