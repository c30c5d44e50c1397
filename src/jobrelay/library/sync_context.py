"""Plain ``def`` jobs: which callables are job functions, the context a thread gets, the pool.

A job function is an ``async def`` (or any callable returning an awaitable: a lambda, a
``functools.partial`` of one), run on the worker's loop; or a plain ``def``, run on a thread
of the worker's bounded pool (``JOBRELAY_SYNC_THREADS``, ``worker.threads``), taken before
the claim, with a ``SyncJobContext``. Either way the worker claims before the body starts
and commits the fenced outcome before the ack.

A thread cannot be interrupted: when the lease is lost, ``ctx.lease_lost`` (also
``ctx.cancelled``) is set and the attempt is recorded as failed at once, but the body runs
on until it returns (abandoned: counted, and its thread replaced up to a cap,
``worker.threads``); whatever it returns then is discarded (the attempt's outcome was
already written, and the fences refuse a superseded claim's).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import functools
import inspect
import logging
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from pydantic import BaseModel

from jobrelay.errors import AttemptSuperseded, ConfigError

if TYPE_CHECKING:
    from jobrelay.library.context import JobContext, JobType
    from jobrelay.library.operations import JobThread
    from jobrelay.storage.records import JobRecord

P = TypeVar("P", bound=BaseModel)
# How long a thread's ``ctx.progress`` waits for the loop to record it; the write is not
# cancelled then (it goes on), the body just stops waiting for it.
PROGRESS_WAIT_SECONDS = 10.0

log = logging.getLogger("jobrelay.worker")


def runs_in_thread(name: str, fn: object) -> bool:
    """True for a plain ``def`` job, False for an async one; ``ConfigError`` for anything
    that is not a job function (a class, a generator, an async generator, a non-callable)."""
    inner = fn.func if isinstance(fn, functools.partial) else fn
    call = inner if inspect.isroutine(inner) or not callable(inner) else type(inner).__call__
    if (
        inspect.isclass(inner)
        or not callable(inner)
        or inspect.isgeneratorfunction(call)
        or inspect.isasyncgenfunction(call)
    ):
        raise ConfigError(
            "@app.job",
            f"{name}: {fn!r} is not a job function (an async def or a def of ctx and params)",
        )
    # A lambda cannot hold a body: it returns the coroutine that does.
    return not (inspect.iscoroutinefunction(call) or getattr(call, "__name__", "") == "<lambda>")


class SyncJobContext(Generic[P]):
    """One attempt of a ``def`` job, as its thread sees it: what a sync body can call.

    It has no database access: ``JobContext.engine`` and its transactions are async. A
    ``def`` job opens its own synchronous connection for the application's tables (its
    framework's, or ``sqlalchemy.create_engine`` on a sync URL); nothing it writes there is
    fenced or part of the job's outcome.
    """

    def __init__(self, ctx: JobContext[P], loop: asyncio.AbstractEventLoop) -> None:
        self._ctx = ctx
        self._loop = loop
        self.job_id = ctx.job_id
        self.job_type = ctx.job_type
        self.attempt = ctx.attempt
        self.params = ctx.params
        self.account = ctx.account
        self.log = ctx.log
        # Set when this attempt's claim is lost (or the worker stops it); the body should
        # check it between steps and return: it cannot be interrupted.
        self.lease_lost = threading.Event()
        self.cancelled = self.lease_lost

    @property
    def follow_ups(self) -> list[Any]:
        return self._ctx.follow_ups

    def progress(self, done: int, total: int) -> None:
        """Record how far the job is (waits up to ``PROGRESS_WAIT_SECONDS`` for the write,
        then returns while the write goes on).

        Raises ``AttemptSuperseded`` once the lease is lost: the body should stop.
        """
        if self.lease_lost.is_set():
            raise AttemptSuperseded("the lease was lost: this attempt no longer holds the job")
        future = asyncio.run_coroutine_threadsafe(self._ctx.progress(done, total), self._loop)
        try:
            future.result(PROGRESS_WAIT_SECONDS)
        except concurrent.futures.TimeoutError:
            # The body goes on; the write is left to finish on the loop, never cancelled
            # inside its statement (the driver would throw its connection away).
            log.warning(
                "progress not recorded in time (the write goes on without the job waiting)",
                extra={"event": "progress_timeout", "jobId": self.job_id},
            )
        except concurrent.futures.CancelledError:
            self.lease_lost.set()
            raise AttemptSuperseded(
                "the lease was lost: this attempt no longer holds the job"
            ) from None

    def result_key(self, filename: str) -> str:
        """The key to write this job's object under: the same for every attempt. On
        ``s3://`` each attempt's upload lands beside it, at ``<stem>.attempt-N.<ext>``,
        and that is the job's ``resultKey``."""
        return self._ctx.result_key(filename)

    def follow_up(
        self,
        job: JobType | str,
        params: BaseModel | Mapping[str, Any],
        *,
        after: Iterable[str] = (),
        after_failure: str = "cancel",
    ) -> str:
        """``JobContext.follow_up``: a job created with this job's success, once."""
        return self._ctx.follow_up(job, params, after=after, after_failure=after_failure)

    def dependencies(self) -> list[JobRecord]:
        """``JobContext.dependencies``: the jobs this one runs after, read on the worker's
        loop (this thread waits for the read)."""
        future = asyncio.run_coroutine_threadsafe(self._ctx.dependencies(), self._loop)
        return future.result()

    @property
    def lease_is_lost(self) -> bool:
        return self.lease_lost.is_set()


SyncJobFunction = Callable[[SyncJobContext[P], P], Any]


async def run_in_thread(
    thread: JobThread | None,
    fn: SyncJobFunction[P],
    ctx: JobContext[P],
    params: P,
) -> Any:
    """Run ``fn`` on ``thread`` (the worker's, taken before the claim; None outside a worker:
    the loop's default executor); on cancel (time limit, lease lost, worker stopping) signal
    the thread through ``ctx.lease_lost`` and return at once, leaving the thread to finish
    alone."""
    loop = asyncio.get_running_loop()
    sync_ctx = SyncJobContext(ctx, loop)
    watch = asyncio.create_task(_mirror(ctx.lease_lost, sync_ctx.lease_lost))
    # The body runs with the run's context (its span, its log fields), as asyncio.to_thread
    # gives it: a follow-up it makes is enqueued under the run, its lines carry the job.
    body = functools.partial(contextvars.copy_context().run, fn, sync_ctx, params)
    try:
        if thread is None:
            return await loop.run_in_executor(None, body)
        return await thread.run(ctx.job_id, body)
    except asyncio.CancelledError:
        sync_ctx.lease_lost.set()
        raise
    finally:
        watch.cancel()


async def _mirror(source: asyncio.Event, target: threading.Event) -> None:
    await source.wait()
    target.set()
