"""The local transport's claim and ack on SQLite: each a transaction of a few statements over
the batch as ONE bound JSON array (``json_each``), the same text on the held connection and
through SQLAlchemy (``sqlite_conn.in_transaction``).

Through SQLAlchemy on aiosqlite, a claim of the queue's rows or a batch of acks was about a
dozen hand-offs between the event loop and the connection's thread, in the embedded
default's one process that also runs the API, the relay and the worker. A worker consuming
holds a ``sqlite3`` connection of its own for them (``SqliteHot``), as the job store's driver
does for the job's claims and completions: one hand-off per transaction. The rules are
``storage.local_queue``'s (whose portable statements PostgreSQL runs): every settle is fenced
on (id, consumer, delivery count), times come from the caller's clock, and under
``BEGIN IMMEDIATE`` nothing writes between the read of the free rows and their update.
"""

from __future__ import annotations

import contextlib
import logging
import sqlite3
from collections.abc import AsyncIterator, Mapping, Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import JSON, Column, Integer, Text, bindparam, text
from sqlalchemy.ext.asyncio import AsyncEngine

from jobrelay import fastjson
from jobrelay.domain.messages import dead_letter_reason, peek_job_id
from jobrelay.errors import StoreDataError
from jobrelay.storage.drivers import sqlite_statements as sql
from jobrelay.storage.drivers.sqlite_conn import (
    DIALECT,
    Execute,
    SqliteHot,
    Statement,
    in_transaction,
)
from jobrelay.storage.local_queue import QUARANTINE, REASON_HEADER, Claimed, ClaimResult
from jobrelay.storage.records import jsonable
from jobrelay.storage.tables import UTCDateTime

log = logging.getLogger("jobrelay.transport.local")

# New messages: (queue, body, headers, available_at as stored) each; a row sent straight to
# the quarantine queue is dead-lettered as it is written.
_PUBLISH = Statement(
    text(
        """
INSERT INTO local_messages
    (queue, body, headers, available_at, delivery_count, created_at, dead_lettered_at)
SELECT json_extract(value, '$[0]'), json_extract(value, '$[1]'), json_extract(value, '$[2]'),
       json_extract(value, '$[3]'), 0, :now,
       CASE WHEN json_extract(value, '$[0]') = :quarantine THEN :now END
FROM json_each(:rows)
"""
    ).bindparams(bindparam("now", type_=UTCDateTime()))
)
# A time as SQLAlchemy stores it on SQLite (the column type's own bind processor).
_STORED_TIME = UTCDateTime().dialect_impl(DIALECT).bind_processor(DIALECT)

# The visible rows of one queue, oldest first (``ix_local_messages_ready``).
_FREE = Statement(
    text(
        """
SELECT id, body, headers, delivery_count FROM local_messages
WHERE queue = :queue AND available_at <= :now
  AND (invisible_until IS NULL OR invisible_until <= :now)
ORDER BY available_at, id
LIMIT :limit
"""
    )
    .bindparams(bindparam("now", type_=UTCDateTime()))
    .columns(
        Column("id", Integer()),
        Column("body", Text()),
        Column("headers", JSON()),
        Column("delivery_count", Integer()),
    )
)

# The rows taken: each one's count bumped, which is its new claim's fence.
_TAKE = Statement(
    text(
        """
UPDATE local_messages
SET consumer = :consumer, invisible_until = :until, delivery_count = delivery_count + 1
WHERE id IN (SELECT value FROM json_each(:ids))
"""
    ).bindparams(bindparam("until", type_=UTCDateTime()))
)

# Into the quarantine queue, body kept, claim dropped: a row past the delivery limit as it
# is (``_SET_ASIDE``), or a reject while its claim still holds the row (``_REJECT``).
_TO_QUARANTINE = """
UPDATE local_messages
SET queue = :quarantine, consumer = NULL, invisible_until = NULL, headers = :headers,
    dead_lettered_at = :now
WHERE id = :id"""
_QUARANTINE_BINDS = (bindparam("now", type_=UTCDateTime()), bindparam("headers", type_=JSON()))
_SET_ASIDE = Statement(text(_TO_QUARANTINE).bindparams(*_QUARANTINE_BINDS))
_REJECT = Statement(
    text(
        _TO_QUARANTINE
        + """
  AND queue != :quarantine AND consumer = :consumer AND delivery_count = :fence
RETURNING id
"""
    )
    .bindparams(*_QUARANTINE_BINDS)
    .columns(Column("id", Integer()))
)

# The acks: each row deleted only while its claim (consumer, fence) still holds it; the
# batch's ids drive the lookup (the primary key), its (id, fence) pairs are the guard.
_ACK = Statement(
    text(
        """
DELETE FROM local_messages
WHERE id IN (SELECT json_extract(value, '$[0]') FROM json_each(:acks))
  AND (id, delivery_count) IN (
      SELECT json_extract(value, '$[0]'), json_extract(value, '$[1]') FROM json_each(:acks)
  )
  AND queue != :quarantine AND consumer = :consumer
RETURNING id
"""
    ).columns(Column("id", Integer()))
)


