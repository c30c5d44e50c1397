"""The installation's one row: the secret job ids are keyed with, and its rotation.

Migration 0011 makes the row with a fresh ``secrets.token_hex(32)`` (and, on a database that
already had jobs, the legacy UUIDv5 scheme as the previous one for 7 days). A process reads
it once and keeps it: ``IdKeyCache`` reads it again at most every ``REFRESH_SECONDS``, on the
first id derived after that, so deriving an id costs no statement, and a rotation reaches
every running process within that time without a restart. ``JOBRELAY_ID_SECRET``, when set,
replaces the row: nothing is read, and every process of the installation must set the same
value.

A rotation (``jobrelay db rotate-id-secret``) makes a new secret and keeps the one before as
the previous until a given time. While it counts, accepting a request first looks for the
job under the id the previous secret gives (``NewJob.previous_job_id``, ``drivers/new_job.py``), so
a retry of a request accepted before the rotation finds its job. There is one previous
secret: rotating again inside a window drops the older one.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.ext.asyncio import AsyncEngine

from jobrelay.domain.ids import IdKeys, IdSecret, Legacy
from jobrelay.errors import ConfigError
from jobrelay.storage.engine import read_tx, write_tx
from jobrelay.storage.steps import Steps, run_async
from jobrelay.storage.tables import installation

# How long a process uses the row it read before it reads it again.
REFRESH_SECONDS = 60.0
DEFAULT_KEEP_PREVIOUS = timedelta(hours=168)
_ROW = installation.c.id == 1
_READ = select(
    installation.c.id_secret, installation.c.previous_id_secret, installation.c.previous_until
).where(_ROW)


@dataclass(frozen=True)
class StoredKeys:
    """The row as read: the current secret, the previous one and when it stops counting."""

    current: bytes = field(repr=False)
    previous: IdSecret | None = field(repr=False)
    previous_until: datetime | None

    def at(self, now: datetime) -> IdKeys:
        """The keys in force at ``now``: the previous one only before ``previous_until``."""
        live = self.previous_until is not None and now < self.previous_until
        return IdKeys(self.current, self.previous if live else None)


@dataclass(frozen=True)
class Rotation:
    rotated_at: datetime
    previous_until: datetime


def secret_bytes(stored: str) -> IdSecret:
    """A stored secret (hex) as bytes, or the legacy scheme's marker as ``Legacy.UUID5``."""
    if stored == Legacy.UUID5.value:
        return Legacy.UUID5
    return bytes.fromhex(stored)


def _missing() -> ConfigError:
    return ConfigError(
        "JOBRELAY_DATABASE_URL",
        "the installation's id secret is missing (table installation is empty): "
        "run `jobrelay db upgrade` as the schema's owner",
    )


def _stored_keys(row: Any) -> StoredKeys:
    if row is None:
        raise _missing()
    previous = row.previous_id_secret
    return StoredKeys(
        current=bytes.fromhex(row.id_secret),
        previous=None if previous is None else secret_bytes(previous),
        previous_until=row.previous_until,
    )


class IdKeyCache:
    """The installation's keys as one process knows them, for one database."""

    def __init__(
        self,
        override: bytes | None = None,
        *,
        refresh_seconds: float = REFRESH_SECONDS,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.override = override
        self._refresh = refresh_seconds
        self._monotonic = monotonic
        self._stored: StoredKeys | None = None
        self._read_at = 0.0

    def cached(self, now: datetime) -> IdKeys | None:
        """The keys at ``now`` without a statement, or None when the row must be read."""
        if self.override is not None:
            return IdKeys(self.override)
        if self._stored is None or self._monotonic() - self._read_at >= self._refresh:
            return None
        return self._stored.at(now)

    def steps(self, now: datetime) -> Steps[IdKeys]:
        """The keys at ``now``: no statement while the cache holds, else one read of the row
        (on whatever connection runs the steps, inside its transaction)."""
        keys = self.cached(now)
        if keys is not None:
            return keys
        stored = _stored_keys((yield (_READ, None)).first())
        self.remember(stored)
        return stored.at(now)

    def remember(self, stored: StoredKeys) -> None:
        self._stored, self._read_at = stored, self._monotonic()


class Installation:
    """The store's side of the row: the keys (cached) and the rotation."""

    def __init__(self, engine: AsyncEngine, cache: IdKeyCache) -> None:
        self.engine = engine
        self.cache = cache

    async def id_keys(self, now: datetime) -> IdKeys:
        keys = self.cache.cached(now)
        if keys is None:
            async with read_tx(self.engine, "installation") as conn:
                keys = await run_async(conn, self.cache.steps(now))
        return keys

    async def rotate(self, now: datetime, keep_previous: timedelta, actor: str) -> Rotation:
        """A new current secret; the one before stays the previous until ``now +
        keep_previous``. One statement: the old secret moves in SQL, never through here."""
        until = now + keep_previous
        async with write_tx(self.engine, "installation") as conn:
            done = await conn.execute(
                update(installation)
                .where(_ROW)
                .values(
                    id_secret=secrets.token_hex(32),
                    previous_id_secret=installation.c.id_secret,
                    previous_until=until,
                    rotated_at=now,
                    rotated_by=actor,
                )
            )
            if done.rowcount != 1:
                raise _missing()
            stored = _stored_keys((await conn.execute(_READ)).first())
        self.cache.remember(stored)
        return Rotation(now, until)
