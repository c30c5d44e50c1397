"""What a job function gets (``JobContext``) and may return (``Result``).

The context is narrow on purpose: the job's identity and typed parameters, progress, a
results writer whose objects the worker publishes only inside the job's fenced completion,
the signal that the lease was lost, a logger bound to the job id, follow-up jobs committed
with this job's success, and the database engine for the application's own tables. It does
not hand out jobrelay's store: a job cannot ack early, publish behind the outbox's back or
move its own state.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Generic, Protocol, TypeVar

from pydantic import BaseModel
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from jobrelay.domain.dependencies import dependencies_of
from jobrelay.domain.ids import request_hash
from jobrelay.results.base import ResultSession, ResultStore
from jobrelay.storage.engine import read_only, snapshot
from jobrelay.storage.records import JobRecord, NewJob

P = TypeVar("P", bound=BaseModel)


class JobType(Protocol):
    """A job definition as ``follow_up`` takes it (a ``JobDefinition`` is one: named here,
    since the definitions' module imports this one)."""

    @property
    def type(self) -> str: ...


@dataclass(frozen=True)
class Result:
    """A job's outcome: the key of the object it stored (if any), facts to keep with it, and
    a JSON value (``Job.result``). A job that returns a plain JSON value (a dict, a list, a
    str, a number, a bool) returns ``Result(value=that)``."""

    key: str | None = None
    meta: Mapping[str, Any] = field(default_factory=dict)
    value: Any = None


class _JobLog(logging.LoggerAdapter[logging.Logger]):
    def process(self, msg: Any, kwargs: Any) -> tuple[Any, Any]:
        extra = dict(self.extra or {})
        extra.update(kwargs.get("extra") or {})
        kwargs["extra"] = extra
        return msg, kwargs


class JobContext(Generic[P]):
    """One attempt of one job, as its function sees it."""

    def __init__(
        self,
        *,
        job_id: str,
        job_type: str,
        attempt: int,
        params: P,
        account: str | None,
        results: ResultStore,
        engine: AsyncEngine,
        lease_lost: asyncio.Event,
        report_progress: Callable[[int, int], Awaitable[None]],
        make_follow_up: Callable[[JobType | str, BaseModel | Mapping[str, Any]], NewJob],
        fault_point: Callable[[str], Awaitable[None]] | None = None,
        load_dependencies: Callable[[], Awaitable[list[JobRecord]]] | None = None,
        max_dependencies: int = 10_000,
    ) -> None:
        self.job_id = job_id
        self.job_type = job_type
        self.attempt = attempt
        self.params = params
        self.account = account
        self.engine = engine  # the application's own tables live in the same database
        self.lease_lost = lease_lost
        self.log: logging.LoggerAdapter[logging.Logger] = _JobLog(
            logging.getLogger(f"jobrelay.job.{job_type}"), {"jobId": job_id, "attempt": attempt}
        )
        self._results = results
        self._report_progress = report_progress
        self._make_follow_up = make_follow_up
        self._fault_point = fault_point
        self._load_dependencies = load_dependencies
        self._max_dependencies = max_dependencies
        self.follow_ups: list[NewJob] = []

    async def progress(self, done: int, total: int) -> None:
        """Record how far the job is; raises ``CancelledError`` once the lease is lost."""
        await self._report_progress(done, total)

    def result_key(self, filename: str) -> str:
        """The key to write this job's object under: the same for every attempt. On
        ``s3://`` each attempt's upload lands beside it (``writer``), at
        ``<stem>.attempt-N.<ext>``, and that is the job's ``resultKey``."""
        return f"{self.job_type}/{self.job_id}/{filename}"

    def writer(self, key: str) -> ResultSession:
        """``async with ctx.writer(key) as w: await w.write(...)``: staged, and the job's
        result only when this attempt's success is committed. On ``file://`` it is then
        at ``key``; on ``s3://`` it was uploaded under a key of this attempt's own
        (``<stem>.attempt-<n>.<ext>`` beside ``key``), which the success records as the
        job's ``resultKey`` (return ``key``: the worker records where it went)."""
        return self._results.writer(key, staged=True)

    def follow_up(
        self,
        job: JobType | str,
        params: BaseModel | Mapping[str, Any],
        *,
        after: Iterable[str] = (),
        after_failure: str = "cancel",
    ) -> str:
        """A job created in the SAME transaction as this job's success, once: its id is
        derived from this job's, so a second success of this job cannot make a second one.

        ``job`` is a definition, or the type name of a job included with
        ``App.include(..., type=...)`` (such as ``notify.email``), whose parameters are
        then checked when it runs. Without its own ``max_attempts`` it inherits this job's.
        ``after`` / ``after_failure``: as for ``enqueue``, it runs once those jobs have ended.
        """
        new = self._make_follow_up(job, params)
        if after or after_failure != "cancel":
            deps = dependencies_of(after, after_failure, self._max_dependencies)
            new = replace(
                new,
                after=deps.ids,
                after_failure=deps.after_failure,
                request_hash=request_hash(
                    new.account_id, new.type, new.params, None, deps.requested
                ),
            )
        self.follow_ups.append(new)
        return new.job_id

    async def dependencies(self) -> list[JobRecord]:
        """The jobs this one runs after (``after=``), in the order given, as
        ``jobrelay.Job``: each one's state, result and last error. Empty for a job written
        without ``after=``."""
        if self._load_dependencies is None:
            return []
        return await self._load_dependencies()

    def read_only(self) -> contextlib.AbstractAsyncContextManager[AsyncConnection]:
        """A read-only transaction on ``engine`` for the application's own tables: on SQLite
        it begins DEFERRED, so a long read (a server-side cursor) never holds the write lock
        that jobrelay's own writes need."""
        return read_only(self.engine)

    def snapshot(self) -> contextlib.AbstractAsyncContextManager[AsyncConnection]:
        """``read_only``, and every read in it sees the same state of the database, fixed on
        entry: on PostgreSQL ``REPEATABLE READ READ ONLY``, on SQLite a WAL read snapshot.
        A count and the rows it counts then agree, whatever commits meanwhile. For driver
        features (asyncpg's ``copy_from_query``, aiosqlite's cursors) use the driver's
        connection, ``(await conn.get_raw_connection()).driver_connection``: it is in the
        same transaction and snapshot."""
        return snapshot(self.engine)

    async def fault_point(self, name: str) -> None:
        """A named point where ``JOBRELAY_FAULTS`` may inject a failure (tests, demos,
        chaos); does nothing unless a fault is armed at ``name`` for this job."""
        if self._fault_point is not None:
            await self._fault_point(name)

    @property
    def lease_is_lost(self) -> bool:
        return self.lease_lost.is_set()