class SqliteQueue:
    """The local transport's claims and settles on SQLite (``drivers.open_queue_driver``),
    on the connection its consumers hold (``held``) while one does."""

    def __init__(self, engine: AsyncEngine) -> None:
        self._engine = engine
        self._hot = SqliteHot(engine)

    @contextlib.asynccontextmanager
    async def held(self) -> AsyncIterator[None]:
        """The connection, held for the block; one that cannot be opened is only slower:
        the same statements then go through SQLAlchemy (a consumer does not fail for it)."""
        holding = contextlib.AsyncExitStack()
        try:
            await holding.enter_async_context(self._hot.held())
        except (sqlite3.Error, OSError) as exc:
            log.warning(
                "local queue: no held SQLite connection, going through SQLAlchemy: %s",
                exc,
                extra={"event": "held_connection_failed"},
            )
        async with holding:
            yield

    async def publish(self, rows: Sequence[Mapping[str, Any]], now: datetime) -> None:
        """The messages (queue, body, headers, available_at) in one statement."""
        stored = _STORED_TIME
        assert stored is not None
        try:
            batch = fastjson.dumps(
                [
                    [r["queue"], r["body"], dict(r["headers"]), stored(r["available_at"])]
                    for r in rows
                ]
            )
        except (TypeError, ValueError) as exc:  # a header or a time SQLite cannot store
            raise StoreDataError(f"local queue publish write failed: {exc}") from exc
        params = {"rows": batch, "now": now, "quarantine": QUARANTINE}
        await in_transaction(
            self._engine, self._hot, lambda run: run(_PUBLISH, params), "local queue publish"
        )

    async def claim(self, **asked: Any) -> ClaimResult:
        return await in_transaction(
            self._engine, self._hot, lambda run: claim(run, **asked), "local queue claim"
        )

    async def settle(
        self, consumer: str, settles: Sequence[tuple[Claimed, bool]], now: datetime
    ) -> list[bool]:
        """The acks (one statement) and rejects asked for meanwhile, in one transaction."""
        acks = {claim.id: claim.fence for claim, reject in settles if not reject}

        def work(run: Execute) -> list[bool]:
            held = {c.id: reject_claimed(run, c, consumer, now) for c, reject in settles if reject}
            deleted = delete_claimed(run, consumer=consumer, claims=acks)
            return [held[c.id] if reject else c.id in deleted for c, reject in settles]

        return await in_transaction(self._engine, self._hot, work, "local queue settle")


def claim(
    execute: Execute,
    *,
    queue: str,
    consumer: str,
    now: datetime,
    invisible_until: datetime,
    limit: int,
    delivery_limit: int,
) -> ClaimResult:
    """``local_queue.claim_messages`` on SQLite: up to ``limit`` visible rows of ``queue``,
    those past the delivery limit quarantined instead (with a ``dead_lettered`` event on
    their job)."""
    rows = execute(_FREE, {"queue": queue, "now": now, "limit": limit})
    exhausted = [r for r in rows if r["delivery_count"] > delivery_limit]
    for row in exhausted:
        _dead_letter(execute, row, delivery_limit, now)
    fresh = [r for r in rows if r["delivery_count"] <= delivery_limit]
    if fresh:
        ids = fastjson.dumps([r["id"] for r in fresh])
        execute(_TAKE, {"ids": ids, "consumer": consumer, "until": invisible_until})
    claimed = [
        Claimed(
            id=r["id"],
            body=r["body"].encode(),
            headers=dict(r["headers"] or {}),
            delivery_count=r["delivery_count"],
            fence=r["delivery_count"] + 1,
        )
        for r in fresh
    ]
    return ClaimResult(claimed=claimed, quarantined=len(exhausted))


def delete_claimed(execute: Execute, *, consumer: str, claims: Mapping[int, int]) -> set[int]:
    """``local_queue.delete_many_claimed`` on SQLite: the acks, each fenced on its claim
    (id -> fence); the ids that were still held, and so deleted."""
    if not claims:
        return set()
    acks = fastjson.dumps([[message_id, fence] for message_id, fence in claims.items()])
    params = {"acks": acks, "consumer": consumer, "quarantine": QUARANTINE}
    return {row["id"] for row in execute(_ACK, params)}


def reject_claimed(execute: Execute, claim: Claimed, consumer: str, now: datetime) -> bool:
    """``local_queue.quarantine_claimed`` on SQLite: the reject, if the claim still holds
    the row; ``now`` is kept as ``dead_lettered_at``."""
    params = {
        "id": claim.id,
        "consumer": consumer,
        "fence": claim.fence,
        "quarantine": QUARANTINE,
        "headers": {**claim.headers, REASON_HEADER: "rejected"},
        "now": now,
    }
    return bool(execute(_REJECT, params))


def _dead_letter(execute: Execute, row: Mapping[str, Any], limit: int, now: datetime) -> None:
    deliveries = row["delivery_count"]
    headers = {**(row["headers"] or {}), REASON_HEADER: "delivery_limit"}
    execute(_SET_ASIDE, {"id": row["id"], "quarantine": QUARANTINE, "headers": headers, "now": now})
    job_id = peek_job_id(row["body"].encode())
    if job_id is None:
        return
    detail = {
        "reason": dead_letter_reason(deliveries, limit),
        "deliveries": deliveries,
        "limit": limit,
    }
    # The job's timeline says why its message stopped coming; an unknown job's is skipped.
    rows = fastjson.dumps([[job_id, jsonable(detail)]])
    execute(sql.EVENTS_RUN, {"reqs": rows, "at": now, "kind": "dead_lettered"})


__all__ = ["SqliteQueue", "claim", "delete_claimed", "reject_claimed"]
