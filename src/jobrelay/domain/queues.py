"""Queue names and logical destinations: what the store writes, whatever the transport.

A job's message goes to a logical destination, which the outbox stores:

- ``work``: the default queue, now;
- ``retry.<n>s``: the default queue, after ``n`` seconds;
- ``work.Q``: the named queue Q, now;
- ``retry.Q.<n>s``: Q, after ``n`` seconds, so a retry returns to the queue its job came from.

``destination()`` is the one mapping from (queue, delay) to a destination; ``parse_destination()``
its inverse. Which broker queue each destination is belongs to ``transport.topology``.
"""

from __future__ import annotations

import re

DEFAULT_QUEUE = "default"
WORK_ROUTING_KEY = "work"

_NAME = r"[a-z0-9][a-z0-9_-]{0,31}"
QUEUE_NAME = re.compile(rf"^{_NAME}$")
_WORK = re.compile(rf"^work(?:\.({_NAME}))?$")
_RETRY = re.compile(rf"^retry\.(?:({_NAME})\.)?([1-9][0-9]*)s$")


def check_queue_name(name: str) -> str:
    """The name, or ValueError unless it is a valid queue name (``QUEUE_NAME``)."""
    if not QUEUE_NAME.match(name):
        raise ValueError(f"queue name {name!r} must match {QUEUE_NAME.pattern}")
    return name


def destination(queue: str = DEFAULT_QUEUE, delay: int | None = None) -> str:
    """The logical destination of a job's message on ``queue``: now, or after ``delay`` s."""
    if delay is None:
        return WORK_ROUTING_KEY if queue == DEFAULT_QUEUE else f"work.{queue}"
    return f"retry.{delay}s" if queue == DEFAULT_QUEUE else f"retry.{queue}.{delay}s"


def parse_destination(value: str) -> tuple[str, int | None] | None:
    """(queue, delay or None) of a destination; None when it is not one."""
    if match := _WORK.match(value):
        queue = match.group(1)
        if queue == DEFAULT_QUEUE:
            return None  # the default queue is spelled "work"
        return queue or DEFAULT_QUEUE, None
    if match := _RETRY.match(value):
        queue = match.group(1)
        if queue == DEFAULT_QUEUE:
            return None
        return queue or DEFAULT_QUEUE, int(match.group(2))
    return None


def retry_seconds(value: str) -> int | None:
    """The delay of a retry destination (of any queue), or None when it is not one."""
    parsed = parse_destination(value)
    return parsed[1] if parsed else None
