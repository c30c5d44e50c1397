"""OpenTelemetry: one trace from the HTTP request through the relay and the broker to each run.

The trace context travels with OpenTelemetry's own propagators (W3C ``traceparent`` and
``tracestate``, and ``baggage``): captured when a job is enqueued (``enqueuing``: the HTTP
request's span, or the application's current span when it enqueues in its own
transaction), stored on the job row (``jobs.trace_context``), carried in its outbox rows and
its messages' headers (AMQP, or the local transport's rows). Every attempt reads it back.

Spans follow the messaging semantic conventions (``messaging.system`` = ``jobrelay``, the
queue as destination, ``messaging.message.id`` = the job id, the operation type):

- ``enqueue`` (producer, ``create``): a child of the caller's span; its context is what the
  job carries, so every later span of the job can find it.
- ``publish`` (producer, ``send``, in the relay): a child of ``enqueue``; its length is the
  broker's confirm latency; a ``basic.return`` is an event on it.
- ``run <type>`` (consumer, ``process``): one per delivery handled, LINKED to ``enqueue``
  (``JOBRELAY_OTEL_PARENT=child`` makes it a child instead). A retry is another ``run``
  linked to the same ``enqueue``. Inside it ``claim``, ``commit`` (children whose times are
  their batch statement's: one measured time, shared by every job of the batch, without a
  span per row of SQL) and ``ack``.

Each timeline event a process writes for a job is also an event on that process's span for
it (``event``), with the same name and time. Nothing here touches the database or the
broker.

Without a tracer provider (no ``otel`` extra, or no exporter named) no span is made: the
context is still carried, so log lines keep the caller's trace id. With the extra,
``configure`` builds the provider from the standard environment variables, unless the
application set its own first.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.trace import Link, Span, SpanKind, StatusCode

from jobrelay.observe.scrub import scrub

if TYPE_CHECKING:
    from jobrelay.storage.records import NewJob

log = logging.getLogger("jobrelay.tracing")

SYSTEM = "jobrelay"
_tracer = trace.get_tracer("jobrelay")  # a proxy: follows whichever provider is set, when
_ACTIVE = False
_OWN = False  # a provider given to ``use``
_LOOKED_AT = -1e9  # when ``active`` last looked for a global provider (monotonic seconds)
_LOOK_AGAIN_SECONDS = 1.0
_PROVIDER: trace.TracerProvider | None = None
# The headers that hold the trace context, whatever else a message carries.
TRACE_HEADERS = ("traceparent", "tracestate", "baggage")


@dataclass(frozen=True)
class TraceOptions:
    # How a run relates to its enqueue: "link" (a trace per run, linked) or "child".
    parent: str = "link"
    # The account on spans: "hash" (a SHA-256 prefix: one account's spans group together
    # without naming it) or "omit".
    account: str = "hash"


OPTIONS = TraceOptions()


def set_options(options: TraceOptions) -> None:
    global OPTIONS
    OPTIONS = options


def use(provider: trace.TracerProvider | None) -> None:
    """Record jobrelay's spans with ``provider`` instead of the global one (a test's, with the
    SDK's in-memory exporter; an application that keeps jobrelay's spans apart); None goes
    back to the global provider. An API made after this call uses it too."""
    global _tracer, _ACTIVE, _OWN, _PROVIDER
    _OWN = provider is not None
    _PROVIDER = provider
    _tracer = (provider or trace.get_tracer_provider()).get_tracer("jobrelay")
    _ACTIVE = False


def active() -> bool:
    """Whether spans are recorded: a real tracer provider is set (ours, the application's,
    or one given to ``use``).

    Once set, a global provider cannot be replaced: a True answer is kept. A False one is
    looked at again at most once a second (an application may set its provider after the
    worker started): the look reads the environment, and the hot path asks several times
    per job (measured: a tenth of the drain's CPU when asked every time)."""
    global _ACTIVE, _LOOKED_AT
    if _ACTIVE or _OWN:
        return True
    now = time.monotonic()
    if now - _LOOKED_AT < _LOOK_AGAIN_SECONDS:
        return False
    _LOOKED_AT = now
    provider = trace.get_tracer_provider()
    _ACTIVE = not isinstance(provider, trace.ProxyTracerProvider | trace.NoOpTracerProvider)
    return _ACTIVE


# --- the carried context ---------------------------------------------------------------------


def carrier(ctx: otel_context.Context | None = None) -> dict[str, str]:
    """The headers that carry ``ctx`` (default: the current one); empty when it holds no
    trace."""
    out: dict[str, str] = {}
    propagate.inject(out, context=ctx)
    return out


def context_of(headers: Mapping[str, object] | None) -> otel_context.Context:
    """The trace context a job's headers carry (AMQP values may come as bytes)."""
    found: dict[str, str] = {}
    for name in TRACE_HEADERS:
        value = (headers or {}).get(name)
        if isinstance(value, bytes):
            value = value.decode("latin-1")
        if isinstance(value, str):
            found[name] = value
    return propagate.extract(found) if found else otel_context.Context()


def trace_headers(headers: Mapping[str, object] | None) -> dict[str, str]:
    """Only the trace context of ``headers``."""
    return {k: v for k, v in (headers or {}).items() if k in TRACE_HEADERS and isinstance(v, str)}


def trace_id_of(headers: Mapping[str, object] | None) -> str | None:
    """The trace id ``headers`` carry, as the tracing backend shows it (32 hex digits)."""
    span = trace.get_current_span(context_of(headers)).get_span_context()
    return f"{span.trace_id:032x}" if span.is_valid else None


def account_attribute(account: str | None) -> dict[str, str]:
    if account is None or OPTIONS.account == "omit":
        return {}
    return {"jobrelay.account.hash": hashlib.sha256(account.encode()).hexdigest()[:16]}


def _job_attributes(
    job_id: str | None, job_type: str, queue: str, operation: str
) -> dict[str, Any]:
    attributes: dict[str, Any] = {
        "messaging.system": SYSTEM,
        "messaging.operation.type": operation,
        "messaging.destination.name": queue,
        "jobrelay.job.type": job_type,
    }
    if job_id is not None:
        attributes["messaging.message.id"] = job_id
    return attributes


# --- enqueue ---------------------------------------------------------------------------------


@contextlib.contextmanager
def enqueuing(jobs: Sequence[NewJob]) -> Iterator[list[NewJob]]:
    """The jobs as they are written: each carrying the trace context of their ``enqueue``
    span (one span for the batch), or of the caller's current span when none is recorded.

    A job that already carries a context (a follow-up, made inside its origin's run) is
    enqueued as a child of it. The span is not made current (its statements may run as a
    generator's steps, across other tasks' turns); it ends when the block does.
    """
    if not jobs:
        yield list(jobs)
        return
    first = jobs[0]
    given = trace_headers(first.headers)
    parent = context_of(given) if given else None
    if not active():
        headers = given or carrier()
        yield [_with_trace(job, headers, given) for job in jobs]
        return
    attributes = _job_attributes(
        first.job_id if len(jobs) == 1 else None, first.type, first.queue, "create"
    )
    attributes["messaging.operation.name"] = "enqueue"
    attributes.update(account_attribute(first.account_id))
    if len(jobs) > 1:
        attributes["messaging.batch.message_count"] = len(jobs)
    span = _tracer.start_span(
        "enqueue", context=parent, kind=SpanKind.PRODUCER, attributes=attributes
    )
    headers = carrier(trace.set_span_in_context(span, parent))
    try:
        yield [_with_trace(job, headers, given) for job in jobs]
    except BaseException as exc:
        _fail(span, exc)
        raise
    finally:
        if len(jobs) == 1:
            span.add_event("accepted")
        span.end()


def _with_trace(job: NewJob, headers: Mapping[str, str], given: Mapping[str, str]) -> NewJob:
    """``job`` carrying ``headers``, unless it carries a trace of its own other than
    ``given`` (the first job's, the enqueue's parent): one of a batch keeps its own."""
    own = trace_headers(job.headers)
    if own and own != given:
        return job
    rest = {k: v for k, v in (job.headers or {}).items() if k not in TRACE_HEADERS}
    merged = {**rest, **headers}
    return job if merged == dict(job.headers or {}) else dataclasses.replace(job, headers=merged)


def follow_up_headers() -> dict[str, str]:
    """What a job made inside a run carries: the run's context (its enqueue is a child of
    the run that made it)."""
    return carrier()


# --- the API request -------------------------------------------------------------------------


def fastapi_telemetry() -> dict[str, Any]:
    """FastAPI's own OpenTelemetry settings for our API: FastAPI makes the request's server
    span (the caller's context its parent) whenever spans are recorded, with the provider
    given to ``use`` if any. Its operation spans (dependencies, serialisation) stay off: a
    request's trace is its server span and the enqueue. Its log records stay off too: they
    carry exception text past the one scrubber."""
    config: dict[str, Any] = {"operation_spans": False, "logs": False}
    if _OWN:
        config["tracer_provider"] = _PROVIDER
    return config


@contextlib.contextmanager
def request_context(headers: Mapping[str, str]) -> Iterator[None]:
    """With no spans recorded, the caller's trace context (W3C headers) is current while its
    request is handled: a job it enqueues carries it, and log lines its trace id. With spans
    recorded, FastAPI's server span is current already (``fastapi_telemetry``)."""
    if active():
        yield
        return
    with _carried(headers):
        yield


@contextlib.contextmanager
def _carried(headers: Mapping[str, object]) -> Iterator[None]:
    """With nothing recorded: the context ``headers`` carry, current in the block (its log
    lines carry its trace id); nothing to do when they carry none."""
    if headers.keys().isdisjoint(TRACE_HEADERS):
        yield
        return
    token = otel_context.attach(context_of(headers))
    try:
        yield
    finally:
        otel_context.detach(token)


# --- the relay -------------------------------------------------------------------------------


@contextlib.contextmanager
def publishing(
    job_id: str, headers: Mapping[str, object], destination: str
) -> Iterator[Span | None]:
    """The ``publish`` span of one outbox row: from the publish to its confirm."""
    if not active():
        with _carried(headers):
            yield None
        return
    attributes = {
        "messaging.system": SYSTEM,
        "messaging.operation.type": "send",
        "messaging.operation.name": "publish",
        "messaging.destination.name": destination,
        "messaging.message.id": job_id,
    }
    span = _tracer.start_span(
        "publish", context=context_of(headers), kind=SpanKind.PRODUCER, attributes=attributes
    )
    with trace.use_span(
        span, end_on_exit=True, record_exception=False, set_status_on_exception=False
    ):
        yield span


def published(span: Span | None, error: str | None) -> None:
    """The confirm (or its failure) on the ``publish`` span."""
    if span is None:
        return
    if error is None:
        span.add_event("published")
        return
    kind = error.split(":", 1)[0]
    if "unroutable" in error:  # the broker returned it (``basic.return``): no queue bound
        span.add_event("basic.return", {"jobrelay.reason": scrub(error)})
    span.set_attribute("jobrelay.outcome", kind)
    span.set_status(StatusCode.ERROR, scrub(error))


# --- the worker ------------------------------------------------------------------------------


@contextlib.contextmanager
def running(
    job_id: str | None, job_type: str, queue: str, headers: Mapping[str, object]
) -> Iterator[Span | None]:
    """The ``run <type>`` span of one delivery, current while it is handled: linked to (or
    a child of, ``JOBRELAY_OTEL_PARENT=child``) the job's ``enqueue``. Without spans, the
    enqueue's context is current instead (log lines carry its trace id)."""
    if not active():
        with _carried(headers):
            yield None
        return
    origin = context_of(headers)
    enqueue = trace.get_current_span(origin).get_span_context()
    child = OPTIONS.parent == "child"
    links = [Link(enqueue)] if enqueue.is_valid and not child else None
    span = _tracer.start_span(
        f"run {job_type}",
        context=origin if child else otel_context.Context(),
        kind=SpanKind.CONSUMER,
        links=links,
        attributes={
            **_job_attributes(job_id, job_type, queue, "process"),
            "messaging.operation.name": "run",
        },
    )
    with trace.use_span(
        span, end_on_exit=True, record_exception=False, set_status_on_exception=False
    ):
        yield span


def annotate(**attributes: Any) -> None:
    """Attributes on the current span (the run's attempt, account, outcome)."""
    if not active():
        return
    span = trace.get_current_span()
    if span.is_recording():
        for key, value in attributes.items():
            if value is not None:
                span.set_attribute(key, scrub(value) if isinstance(value, str) else value)


def event(kind: str, at: datetime | None = None, detail: Mapping[str, Any] | None = None) -> None:
    """A timeline event as an event of the current span, at the same time."""
    if not active():
        return
    span = trace.get_current_span()
    if not span.is_recording():
        return
    stamp = int(at.timestamp() * 1e9) if at is not None else None
    span.add_event(kind, _event_attributes(detail), timestamp=stamp)


def _event_attributes(detail: Mapping[str, Any] | None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in (detail or {}).items():
        if isinstance(value, str):
            out[f"jobrelay.{key}"] = scrub(value)
        elif isinstance(value, bool | int | float):
            out[f"jobrelay.{key}"] = value
    return out


def failed(public: str, raw: str | None = None) -> None:
    """The run's error: the account's reason as the status, the operators' text (which their
    logs carry already) scrubbed as an ``exception`` event."""
    if not active():
        return
    span = trace.get_current_span()
    if not span.is_recording():
        return
    span.set_status(StatusCode.ERROR, public)
    if raw:
        span.add_event("exception", {"exception.message": scrub(raw)})


def _fail(span: Span, exc: BaseException) -> None:
    span.set_status(StatusCode.ERROR, type(exc).__name__)
    span.add_event(
        "exception",
        {"exception.type": type(exc).__name__, "exception.message": scrub(str(exc))},
    )


@contextlib.contextmanager
def step(name: str, **attributes: Any) -> Iterator[None]:
    """A child span of the current one (an ack, a claim sent on its own)."""
    if not active() or not trace.get_current_span().is_recording():
        yield
        return
    with _tracer.start_as_current_span(
        name,
        kind=SpanKind.CLIENT,
        attributes={"messaging.system": SYSTEM, **attributes},
        record_exception=False,
    ):
        yield


def current() -> otel_context.Context | None:
    """The context a batched request is made in (its batch's span is a child of it), or None
    when nothing is recorded (the batcher then skips the spans)."""
    if not active():
        return None
    return otel_context.get_current() if trace.get_current_span().is_recording() else None


def batch_spans(
    name: str,
    requests: Sequence[tuple[otel_context.Context | None, object]],
    started_ns: int,
    ended_ns: int,
) -> None:
    """One span per request of a batch (its context, its job id), each a child of its
    request's span, all with the statement's own start and end: one measured time, shared."""
    size = len(requests)
    for ctx, job_id in requests:
        if ctx is None:
            continue
        span = _tracer.start_span(
            name,
            context=ctx,
            kind=SpanKind.CLIENT,
            start_time=started_ns,
            attributes={
                "messaging.system": SYSTEM,
                "messaging.message.id": str(job_id),
                "jobrelay.batch.size": size,
            },
        )
        span.end(end_time=ended_ns)


def now_ns() -> int:
    return time.time_ns()


def provider_set() -> None:
    """A real provider was just set (``observe.exporters.configure``): spans from now on,
    without waiting for ``active``'s next look."""
    global _ACTIVE
    _ACTIVE = True
