"""The operator's verbs on an ``App``, for an application's own code: cancel, replay, resend,
list, pause and resume, each the CLI's own (``library.operator``: the same guarded transition,
event, actor, metric and log line), and a sync twin of each for code with no event loop.

The async verbs use the app's engine (bound to the event loop that first used it); a sync
twin runs on a loop of its own with an engine of its own, closed when it returns, so a Django
view or a script can call it. The actor an event names is ``actor``, or
``app:<user>@<host>``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any, TypeVar

from jobrelay.domain.states import JobState
from jobrelay.errors import ConfigError
from jobrelay.library.operator import Operator, app_actor, set_queue_paused
from jobrelay.settings import Settings
from jobrelay.storage.admin import ActionOutcome, AdminQueries
from jobrelay.storage.records import utc_now

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncEngine

    from jobrelay.observe.metrics import Metrics
    from jobrelay.storage.port import StorePort
    from jobrelay.storage.store import JobRecord

T = TypeVar("T")


@dataclass(frozen=True)
class _Site:
    """An ``OperatorSite`` made of what an App has: its store, its clock, its metrics."""

    settings: Settings
    store: StorePort
    metrics: Metrics
    app: OperatorVerbs
    clock: Callable[[], datetime] = field(default=utc_now)

    def job_app(self) -> OperatorVerbs:
        return self.app


class OperatorVerbs:
    """Mixed into ``App``."""

    if TYPE_CHECKING:

        @property
        def settings(self) -> Settings: ...

        @property
        def queues(self) -> tuple[str, ...]: ...

        @property
        def jobs(self) -> Mapping[str, Any]: ...

        def _engine_for_calls(self) -> AsyncEngine: ...

        def now(self) -> datetime: ...

        @property
        def clock_is_fake(self) -> bool: ...

    _verb_metrics: Metrics | None = None

    def _site(self, engine: AsyncEngine) -> _Site:
        # Here, not at import: an application imports App; prometheus_client only a caller.
        from jobrelay.observe.metrics import Metrics
        from jobrelay.storage.store import Store

        if self._verb_metrics is None:
            self._verb_metrics = Metrics()
        # A test's fake clock (``App.bind``) is the store's too: the verbs' times are its.
        clock = self.now if self.clock_is_fake else None
        return _Site(self.settings, Store(engine, clock=clock), self._verb_metrics, self)

    # --- async -------------------------------------------------------------------------------

    async def cancel(self, job_id: str, *, reason: str, actor: str | None = None) -> ActionOutcome:
        """Cancel a job that has not ended: ``queued``, ``retry_wait``, ``waiting`` or
        ``quarantined`` at once; a ``running`` one is asked to stop (``outcome.requested``), and
        its worker ends it ``cancelled``. ``outcome.done`` False: nothing changed, and
        ``outcome.state`` is what the job was (None: no such job)."""
        site = self._site(self._engine_for_calls())
        return await Operator(site).cancel(job_id, actor=actor or app_actor(), reason=reason)

    async def replay(
        self, job_id: str, *, reason: str = "replayed by the application", actor: str | None = None
    ) -> ActionOutcome:
        """A ``quarantined`` job back to ``queued`` with a fresh budget of attempts."""
        site = self._site(self._engine_for_calls())
        return await Operator(site).replay(job_id, actor=actor or app_actor(), reason=reason)

    async def resend(
        self, job_id: str, *, reason: str = "resent by the application", actor: str | None = None
    ) -> ActionOutcome:
        """Send a ``queued`` job's message again (one that was lost or dead-lettered)."""
        site = self._site(self._engine_for_calls())
        return await Operator(site).resend(job_id, actor=actor or app_actor(), reason=reason)

    async def list_jobs(
        self,
        *,
        state: JobState | str | None = None,
        type: str | None = None,
        account: str | None = None,
        queue: str | None = None,
        reason: str | None = None,
        limit: int = 100,
    ) -> AsyncIterator[JobRecord]:
        """The jobs that match, newest first, at most ``limit``; ``reason``: part of the
        quarantine reason or last error, any case."""
        store = self._site(self._engine_for_calls()).store
        for job in await _find(store, state, type, account, queue, reason, limit):
            yield job

    async def pause_queue(self, queue: str, *, reason: str, actor: str | None = None) -> bool:
        """Stop workers taking ``queue``'s deliveries (they finish what they hold); False when
        it was paused already. ``UnknownQueue`` for a queue this app does not have."""
        site = self._site(self._engine_for_calls())
        return await self._set_paused_on(site, queue, True, reason, actor)

    async def resume_queue(self, queue: str, *, reason: str, actor: str | None = None) -> bool:
        """Let workers take a paused queue's deliveries again; False when it was running."""
        site = self._site(self._engine_for_calls())
        return await self._set_paused_on(site, queue, False, reason, actor)

    # --- sync twins ----------------------------------------------------------------------------

    def get_job_sync(self, job_id: str) -> JobRecord | None:
        """``get_job`` for code with no event loop."""
        return self._alone("App.get_job_sync", lambda site: site.store.get_job(job_id))

    def cancel_sync(self, job_id: str, *, reason: str, actor: str | None = None) -> ActionOutcome:
        """``cancel`` for code with no event loop."""
        who = actor or app_actor()
        return self._alone(
            "App.cancel_sync", lambda site: Operator(site).cancel(job_id, actor=who, reason=reason)
        )

    def replay_sync(
        self, job_id: str, *, reason: str = "replayed by the application", actor: str | None = None
    ) -> ActionOutcome:
        """``replay`` for code with no event loop."""
        who = actor or app_actor()
        return self._alone(
            "App.replay_sync", lambda site: Operator(site).replay(job_id, actor=who, reason=reason)
        )

    def resend_sync(
        self, job_id: str, *, reason: str = "resent by the application", actor: str | None = None
    ) -> ActionOutcome:
        """``resend`` for code with no event loop."""
        who = actor or app_actor()
        return self._alone(
            "App.resend_sync", lambda site: Operator(site).resend(job_id, actor=who, reason=reason)
        )

    def list_jobs_sync(
        self,
        *,
        state: JobState | str | None = None,
        type: str | None = None,
        account: str | None = None,
        queue: str | None = None,
        reason: str | None = None,
        limit: int = 100,
    ) -> list[JobRecord]:
        """``list_jobs`` for code with no event loop, as a list."""
        return self._alone(
            "App.list_jobs_sync",
            lambda site: _find(site.store, state, type, account, queue, reason, limit),
        )

    def pause_queue_sync(self, queue: str, *, reason: str, actor: str | None = None) -> bool:
        """``pause_queue`` for code with no event loop."""
        return self._alone(
            "App.pause_queue_sync",
            lambda site: self._set_paused_on(site, queue, True, reason, actor),
        )

    def resume_queue_sync(self, queue: str, *, reason: str, actor: str | None = None) -> bool:
        """``resume_queue`` for code with no event loop."""
        return self._alone(
            "App.resume_queue_sync",
            lambda site: self._set_paused_on(site, queue, False, reason, actor),
        )

    async def _set_paused_on(
        self, site: _Site, queue: str, paused: bool, reason: str, actor: str | None
    ) -> bool:
        if not reason.strip():
            raise ConfigError("pause_queue" if paused else "resume_queue", "reason is empty")
        return await set_queue_paused(
            site,
            queue,
            paused,
            actor=actor or app_actor(),
            reason=reason.strip(),
            queues=self.queues,
        )

    def _alone(self, where: str, call: Callable[[_Site], Awaitable[T]]) -> T:
        """``call`` on a loop and an engine of its own (the app's engine is bound to the loop
        that made it); ``ConfigError`` inside a running loop."""

        async def run() -> T:
            from jobrelay.database_files import require_database
            from jobrelay.storage.engine import create_engine

            require_database(self.settings.database_url)
            engine = create_engine(self.settings.database_url)
            try:
                return await call(self._site(engine))
            finally:
                await engine.dispose()

        return run_sync(where, run())


async def _find(
    store: StorePort,
    state: JobState | str | None,
    job_type: str | None,
    account: str | None,
    queue: str | None,
    reason: str | None,
    limit: int,
) -> list[JobRecord]:
    if limit < 1:
        raise ConfigError("list_jobs", "limit must be at least 1")
    try:
        wanted = JobState(state) if state is not None else None
    except ValueError:
        names = ", ".join(s.value for s in JobState)
        raise ConfigError("list_jobs", f"no state {state!r} (states: {names})") from None
    return await AdminQueries(store).find_jobs(
        state=wanted,
        reason=reason,
        job_type=job_type,
        account_id=account,
        queue=queue,
        limit=limit,
    )


def run_sync(where: str, work: Coroutine[Any, Any, T]) -> T:
    """``work`` on a loop of its own; ``ConfigError`` (and ``work`` closed) when called inside a
    running event loop, where the async twin is the one to await."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(work)
    work.close()
    raise ConfigError(where, "called inside a running event loop: await the async twin instead")
