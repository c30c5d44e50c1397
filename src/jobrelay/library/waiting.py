"""Waiting for a job to end (``App.wait``, ``App.result``), woken by the commit that ends it.

One watcher per app and event loop serves every waiter: the jobs waited on, read in one query
whenever something may have ended, each waiter's future resolved once its job is terminal.
What wakes it:

- on PostgreSQL, a ``LISTEN`` on ``jobrelay_done``: every transition that ends a job sends one
  ``NOTIFY`` at its commit (a completion batch, one for all of its jobs; a quarantine, a
  cancel, the reconciler's takeover; ``storage.records.DONE_CHANNEL``);
- on SQLite, the file's ``PRAGMA data_version``, which changes when another connection
  commits (the worker in this process or in any other): a read of a counter, not of the jobs.

A waiter registers before the watcher reads, and the watcher listens before its first read,
so an end committed in between is seen by that read; a ``NOTIFY`` lost while the listening
connection was down is covered by the fallback read every ``FALLBACK_SECONDS``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from jobrelay.errors import ConfigError, JobNotFound
from jobrelay.storage.capabilities import capabilities_of, session_dsn
from jobrelay.storage.engine import READ_ONLY_OPTION, read_only
from jobrelay.storage.records import DONE_CHANNEL, JobRecord, job_record
from jobrelay.storage.tables import jobs

log = logging.getLogger("jobrelay.wait")

# A re-read when no notification came: a lost NOTIFY (the listener reconnecting), never the
# path an end normally takes.
FALLBACK_SECONDS = 5.0
# SQLite: how often the watcher reads ``data_version`` (a counter, no table read).
DATA_VERSION_SECONDS = 0.05


class Watcher:
    """The jobs waited on in one app and event loop, and the one task that watches them."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine
        self._waiting: dict[str, list[asyncio.Future[JobRecord]]] = {}
        self._changed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def wait(self, job_id: str, timeout: float | None) -> JobRecord:
        future: asyncio.Future[JobRecord] = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(job_id, []).append(future)
        self._changed.set()  # a read for this waiter, after it registered
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._watch())
        try:
            async with asyncio.timeout(timeout):
                return await asyncio.shield(future)
        finally:
            waiters = self._waiting.get(job_id, [])
            if future in waiters:
                waiters.remove(future)
            if not waiters:
                self._waiting.pop(job_id, None)
            future.cancel()
            if not self._waiting:
                self._changed.set()  # the watcher ends now, not at its next fallback read

    async def close(self) -> None:
        """End the watcher (its listener, its connection) before the engine goes; a waiter
        still waiting is told (``ConfigError``), never left waiting for a watcher gone."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._fail(ConfigError("App.wait", "the app was closed while this wait was waiting"))

    def _fail(self, exc: BaseException) -> None:
        for futures in list(self._waiting.values()):
            for future in futures:
                if not future.done():
                    future.set_exception(exc)

    async def _watch(self) -> None:
        try:
            await self._watch_once()
        finally:
            # A waiter that came while this task was ending (closing its listener) would
            # otherwise wait for a task that is gone. Else the task is let go (a done task
            # holds its loop).
            if self._task is not None and any(
                not f.done() for fs in self._waiting.values() for f in fs
            ):
                self._task = asyncio.create_task(self._watch())
            elif self._task is asyncio.current_task():
                self._task = None

    async def _watch_once(self) -> None:
        try:
            async with self._wakes() as lost:
                # Listening now: whatever ended before is read here, the rest notified.
                self._changed.clear()
                await self._read()
                while self._waiting and not lost.is_set():
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(FALLBACK_SECONDS):
                            await self._changed.wait()
                    self._changed.clear()
                    await self._read()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the database is unreachable: every waiter is told
            self._fail(exc)

    async def _read(self) -> None:
        ids = list(self._waiting)
        if not ids:
            return
        # A read transaction: on SQLite DEFERRED, so it never takes (or waits for) the lock
        # the worker and the relay write under.
        async with read_only(self.engine) as conn:
            rows = (await conn.execute(select(jobs).where(jobs.c.id.in_(ids)))).all()
        found = {row.id: job_record(row) for row in rows}
        for job_id in ids:
            job = found.get(job_id)
            for future in self._waiting.get(job_id, []):
                if future.done():
                    continue
                if job is None:
                    future.set_exception(JobNotFound(f"no job {job_id}"))
                elif job.state.is_terminal:
                    future.set_result(job)

    @contextlib.asynccontextmanager
    async def _wakes(self) -> AsyncIterator[asyncio.Event]:
        """Whatever tells this watcher that a job may have ended, for as long as it runs; the
        event it yields is set when that stopped (the listening connection was lost), and the
        watcher then starts again on a new one (``_watch``)."""
        lost = asyncio.Event()
        if capabilities_of(self.engine).listens:
            import asyncpg

            conn = await asyncpg.connect(session_dsn(self.engine))

            def dropped(*_: Any) -> None:
                lost.set()
                self._changed.set()

            try:
                conn.add_termination_listener(dropped)
                await conn.add_listener(DONE_CHANNEL, self._notified)
                yield lost
            finally:
                with contextlib.suppress(Exception):
                    await asyncio.shield(conn.close())
            return
        # The first reading is taken before the watcher's first read of the jobs: a commit
        # after that read changes the version from it.
        async with self.engine.connect() as conn:
            await conn.execution_options(**{READ_ONLY_OPTION: True})
            seen = await self._version(conn)
            poller = asyncio.create_task(self._data_version(conn, seen))
            try:
                yield lost
            finally:
                poller.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await poller

    def _notified(self, *_: Any) -> None:
        self._changed.set()

    @staticmethod
    async def _version(conn: AsyncConnection) -> Any:
        # Read outside any transaction kept open: the counter of the file as this
        # connection last saw it, which another connection's commit changes.
        version = (await conn.exec_driver_sql("PRAGMA data_version")).scalar()
        await conn.rollback()
        return version

    async def _data_version(self, conn: AsyncConnection, seen: Any) -> None:
        while True:
            await asyncio.sleep(DATA_VERSION_SECONDS)
            version = await self._version(conn)
            if version != seen:
                seen = version
                self._changed.set()


__all__ = ["DATA_VERSION_SECONDS", "FALLBACK_SECONDS", "Watcher"]
