"""``GET /v1/jobs/{jobId}/events`` as server-sent events (``Accept: text/event-stream``): a
client follows a job without polling the JSON route.

The stream sends every event so far, then each new one as it commits, each as the JSON route
shows it (``EventOut``: the same redaction for an account's token), with the event's row id as
the SSE ``id``. A client that reconnects sends ``Last-Event-ID`` and gets only the events after
it. Once the job has ended, the events written just after its end (the ack's) are sent too,
then an ``end`` event, and the stream closes. An idle stream sends a comment every
``KEEPALIVE_SECONDS`` so that proxies keep it open; each stream is one of the API's counted
connections (``processes.http_guard``), dropped like any other whose client stops reading.

Causal order as the JSON route's (``domain.timeline``): a delivery's event is held back until
its message's ``published`` (which the relay writes after the broker's confirm, possibly after
the worker's ``claimed``) has been sent, for at most ``HOLD_SECONDS``. New events are read
every ``POLL_SECONDS`` with one indexed query per stream: a job's events are written by many
transitions of several processes, and only its end is notified (``library.waiting``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from jobrelay.api.schemas import EventOut
from jobrelay.domain.timeline import PUBLISHED, message_of
from jobrelay.runtime.wiring import Runtime
from jobrelay.storage.records import EventRecord

MEDIA_TYPE = "text/event-stream"
POLL_SECONDS = 1.0
KEEPALIVE_SECONDS = 15.0
HOLD_SECONDS = 2.0
TAIL_SECONDS = 1.0  # read again this long after the job ended: the events its end wrote
RETRY_MILLISECONDS = 2000  # the client's reconnection delay (the SSE ``retry`` field)


def wants_stream(accept: str | None) -> bool:
    """The request asked for server-sent events (``Accept: text/event-stream``)."""
    return accept is not None and MEDIA_TYPE in accept.lower()


def _frame(event: EventRecord, admin: bool) -> bytes:
    data = EventOut.from_record(event, admin=admin).model_dump_json(by_alias=True)
    return f"id: {event.id}\nevent: {event.kind}\ndata: {data}\n\n".encode()


def last_event_id(header: str | None) -> int | None:
    """The ``Last-Event-ID`` a reconnecting client sent; None when absent or not an id."""
    if header is None or not header.strip().isdigit():
        return None
    return int(header.strip())


async def stream_events(
    runtime: Runtime, job_id: str, *, admin: bool, after: int | None
) -> AsyncIterator[bytes]:
    """The job's timeline as SSE frames, then ``end`` once it has ended."""
    sent: set[int] = set()
    held: dict[int, float] = {}
    ended_at: float | None = None
    quiet_since = time.monotonic()
    yield f"retry: {RETRY_MILLISECONDS}\n\n".encode()
    while True:
        events = await runtime.store.events(job_id)
        published = {message_of(e) for e in events if e.kind == PUBLISHED}
        waiting = False
        for event in events:
            if event.id is None or event.id in sent or (after is not None and event.id <= after):
                continue
            ref = message_of(event)
            if event.kind != PUBLISHED and ref is not None and ref not in published:
                since = held.setdefault(event.id, time.monotonic())
                if time.monotonic() - since < HOLD_SECONDS:
                    waiting = True
                    break  # nothing after it either: the order is kept
            sent.add(event.id)
            quiet_since = time.monotonic()
            yield _frame(event, admin)
        job = await runtime.store.get_job(job_id)
        now = time.monotonic()
        if job is None or job.state.is_terminal:
            if ended_at is None:
                ended_at = now
            elif now - ended_at >= TAIL_SECONDS and not waiting:
                yield b"event: end\ndata: {}\n\n"
                return
        if now - quiet_since >= KEEPALIVE_SECONDS:
            quiet_since = now
            yield b": keep-alive\n\n"
        await asyncio.sleep(POLL_SECONDS)


__all__ = ["KEEPALIVE_SECONDS", "MEDIA_TYPE", "last_event_id", "stream_events", "wants_stream"]
