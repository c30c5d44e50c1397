"""The job body every peer runs, and the marker a worker process leaves when it is ready.

The body is what a user of a plain task queue writes to keep a status row the way jobrelay
keeps its ``jobs`` row: a claim (``running``, attempt + 1) committed on its own, then the
finish (``succeeded`` and a result key) committed on its own. Both go through a connection
pool per worker process (``concurrency`` connections: one per thread or concurrent job),
opened once per process, never a connection per task. Every connection runs with
``synchronous_commit=on``, so a commit is on disk before the task goes on.

Configuration comes from the environment, because the library's own worker CLI imports the
peer module: ``PEER_DSN``, ``PEER_CONCURRENCY``, and ``PEER_READY_DIR`` (set only for worker
processes, where each writes ``<pid>`` holding ``time.time()`` when the library says it is
ready; ``drain.py`` times from the first such marker).
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from pathlib import Path

import psycopg
import psycopg_pool

# ``claimed_at`` keeps the first claim's time: the drain's window is read from the database
# (first claim -> last finish), as jobrelay's is from its events, not from a poll.
CLAIM = (
    "UPDATE peer_status SET state = 'running', attempt = attempt + 1, updated_at = now(),"
    " claimed_at = coalesce(claimed_at, now()) WHERE id = %s"
)
FINISH = (
    "UPDATE peer_status SET state = 'succeeded', result_key = %s, updated_at = now() WHERE id = %s"
)
CONNECTION_KWARGS = {"autocommit": True, "options": "-c synchronous_commit=on"}
POOL_TIMEOUT = 30.0


def dsn() -> str:
    return os.environ["PEER_DSN"]


def concurrency() -> int:
    return int(os.environ.get("PEER_CONCURRENCY", "8"))


def in_worker() -> bool:
    return bool(os.environ.get("PEER_READY_DIR"))


def result_key(job_id: str) -> str:
    return f"results/{job_id}.json"


def mark_ready() -> None:
    """Leave this process's ready marker (written whole, then renamed: never read half)."""
    ready_dir = Path(os.environ["PEER_READY_DIR"])
    partial = ready_dir / f".{os.getpid()}"
    partial.write_text(repr(time.time()))
    partial.rename(ready_dir / str(os.getpid()))


class UnknownJob(Exception):
    """The status row is missing: the peer delivered a job the run never created."""


class SyncBody:
    """The body for thread-pool workers (Dramatiq, Celery): one pool per process.

    Created lazily and keyed by pid, because Dramatiq forks its worker processes from a
    parent that imported this module too; a pool must never cross a fork.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pool: psycopg_pool.ConnectionPool | None = None
        self._pid = 0

    def pool(self) -> psycopg_pool.ConnectionPool:
        with self._lock:
            if self._pool is None or self._pid != os.getpid():
                size = concurrency()
                pool = psycopg_pool.ConnectionPool(
                    dsn(),
                    min_size=size,
                    max_size=size,
                    kwargs=CONNECTION_KWARGS,
                    open=False,
                    timeout=POOL_TIMEOUT,
                )
                pool.open(wait=True, timeout=POOL_TIMEOUT)
                self._pool, self._pid = pool, os.getpid()
            return self._pool

    def run(self, job_id: str) -> None:
        with self.pool().connection() as conn:
            if conn.execute(CLAIM, (job_id,)).rowcount != 1:
                raise UnknownJob(job_id)
            conn.execute(FINISH, (result_key(job_id), job_id))

    def close(self) -> None:
        with self._lock:
            if self._pool is not None and self._pid == os.getpid():
                self._pool.close()
            self._pool = None


class AsyncBody:
    """The same body for an asyncio worker (Procrastinate): one async pool per process."""

    def __init__(self) -> None:
        self._pool: psycopg_pool.AsyncConnectionPool | None = None
        self._opening = asyncio.Lock()

    async def open(self) -> psycopg_pool.AsyncConnectionPool:
        async with self._opening:
            if self._pool is None:
                size = concurrency()
                pool = psycopg_pool.AsyncConnectionPool(
                    dsn(),
                    min_size=size,
                    max_size=size,
                    kwargs=CONNECTION_KWARGS,
                    open=False,
                    timeout=POOL_TIMEOUT,
                )
                await pool.open(wait=True, timeout=POOL_TIMEOUT)
                self._pool = pool
            return self._pool

    async def run(self, job_id: str) -> None:
        pool = self._pool or await self.open()
        async with pool.connection() as conn:
            if (await conn.execute(CLAIM, (job_id,))).rowcount != 1:
                raise UnknownJob(job_id)
            await conn.execute(FINISH, (result_key(job_id), job_id))

    async def close(self) -> None:
        if self._pool is not None:
            await self._pool.close()
            self._pool = None


def connect() -> psycopg.Connection[tuple[object, ...]]:
    """The harness's own connection (set-up and polling), with the same settings."""
    return psycopg.connect(dsn(), autocommit=True, options="-c synchronous_commit=on")
