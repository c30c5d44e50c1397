"""Reconciler leadership: at most one reconciler leads at a time.

On PostgreSQL a session advisory lock held on a dedicated connection for as long as it leads
(closing that session releases the lock, so a dead leader frees it); on SQLite the one
process using the file always leads. Leadership only saves work: every repair is guarded.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from jobrelay.runtime.wiring import Runtime
from jobrelay.storage.capabilities import session_dsn

log = logging.getLogger("jobrelay.reconcile")

# "jrrecncl" as a big-endian 64-bit integer: the advisory lock only reconcilers take.
LOCK_KEY = int.from_bytes(b"jrrecncl", "big")


class PassAbandoned(Exception):
    """A reconciler pass stopped between two steps: its leadership was lost since it began."""


class Leadership:
    """At most one reconciler leads: a session advisory lock on PostgreSQL, held on a
    dedicated connection for as long as it leads; always the leader on SQLite."""

    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
        self.enabled = rt.store.capabilities.leads
        self.dsn = session_dsn(rt.engine)
        self._conn: Any = None
        # Counts the times the lock was taken: a pass that began under another term began
        # before the leadership was lost (a failover took the lock's session with the old
        # primary) and must not act on what it read then (``Reconciler.run_once``).
        self.term = 0

    @property
    def leading(self) -> bool:
        return not self.enabled or self._conn is not None

    async def __aenter__(self) -> Leadership:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.release()

    async def check(self) -> bool:
        """Still (or now) the leader? Never raises: a failure means not leading."""
        if not self.enabled:
            self.rt.metrics.reconcile_leader.set(1)
            return True
        if self._conn is not None:
            try:
                async with asyncio.timeout(5):
                    await self._conn.fetchval("SELECT 1")
                return True
            except Exception as exc:
                log.warning(
                    "reconciler leadership lost: %s", exc, extra={"event": "reconcile_leader_lost"}
                )
                await self.release()
        await self._try_acquire()
        return self._conn is not None

    async def hold(self, term: int) -> None:
        """``PassAbandoned`` unless this process still leads under ``term``: a pass whose
        leadership was lost, or lost and taken again (a failover took the lock's session with
        the old primary), must not act on what it read before."""
        if not await self.check() or self.term != term:
            raise PassAbandoned("the reconciler's leadership was lost during its pass")

    async def _try_acquire(self) -> None:
        import asyncpg

        conn = None
        try:
            async with asyncio.timeout(10):
                conn = await asyncpg.connect(self.dsn)
                got = await conn.fetchval("SELECT pg_try_advisory_lock($1)", LOCK_KEY)
        except Exception as exc:
            log.warning(
                "reconciler leadership check failed: %s",
                type(exc).__name__,
                extra={"event": "reconcile_leader_failed"},
            )
            got = False
        if got:
            self._conn = conn
            self.term += 1
            self.rt.metrics.reconcile_leader.set(1)
            log.info("reconciler leading", extra={"event": "reconcile_leader"})
        elif conn is not None:
            with contextlib.suppress(Exception):
                await conn.close()

    async def release(self) -> None:
        conn, self._conn = self._conn, None
        self.rt.metrics.reconcile_leader.set(0)
        if conn is not None:
            # Closing the session releases the advisory lock.
            with contextlib.suppress(Exception):
                await asyncio.shield(conn.close())
