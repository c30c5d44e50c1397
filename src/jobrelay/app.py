"""The library surface: ``App``, ``@app.job``, and enqueueing inside the caller's transaction.

A job type is an async function of a ``JobContext`` and a pydantic model of its parameters::

    app = jobrelay.App()

    @app.job("images.resize", params=Resize, max_attempts=5, retry_delays=(5, 30))
    async def resize(ctx: jobrelay.JobContext[Resize], params: Resize) -> jobrelay.Result | None:
        ...

    async with engine.begin() as conn:            # the application's own transaction
        await conn.execute(insert(images).values(...))
        job_id = await resize.enqueue(conn, Resize(image_id=1, width=100), key="img-1-100")

``enqueue`` writes the job row, its outbox row and its ``accepted`` event on the caller's
connection and nothing else: it never commits, never opens a connection, and a rollback
leaves no trace. Parameters are validated at enqueue (``InvalidParams``, nothing written)
and again when the job runs (a stored payload that no longer validates quarantines the job
with the validation message). Each definition is also the worker's ``Operation`` for its
type, so the worker runs application jobs and the shipped ones the same way.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable, Mapping
from datetime import UTC, datetime
from typing import Any, Generic, TypeVar

from pydantic import BaseModel, ValidationError
from sqlalchemy import Connection
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from jobrelay.context import JobContext, Result
from jobrelay.domain.ids import follow_up_job_id, keyed_job_id, request_hash, uuid7
from jobrelay.errors import ConfigError, InvalidParams, PermanentError
from jobrelay.operations.base import Operation, OperationContext, OperationResult, Registry
from jobrelay.settings import Settings
from jobrelay.storage.enqueue import new_job_steps, run_async, run_sync
from jobrelay.storage.records import JobRecord, NewJob

P = TypeVar("P", bound=BaseModel)
JobFunction = Callable[[JobContext[P], P], Awaitable[Result | None]]
_NAME_MAX = 64  # jobs.type
DEFAULT_QUEUE = "default"


def _field_errors(exc: ValidationError) -> list[dict[str, str]]:
    return [
        {"field": ".".join(str(p) for p in err["loc"]), "message": err["msg"]}
        for err in exc.errors(include_url=False)
    ]


class JobDefinition(Generic[P]):
    """One job type of an ``App``: how to enqueue it, and (for the worker) how to run it."""

    def __init__(
        self,
        app: App,
        name: str,
        fn: JobFunction[P],
        params: type[P],
        *,
        max_attempts: int | None,
        retry_delays: tuple[int, ...] | None,
        queue: str,
        http: bool,
    ) -> None:
        self.app = app
        self.type = name
        self.fn = fn
        self.params_model = params
        self._max_attempts = max_attempts
        self.retry_delays = retry_delays
        self.queue = queue
        self.http = http

    def __repr__(self) -> str:
        return f"<jobrelay job {self.type}>"

    @property
    def max_attempts(self) -> int:
        return self._max_attempts or self.app.settings.max_attempts

    # --- enqueue ---------------------------------------------------------------------------

    def parse(self, params: P | Mapping[str, Any]) -> P:
        """The parameters as the model, or ``InvalidParams`` naming each bad field."""
        if isinstance(params, self.params_model):
            params = params.model_dump(mode="json")
        try:
            return self.params_model.model_validate(params)
        except ValidationError as exc:
            raise InvalidParams(self.type, _field_errors(exc)) from None

    def new_job(
        self,
        params: P | Mapping[str, Any],
        *,
        key: str | None = None,
        account: str | None = None,
        job_id: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> NewJob:
        stored = self.parse(params).model_dump(mode="json")
        if job_id is None:
            job_id = keyed_job_id(self.type, account, key) if key is not None else uuid7()
        return NewJob(
            job_id=job_id,
            type=self.type,
            account_id=account,
            params=stored,
            request_hash=request_hash(account, self.type, stored),
            max_attempts=self.max_attempts,
            idempotency_key=key,
            headers=headers,
        )

    async def enqueue(
        self,
        conn: AsyncConnection,
        params: P | Mapping[str, Any],
        *,
        key: str | None = None,
        account: str | None = None,
    ) -> str:
        """Write the job on ``conn`` (the caller's open transaction); returns its id.

        The same ``key`` with the same parameters returns the same id and writes nothing;
        with other parameters it raises ``IdempotencyConflict``.
        """
        job = self.new_job(params, key=key, account=account)
        job_id, _ = await run_async(conn, new_job_steps(conn.dialect.name, job, _now()))
        return job_id

    def enqueue_sync(
        self,
        conn: Connection,
        params: P | Mapping[str, Any],
        *,
        key: str | None = None,
        account: str | None = None,
    ) -> str:
        """``enqueue`` for a synchronous application (psycopg 3 or sqlite3 connection)."""
        job = self.new_job(params, key=key, account=account)
        job_id, _ = run_sync(conn, new_job_steps(conn.dialect.name, job, _now()))
        return job_id

    # --- run (the worker's Operation) -------------------------------------------------------

    def validate(self, params: Mapping[str, Any]) -> None:
        try:
            self.params_model.model_validate(params)
        except ValidationError as exc:
            raise PermanentError(str(InvalidParams(self.type, _field_errors(exc)))) from None

    async def run(self, ctx: OperationContext) -> OperationResult:
        try:
            params = self.params_model.model_validate(ctx.job.params)
        except ValidationError as exc:
            raise PermanentError(str(InvalidParams(self.type, _field_errors(exc)))) from None
        job = ctx.job

        def follow_up(definition: JobDefinition[Any], p: BaseModel | Mapping[str, Any]) -> NewJob:
            return definition.new_job(
                p, account=job.account_id, job_id=follow_up_job_id(job.id, definition.type)
            )

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
        )
        result = await self.fn(context, params) or Result()
        return OperationResult(
            result_key=result.key,
            meta=dict(result.meta),
            follow_ups=tuple(context.follow_ups),
        )


class App:
    """A set of job types, and the settings they run with (``JOBRELAY_*`` by default)."""

    def __init__(self, settings: Settings | None = None) -> None:
        self._settings = settings
        self._jobs: dict[str, JobDefinition[Any]] = {}
        self._builtins: list[Callable[[Settings], Operation]] = []
        self._engine: AsyncEngine | None = None

    @property
    def settings(self) -> Settings:
        if self._settings is None:
            self._settings = Settings()
        return self._settings

    @property
    def jobs(self) -> Mapping[str, JobDefinition[Any]]:
        return dict(self._jobs)

    def job(
        self,
        name: str,
        *,
        params: type[P],
        max_attempts: int | None = None,
        retry_delays: tuple[int, ...] | None = None,
        queue: str = DEFAULT_QUEUE,
        http: bool = False,
    ) -> Callable[[JobFunction[P]], JobDefinition[P]]:
        """Define job type ``name``; the decorated function runs it."""
        if not name or len(name) > _NAME_MAX or name in self._jobs:
            raise ConfigError("@app.job", f"job name {name!r} is empty, too long or taken")
        if queue != DEFAULT_QUEUE:
            raise ConfigError("@app.job", "queues other than 'default' are not supported yet")
        if max_attempts is not None and not 1 <= max_attempts <= 100:
            raise ConfigError("@app.job", f"max_attempts must be 1..100, got {max_attempts}")
        if retry_delays is not None and (not retry_delays or min(retry_delays) < 1):
            raise ConfigError("@app.job", f"retry_delays must be positive seconds: {retry_delays}")

        def define(fn: JobFunction[P]) -> JobDefinition[P]:
            definition = JobDefinition(
                self,
                name,
                fn,
                params,
                max_attempts=max_attempts,
                retry_delays=tuple(retry_delays) if retry_delays else None,
                queue=queue,
                http=http,
            )
            self._jobs[name] = definition
            return definition

        return define

    def include(self, factory: Callable[[Settings], Operation]) -> None:
        """Add a job type written against the lower-level ``Operation`` port."""
        self._builtins.append(factory)

    def registry(self, settings: Settings | None = None) -> Registry:
        settings = settings or self.settings
        return Registry([*(f(settings) for f in self._builtins), *self._jobs.values()])

    def retry_tiers(self, settings: Settings | None = None) -> tuple[int, ...]:
        """Every delay a job of this app may be retried after (the broker needs a queue each)."""
        delays = set((settings or self.settings).retry_delays)
        for definition in self._jobs.values():
            delays.update(definition.retry_delays or ())
        return tuple(sorted(delays))

    # --- without a transaction of the caller's ------------------------------------------------

    def _engine_for_calls(self) -> AsyncEngine:
        if self._engine is None:
            from jobrelay.storage.engine import create_engine

            self._engine = create_engine(self.settings.database_url)
        return self._engine

    async def enqueue(
        self,
        name: str,
        params: BaseModel | Mapping[str, Any],
        *,
        key: str | None = None,
        account: str | None = None,
    ) -> str:
        """Enqueue in a transaction of its own (for callers with no transaction to join)."""
        definition = self._jobs.get(name)
        if definition is None:
            raise ConfigError("App.enqueue", f"no job type {name!r} in this app")
        async with self._engine_for_calls().begin() as conn:
            return await definition.enqueue(conn, params, key=key, account=account)

    async def get_job(self, job_id: str) -> JobRecord | None:
        from jobrelay.storage.store import Store

        return await Store(self._engine_for_calls()).get_job(job_id)

    async def aclose(self) -> None:
        if self._engine is not None:
            with contextlib.suppress(Exception):
                await self._engine.dispose()
            self._engine = None


def _now() -> datetime:
    return datetime.now(UTC)
