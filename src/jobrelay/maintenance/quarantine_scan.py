"""Read the quarantine queue without taking anything out of it, for the reconciler.

The database is the source of truth for why a job is quarantined; the quarantine queue is
the broker-side surface. This module lists which jobs the messages there belong to, so the
reconciler can report copies whose job the database does not have as quarantined (a message
dead-lettered by the broker's delivery limit, or a stale copy of a job since replayed).

- Local transport: a plain read of the queue table.
- RabbitMQ: ``basic.get`` without ack on a channel of its own, which is then closed, so the
  broker puts every message back. That counts as a return on a quorum queue (its
  ``x-delivery-count`` goes up), so it is only done on demand (``jobrelay reconcile``), never
  by the periodic reconciler, and never for more than ``limit`` messages.

This reads; it never acks, rejects or publishes. The message body is parsed only for its
``jobId`` and never logged.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

from jobrelay.errors import TransportError
from jobrelay.runtime.wiring import Runtime
from jobrelay.storage.admin import AdminQueries
from jobrelay.storage.local_queue import QUARANTINE as LOCAL_QUARANTINE
from jobrelay.storage.local_queue import REASON_HEADER as LOCAL_REASON_HEADER
from jobrelay.transport.topology import QUARANTINE_QUEUE

JOB_ID_HEADER = "x-jobrelay-job-id"
_TIMEOUT = 10.0


@dataclass(frozen=True)
class DeadLetter:
    job_id: str | None  # None: the message names no job we can read
    reason: str | None  # why the broker dead-lettered it: rejected, delivery_limit, …


async def scan_quarantine(rt: Runtime, limit: int) -> list[DeadLetter]:
    if rt.settings.uses_local_broker:
        messages = await AdminQueries(rt.store).local_queue_messages(LOCAL_QUARANTINE, limit)
        return [
            DeadLetter(job_id_of(m.headers, m.body), text_of(m.headers.get(LOCAL_REASON_HEADER)))
            for m in messages
        ]
    return await browse_rabbitmq(rt.settings.broker_url, limit)


@contextlib.asynccontextmanager
async def quarantine_channel(url: str, action: str) -> AsyncIterator[tuple[Any, Any]]:
    """A channel of its own on a node that answers, and the quarantine queue on it (passive).

    Closing the channel, on the way out, gives every message taken and not acked back to the
    queue. Broker errors become ``TransportError("cannot <action> jobrelay.quarantine: …")``.
    """
    from jobrelay.transport.rabbit_nodes import AMQP_ERRORS, connect_first, split_broker_urls

    try:
        connection = await connect_first(split_broker_urls(url))  # a node that answers
    except TransportError as exc:
        raise TransportError(f"cannot {action} {QUARANTINE_QUEUE}: {exc}") from exc
    try:
        channel = await connection.channel(publisher_confirms=False)
        try:
            yield channel, await channel.declare_queue(QUARANTINE_QUEUE, passive=True)
        finally:
            with contextlib.suppress(*AMQP_ERRORS):
                await channel.close()
    except AMQP_ERRORS as exc:
        raise TransportError(f"cannot {action} {QUARANTINE_QUEUE}: {type(exc).__name__}") from exc
    finally:
        with contextlib.suppress(*AMQP_ERRORS):
            await connection.close()


async def take_all(queue: Any, limit: int) -> list[Any]:
    """Up to ``limit`` of the messages waiting, unacked (``basic.get``)."""
    waiting = int(queue.declaration_result.message_count or 0)
    taken = []
    for _ in range(min(waiting, limit)):
        message = await queue.get(no_ack=False, fail=False, timeout=_TIMEOUT)
        if message is None:
            break
        taken.append(message)
    return taken


async def browse_rabbitmq(url: str, limit: int) -> list[DeadLetter]:
    async with quarantine_channel(url, "read") as (_, queue):
        return [
            DeadLetter(job_id_of(dict(m.headers or {}), m.body), death_reason(m.headers or {}))
            for m in await take_all(queue, limit)
        ]


def job_id_of(headers: Mapping[str, object], body: bytes) -> str | None:
    from_header = text_of(headers.get(JOB_ID_HEADER))
    if from_header:
        return from_header
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, ValueError):
        return None
    job_id = data.get("jobId") if isinstance(data, dict) else None
    return job_id if isinstance(job_id, str) and len(job_id) == 36 else None


def death_reason(headers: Mapping[str, object]) -> str | None:
    deaths = headers.get("x-death")
    if isinstance(deaths, list) and deaths and isinstance(deaths[0], Mapping):
        return text_of(deaths[0].get("reason"))
    return text_of(headers.get("x-first-death-reason"))


def text_of(value: object) -> str | None:
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return value if isinstance(value, str) else None
