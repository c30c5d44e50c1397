"""One JSON object per line on stderr, for every process.

Lifecycle lines carry ``event`` (a stable action name) and ``jobId``/``attempt`` where they
apply, passed through ``extra=``; support greps one job's story across api, relay and
worker logs by its id. Never log tokens or payload bodies.

A task can ``bound()`` context (``jobId``, ``attempt``, ``traceId``) that the formatter adds
to every line logged inside it, so lines from deep helpers carry the job too. ``traceId``
comes from the W3C ``traceparent`` the API received, which travels in the outbox row and the
message headers. As a last guard the formatter masks anything shaped like an API token, a
bearer credential or a password in a URL.

A line is compact JSON (``{"event":"claimed",...}``: grep a field with ``jq``, not with the
spacing) written by orjson, a few times faster than ``json`` (a worker writes lines for
every batch); a line that holds non-ASCII text is written by ``json`` as before, escaped to
ASCII, so a terminal or a log shipper reading ASCII never sees a byte it cannot read.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import sys
from collections.abc import Iterator, Mapping
from contextvars import ContextVar
from datetime import UTC, datetime
from types import MappingProxyType
from typing import Any

from jobrelay import fastjson

_STANDARD = set(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {"message", "asctime"}
_CONTEXT: ContextVar[Mapping[str, Any]] = ContextVar(
    "jobrelay_log_context", default=MappingProxyType({})
)
_TRACEPARENT = re.compile(r"^[0-9a-f]{2}-([0-9a-f]{32})-[0-9a-f]{16}-[0-9a-f]{2}")
_SECRETS = (
    (re.compile(r"jr_[A-Za-z0-9_-]{16,}"), "jr_***"),
    (re.compile(r"(?i)(bearer\s+)[A-Za-z0-9._~+/=-]{8,}"), r"\1***"),
    (re.compile(r"(://[^:/@\s\"']+:)[^@/\s\"']+@"), r"\1***@"),
)


def trace_id(traceparent: object) -> str | None:
    """The trace id of a W3C ``traceparent`` header value, or None when it is not one."""
    if not isinstance(traceparent, str):
        return None
    match = _TRACEPARENT.match(traceparent.strip().lower())
    return match.group(1) if match and match.group(1) != "0" * 32 else None


def context() -> Mapping[str, Any]:
    """What ``bound()`` has attached to log lines in the current task."""
    return _CONTEXT.get()


@contextlib.contextmanager
def bound(**values: Any) -> Iterator[None]:
    """Add ``values`` (None ones skipped) to every line logged in this block and its tasks."""
    token = _CONTEXT.set({**_CONTEXT.get(), **{k: v for k, v in values.items() if v is not None}})
    try:
        yield
    finally:
        _CONTEXT.reset(token)


def bind(**values: Any) -> None:
    """Like ``bound()`` until the enclosing ``bound()`` block (or the task) ends."""
    _CONTEXT.set({**_CONTEXT.get(), **{k: v for k, v in values.items() if v is not None}})


def scrub(text: str) -> str:
    # What each of _SECRETS needs before it can match: most lines hold none of it, and three
    # substring tests cost a fraction of one regular expression's search.
    if "jr_" not in text and "://" not in text and "bearer" not in text.lower():
        return text
    for pattern, replacement in _SECRETS:
        text = pattern.sub(replacement, text)
    return text


class JsonFormatter(logging.Formatter):
    def __init__(self, process_name: str) -> None:
        super().__init__()
        self.process_name = process_name
        self._second = -1
        self._prefix = ""

    def _timestamp(self, record: logging.LogRecord) -> str:
        """``datetime.isoformat(timespec="milliseconds")`` of the record's time in UTC; the
        part up to the second is made once a second (it is most of the cost)."""
        second = int(record.created)
        if second != self._second:
            self._second = second
            self._prefix = datetime.fromtimestamp(second, UTC).strftime("%Y-%m-%dT%H:%M:%S")
        return f"{self._prefix}.{int(record.msecs):03d}+00:00"

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": self._timestamp(record),
            "level": record.levelname.lower(),
            "process": self.process_name,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        entry.update(_CONTEXT.get())
        for key, value in record.__dict__.items():
            if key not in _STANDARD and not key.startswith("_"):
                entry[key] = value
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        text = fastjson.dumps(entry, default=str)
        if not text.isascii():
            text = json.dumps(entry, default=str, separators=(",", ":"))
        return scrub(text)


def configure(process_name: str, level: str = "INFO") -> None:
    # Our lines never show the caller's file and line, thread or process: do not look them up
    # for every record (the logging HOWTO's "Optimization"; a busy API logs per request).
    logging._srcfile = None
    logging.logThreads = False
    logging.logProcesses = False
    logging.logMultiprocessing = False
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(process_name))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # DEBUG is for jobrelay's own lines (each job's claimed, result_saved, ack_sent); the
    # libraries' debug lines (a line per aiosqlite call, per HTTP read) stay out of it.
    for chatty in ("aiosqlite", "asyncio", "httpcore", "botocore", "aiobotocore", "multipart"):
        logging.getLogger(chatty).setLevel(logging.INFO)
    for noisy in ("aiormq", "aio_pika", "uvicorn.access", "alembic"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    # Connect failures are raised to us and reported once, naming the setting to fix.
    logging.getLogger("aiormq.connection").setLevel(logging.CRITICAL)
