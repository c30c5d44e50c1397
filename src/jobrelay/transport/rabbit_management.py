"""Where each queue lives in the cluster, read from RabbitMQ's management HTTP API.

AMQP cannot say which nodes hold a quorum queue or which of them leads it; the management
API can (``GET /api/queues/{vhost}/{name}``: ``leader``, ``members``, ``online``). It is an
operator's view only: nothing on the job path depends on it, and when the plugin is not
enabled the answer is a reason, not an error.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, unquote, urlsplit

import httpx

from jobrelay.transport.rabbit_nodes import split_broker_urls

_TIMEOUT = 5.0
MANAGEMENT_PORT = 15672


@dataclass(frozen=True)
class Placement:
    queue: str
    leader: str | None
    members: tuple[str, ...]
    online: tuple[str, ...]


def management_urls(broker_url: str, configured: str | None) -> list[str]:
    """The management endpoints to ask: the configured ones, else port 15672 of each node."""
    if configured:
        return [part.strip().rstrip("/") for part in configured.split(",") if part.strip()]
    out = []
    for url in split_broker_urls(broker_url):
        parts = urlsplit(url)
        scheme = "https" if parts.scheme == "amqps" else "http"
        out.append(f"{scheme}://{parts.hostname}:{MANAGEMENT_PORT}")
    return out


def _credentials(broker_url: str) -> tuple[str, str]:
    parts = urlsplit(split_broker_urls(broker_url)[0])
    return unquote(parts.username or "guest"), unquote(parts.password or "guest")


def _vhost(broker_url: str) -> str:
    path = urlsplit(split_broker_urls(broker_url)[0]).path
    return unquote(path[1:]) if len(path) > 1 else "/"


async def _queue_documents(
    broker_url: str, configured: str | None, queues: list[str], timeout: float
) -> tuple[list[dict[str, Any]] | None, list[str]]:
    """``GET /api/queues/{vhost}/{name}`` for each queue, from the first endpoint that
    answers them all; else None and why each endpoint did not."""
    vhost = quote(_vhost(broker_url), safe="")
    failures: list[str] = []
    async with httpx.AsyncClient(timeout=timeout, auth=_credentials(broker_url)) as client:
        for endpoint in management_urls(broker_url, configured):
            try:
                documents = []
                for name in queues:
                    answer = await client.get(
                        f"{endpoint}/api/queues/{vhost}/{quote(name, safe='')}"
                    )
                    answer.raise_for_status()
                    documents.append(dict(answer.json()))
                return documents, failures
            except (httpx.HTTPError, ValueError, TypeError) as exc:
                bare = urlsplit(endpoint)
                failures.append(f"{bare.scheme}://{bare.hostname}:{bare.port or ''}: {exc}")
    return None, failures


async def placements(
    broker_url: str, configured: str | None, queues: list[str]
) -> list[Placement] | str:
    """Each queue's leader and members, or why they cannot be known."""
    documents, failures = await _queue_documents(broker_url, configured, queues, _TIMEOUT)
    if documents is None:
        return (
            "leaders and members unknown: the management API did not answer ("
            + "; ".join(failures)
            + "); enable rabbitmq_management or set JOBRELAY_BROKER_MANAGEMENT_URL"
        )
    return [
        Placement(
            queue=name,
            leader=data.get("leader") or data.get("node"),
            members=tuple(data.get("members") or ()),
            online=tuple(data.get("online") or ()),
        )
        for name, data in zip(queues, documents, strict=True)
    ]


async def unacked(
    broker_url: str, configured: str | None, queues: list[str], *, timeout: float = 2.0
) -> dict[str, int] | None:
    """Each queue's delivered-but-unacked messages (in flight), or None when the management
    API does not answer: AMQP's passive declare counts only the ready ones."""
    documents, _ = await _queue_documents(broker_url, configured, queues, timeout)
    if documents is None:
        return None
    try:
        return {
            name: int(data.get("messages_unacknowledged") or 0)
            for name, data in zip(queues, documents, strict=True)
        }
    except (TypeError, ValueError):  # not a count: unknown, never a guess
        return None


def render(found: list[Placement] | str) -> str:
    """The table `jobrelay broker declare` prints (or the reason there is none)."""
    if isinstance(found, str):
        return found
    width = max(len(p.queue) for p in found) if found else 5
    lines = [f"{'queue':<{width}}  leader  members (* online)"]
    for p in found:
        members = ", ".join(m + ("*" if m in p.online else "") for m in p.members) or "-"
        lines.append(f"{p.queue:<{width}}  {p.leader or '-'}  {members}")
    return "\n".join(lines)
