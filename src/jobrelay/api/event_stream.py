"""``GET /v1/jobs/{jobId}/events`` as server-sent events (``Accept: text/event-stream``): a
client follows a job without polling the JSON route.

The stream sends every event so far, then each new one as it commits, each as the JSON route
shows it (``EventOut``: the same redaction for an account's token). Each frame's SSE ``id`` is a
cursor over the events' row ids (``Resume``): a client that reconnects sends it back as
``Last-Event-ID`` and gets exactly the events it had not received. Once the job has ended,
the events written just after its end (the ack's) are sent too, then an ``end`` event, and
the stream closes. An idle stream sends a comment every
``KEEPALIVE_SECONDS`` so that proxies keep it open; each stream is one of the API's counted
connections (``processes.http_guard``), dropped like any other whose client stops reading.

Causal order, as the JSON route's (``domain.timeline``): a delivery's event is held back until
its message's ``published`` (which the relay writes after the broker's confirm, possibly after
the worker's ``claimed``) has been sent, for at most ``HOLD_SECONDS``. Events that no cause
orders, written at once by different processes (the first attempt's batched ``ack_sent`` and
the retry's ``published``, stamped with the relay's earlier claim), come in the order they
committed; the JSON route sorts those by time. New events are read
every ``POLL_SECONDS`` with one indexed query per stream: a job's events are written by many
transitions of several processes, and only its end is notified (``library.waiting``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass

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


def _frame(event: EventRecord, admin: bool, cursor: str) -> bytes:
    data = EventOut.from_record(event, admin=admin).model_dump_json(by_alias=True)
    return f"id: {cursor}\nevent: {event.kind}\ndata: {data}\n\n".encode()


@dataclass
class Resume:
    """Where a stream stands: every event with a row id up to ``below`` was sent, and so
    were ``above`` (a ``published`` moved up before an earlier-numbered delivery event, as
    the timeline orders them). Sent as each frame's SSE ``id`` (``12`` or ``12:14,15``) and
    read back from ``Last-Event-ID``, so a client that reconnects gets exactly the events it
    had not received, in whichever order they were sent."""

    below: int = 0
    above: frozenset[int] = frozenset()

    @classmethod
    def parse(cls, header: str | None) -> Resume | None:
        """The cursor a reconnecting client sent; None when absent or not one of ours."""
        if header is None:
            return None
        head, _, tail = header.strip().partition(":")
        try:
            below = int(head)
            above = frozenset(int(i) for i in tail.split(",")) if tail else frozenset()
        except ValueError:
            return None
        if below < 0 or any(i <= below for i in above):
            return None
        return cls(below, above)

    def has(self, event_id: int) -> bool:
        return event_id <= self.below or event_id in self.above

    def after_sending(self, event_id: int, known: Iterable[int]) -> Resume:
        """This cursor with ``event_id`` sent; ``known``: every id read so far."""
        above = set(self.above) | {event_id}
        below = self.below
        for i in sorted(i for i in known if i > below):
            if i not in above:
                break
            below = i
            above.discard(i)
        return Resume(below, frozenset(above))

    def __str__(self) -> str:
        extra = ",".join(str(i) for i in sorted(self.above))
        return f"{self.below}:{extra}" if extra else str(self.below)


def last_event_id(header: str | None) -> Resume | None:
    """The ``Last-Event-ID`` a reconnecting client sent (``Resume.parse``)."""
    return Resume.parse(header)


async def stream_events(
    runtime: Runtime, job_id: str, *, admin: bool, after: Resume | None
) -> AsyncIterator[bytes]:
    """The job's timeline as SSE frames, then ``end`` once it has ended."""
    cursor = after or Resume()
    known: set[int] = set()
    held: dict[int, float] = {}
    ended_at: float | None = None
    quiet_since = time.monotonic()
    yield f"retry: {RETRY_MILLISECONDS}\n\n".encode()
    while True:
        events = await runtime.store.events(job_id)
        known.update(e.id for e in events if e.id is not None)
        published = {message_of(e) for e in events if e.kind == PUBLISHED}
        waiting = False
        for event in events:
            if event.id is None or cursor.has(event.id):
                continue
            ref = message_of(event)
            if event.kind != PUBLISHED and ref is not None and ref not in published:
                since = held.setdefault(event.id, time.monotonic())
                if time.monotonic() - since < HOLD_SECONDS:
                    waiting = True
                    break  # nothing after it either: the order is kept
            cursor = cursor.after_sending(event.id, known)
            quiet_since = time.monotonic()
            yield _frame(event, admin, str(cursor))
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


__all__ = [
    "KEEPALIVE_SECONDS",
    "MEDIA_TYPE",
    "Resume",
    "last_event_id",
    "stream_events",
    "wants_stream",
]
