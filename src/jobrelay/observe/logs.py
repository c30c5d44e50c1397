"""One line per event on stderr, for every process: JSON for machines, text for people.

``JOBRELAY_LOG_FORMAT=json|text``; unset, a terminal gets text and anything else (a file, a
pipe, a log shipper) JSON. Lifecycle lines carry ``event`` (a stable action name) and
``jobId``/``attempt`` where they apply, passed through ``extra=``; support greps one job's
story across api, relay and worker logs by its id. Never log tokens or payload bodies.

A task can ``bound()`` context (``jobId``, ``attempt``) that the formatter adds to every line
logged inside it, so lines from deep helpers carry the job too. A line logged while a trace
is active (the HTTP request's, the job's run: ``observe.tracing``) carries its ``trace_id``
and ``span_id``, the ids the tracing backend shows. As a last guard every line passes
through the one scrubber (``observe.scrub``).

A line is compact JSON (``{"event":"claimed",...}``: grep a field with ``jq``, not with the
spacing) written by orjson, a few times faster than ``json`` (a worker writes lines for
every batch); a line that holds non-ASCII text is written by ``json`` as before, escaped to
ASCII, so a terminal or a log shipper reading ASCII never sees a byte it cannot read.
"""

from __future__ import annotations

import contextlib
import json
import logging
import sys
from collections.abc import Iterator, Mapping
from contextvars import ContextVar
from datetime import UTC, datetime
from types import MappingProxyType
from typing import Any

from opentelemetry import trace

from jobrelay import fastjson
from jobrelay.observe.scrub import scrub, scrubbed

_STANDARD = set(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {"message", "asctime"}
_CONTEXT: ContextVar[Mapping[str, Any]] = ContextVar(
    "jobrelay_log_context", default=MappingProxyType({})
)


def trace_fields() -> dict[str, str]:
    """``trace_id`` and ``span_id`` of the span current in this task, or nothing."""
    span = trace.get_current_span().get_span_context()
    if not span.is_valid:
        return {}
    return {"trace_id": f"{span.trace_id:032x}", "span_id": f"{span.span_id:016x}"}


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
        entry.update(trace_fields())
        for key, value in record.__dict__.items():
            if key not in _STANDARD and not key.startswith("_"):
                entry[key] = value
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        # Scrubbed before it is serialised: a pattern run over the JSON could cut through an
        # escaped quote and leave a line that is not JSON.
        entry = scrubbed(entry)
        text = fastjson.dumps(entry, default=str)
        if not text.isascii():
            text = json.dumps(entry, default=str, separators=(",", ":"))
        return text


class TextFormatter(logging.Formatter):
    """One line a person reads: time, level, event, job id, the message, then the rest of
    the fields as ``key=value`` (the trace ids last)."""

    def __init__(self, process_name: str) -> None:
        super().__init__()
        self.process_name = process_name

    def format(self, record: logging.LogRecord) -> str:
        fields: dict[str, Any] = dict(_CONTEXT.get())
        for key, value in record.__dict__.items():
            if key not in _STANDARD and not key.startswith("_"):
                fields[key] = value
        fields.update(trace_fields())
        fields = scrubbed(fields)
        event = fields.pop("event", None)
        job = fields.pop("jobId", None)
        when = datetime.fromtimestamp(record.created).strftime("%H:%M:%S")
        head = f"{when}.{int(record.msecs):03d} {record.levelname:<7} {self.process_name}"
        text = f"{head} {event or '-':<16} {job or '-'} {scrub(record.getMessage())}"
        rest = " ".join(f"{k}={_short(v)}" for k, v in fields.items())
        if rest:
            text = f"{text}  [{rest}]"
        if record.exc_info:
            text = f"{text}\n{scrub(self.formatException(record.exc_info))}"
        return text


def _short(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return text if " " not in text else json.dumps(text)


def text_by_default(stream: Any = None) -> bool:
    """Whether ``JOBRELAY_LOG_FORMAT`` unset means text: the lines go to a terminal."""
    stream = sys.stderr if stream is None else stream
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


def configure(process_name: str, level: str = "INFO", fmt: str | None = None) -> None:
    """``fmt``: "json" or "text"; None picks text for a terminal, JSON for anything else."""
    # Our lines never show the caller's file and line, thread or process: do not look them up
    # for every record (the logging HOWTO's "Optimization"; a busy API logs per request).
    logging._srcfile = None
    logging.logThreads = False
    logging.logProcesses = False
    logging.logMultiprocessing = False
    handler = logging.StreamHandler(sys.stderr)
    text = fmt == "text" if fmt is not None else text_by_default()
    handler.setFormatter((TextFormatter if text else JsonFormatter)(process_name))
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
