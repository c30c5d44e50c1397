"""Retention as a role: the reconciler leader prunes now and then, ``jobrelay prune`` on demand.

The SQL is ``storage.retention``; this module decides *when* (at most once a minute, or at
once again while the last prune reached its cap, so a backlog drains in bounded steps), and
reports what was deleted: one structured log line (``event: prune``) and the
``jobrelay_pruned_total`` counter per table. Only the leader prunes, so two relays never
compete for the same victims (SKIP LOCKED would keep that safe, leadership saves the work).
"""

from __future__ import annotations

import logging
import time

from jobrelay.runtime.wiring import Runtime
from jobrelay.storage.retention import BATCH, MAX_ROWS, PruneCounts, Retention
from jobrelay.storage.vacuum import analyze_stale, autovacuum_on, may_vacuum, vacuum_hot_tables

log = logging.getLogger("jobrelay.retention")

PRUNE_EVERY_SECONDS = 60.0


class Pruner:
    def __init__(
        self,
        rt: Runtime,
        *,
        batch: int = BATCH,
        max_rows: int = MAX_ROWS,
        every: float = PRUNE_EVERY_SECONDS,
    ) -> None:
        self.rt = rt
        self.retention = Retention(
            rt.store,
            rt.results,
            keep_results=rt.settings.retention_keep_results,
            batch=batch,
            max_rows=max_rows,
        )
        self.every = every
        self._last: float | None = None  # monotonic time of the last prune
        self._capped = False
        self._autovacuum: bool | None = None  # the server's setting, read once
        self._may_analyze: bool | None = None  # this role owns the tables: read once

    def due(self) -> bool:
        if self._last is None or self._capped:
            return True
        return time.monotonic() - self._last >= self.every

    async def run_if_due(self) -> PruneCounts | None:
        """Prune unless the last prune was less than ``every`` seconds ago (and finished);
        then vacuum jobrelay's tables if the server does not (``storage/vacuum.py``)."""
        if not self.due():
            return None
        counts = await self.run_once()
        await self.vacuum_if_needed()
        return counts

    async def vacuum_if_needed(self) -> bool:
        """VACUUM the hot tables when the server's autovacuum is off; whether it did."""
        if not self.rt.settings.self_vacuum:
            return False
        if self._autovacuum is None:
            self._autovacuum = await autovacuum_on(self.rt.engine)
            if not self._autovacuum and not await may_vacuum(self.rt.engine):
                self._autovacuum = True  # nothing this role can do: say so once, then stop
                log.warning(
                    "autovacuum is off on this PostgreSQL server and this role does not own "
                    "jobrelay's tables, so it cannot vacuum them: turn autovacuum on, or "
                    "VACUUM them as the owner (docs/how-to/retention.md)",
                    extra={"event": "autovacuum_off_not_owner"},
                )
            elif not self._autovacuum:
                log.warning(
                    "autovacuum is off on this PostgreSQL server: the reconciler leader "
                    "vacuums jobrelay's tables itself after each prune; turn autovacuum on "
                    "(docs/how-to/retention.md)",
                    extra={"event": "autovacuum_off"},
                )
        if self._autovacuum:
            return False
        started = time.monotonic()
        tables = await vacuum_hot_tables(self.rt.engine)
        log.info(
            "vacuumed %s in %.2fs",
            ", ".join(tables),
            time.monotonic() - started,
            extra={"event": "vacuumed", "tables": tables},
        )
        return True

    async def analyze_if_stale(self) -> list[str]:
        """``ANALYZE`` the hot tables whose statistics say they are far smaller than they are
        (``storage/vacuum.py``), whatever the server's autovacuum: its own ``ANALYZE`` comes
        a minute or more after a burst, and a queue's statements planned for an empty table
        meanwhile read every row per claim. Checked by the leader every few seconds."""
        if not self.rt.settings.self_vacuum:
            return []
        if self._may_analyze is None:
            self._may_analyze = await may_vacuum(self.rt.engine)
        if not self._may_analyze:
            return []
        tables = await analyze_stale(self.rt.engine)
        if tables:
            log.info(
                "analyzed %s: their statistics said far fewer rows than they hold",
                ", ".join(tables),
                extra={"event": "analyzed", "tables": tables},
            )
        return tables

    async def run_once(self, *, days: float | None = None, dry_run: bool = False) -> PruneCounts:
        """Prune what is older than ``days`` (default: ``JOBRELAY_RETENTION_DAYS``)."""
        days = self.rt.settings.retention_days if days is None else days
        cutoff = await self.retention.cutoff(days)
        counts = await self.retention.prune(cutoff, dry_run=dry_run)
        if not dry_run:
            self._last, self._capped = time.monotonic(), counts.capped
            for table, n in counts.tables().items():
                if n:
                    self.rt.metrics.pruned.labels(table=table).inc(n)
        if counts.total or counts.results_failed or dry_run:
            log.info(
                "prune%s: %s",
                " (dry run)" if dry_run else "",
                ", ".join(f"{n} {table}" for table, n in counts.tables().items()),
                extra={
                    "event": "prune",
                    "dryRun": dry_run,
                    "cutoff": cutoff.isoformat(),
                    "capped": counts.capped,
                    "resultsFailed": counts.results_failed,
                    **counts.tables(),
                },
            )
        return counts
