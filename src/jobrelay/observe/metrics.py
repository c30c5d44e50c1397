"""Prometheus metrics: one ``Metrics`` object per runtime, its own registry, no globals.

Counters and histograms count what *this process* did (a worker's claims, a relay's
publishes); Prometheus sums them across processes. The gauges read from the database
(``jobrelay_jobs``, ``jobrelay_outbox_*``) describe the whole system and are refreshed by
the processes that serve them (the API and the relay) when scraped, at most once per
``JOBRELAY_METRICS_CACHE_SECONDS`` whatever the scrape rate (they are a ``GROUP BY`` over
every job, which a scraper hammering ``/metrics`` would otherwise run each time): aggregate
those with ``max``, not ``sum``. Every name is documented in docs/reference/metrics.md; a
test checks that the page and this module agree.

``serve_metrics`` is the small HTTP server behind ``--metrics-port`` (relay, worker).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import socket
from collections.abc import Awaitable, Callable
from datetime import datetime
from typing import TYPE_CHECKING, Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

if TYPE_CHECKING:
    from jobrelay.storage.port import StorePort

log = logging.getLogger("jobrelay.metrics")

# The classic text format every Prometheus version reads (the names here need nothing newer).
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
NEW = "new"  # the from_state of a job that was just accepted

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_DURATION_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 900.0)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.transitions = Counter(
            "jobrelay_job_transitions",
            "Job state changes committed by this process.",
            ["from_state", "to_state"],
            registry=r,
        )
        self.jobs = Gauge(
            "jobrelay_jobs", "Jobs in each state (read from the database).", ["state"], registry=r
        )
        self.outbox_unpublished = Gauge(
            "jobrelay_outbox_unpublished",
            "Outbox rows not yet confirmed by the broker (read from the database).",
            registry=r,
        )
        self.outbox_oldest_age = Gauge(
            "jobrelay_outbox_oldest_unpublished_age_seconds",
            "Age of the oldest unpublished outbox row; 0 when none waits.",
            registry=r,
        )
        self.publish_seconds = Histogram(
            "jobrelay_publish_seconds",
            "From handing a message to the broker to its publisher confirm (or failure).",
            ["outcome"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.job_duration = Histogram(
            "jobrelay_job_duration_seconds",
            "From a worker's claim to its committed outcome.",
            ["type", "outcome"],
            buckets=_DURATION_BUCKETS,
            registry=r,
        )
        self.throttled = Counter(
            "jobrelay_jobs_throttled",
            "Jobs a relay held back for their limits (counted once per job, when first held).",
            registry=r,
        )
        self.admission_wait = Histogram(
            "jobrelay_admission_wait_seconds",
            "From a job's first hold by its limits to its admission (0: admitted at once).",
            ["type"],
            buckets=_DURATION_BUCKETS,
            registry=r,
        )
        self.deliveries = Counter(
            "jobrelay_deliveries", "Deliveries a worker received.", registry=r
        )
        self.redeliveries = Counter(
            "jobrelay_redeliveries",
            "Deliveries the broker flagged as redelivered (handed out before).",
            registry=r,
        )
        self.duplicates_acked = Counter(
            "jobrelay_duplicates_acked",
            "Deliveries acked without work: the job was finished or its retry not yet due.",
            registry=r,
        )
        self.retries = Counter(
            "jobrelay_retries", "Retries scheduled after a transient failure.", registry=r
        )
        self.quarantines = Counter(
            "jobrelay_quarantines",
            "Jobs moved to quarantined, by cause.",
            ["cause"],
            registry=r,
        )
        self.operator_actions = Counter(
            "jobrelay_operator_actions",
            "Operator actions that changed a job (replay, cancel).",
            ["action"],
            registry=r,
        )
        self.reconcile_runs = Counter(
            "jobrelay_reconcile_runs", "Reconciler passes completed.", registry=r
        )
        self.reconcile_repairs = Counter(
            "jobrelay_reconcile_repairs",
            "Jobs the reconciler repaired, by finding.",
            ["finding"],
            registry=r,
        )
        self.reconcile_findings = Gauge(
            "jobrelay_reconcile_findings",
            "What the last reconciler pass found, by finding (repaired or only reported).",
            ["finding"],
            registry=r,
        )
        self.pruned = Counter(
            "jobrelay_pruned",
            "Rows retention deleted, by table (results: result objects).",
            ["table"],
            registry=r,
        )
        self.reconcile_leader = Gauge(
            "jobrelay_reconcile_leader",
            "1 while this process is the reconciler leader, else 0.",
            registry=r,
        )
        self.schedule_ticks_enqueued = Counter(
            "jobrelay_schedule_ticks_enqueued",
            "Tick jobs of periodic schedules this scheduler wrote (a tick another scheduler "
            "wrote first is not counted again).",
            ["schedule"],
            registry=r,
        )
        self.schedule_ticks_skipped = Counter(
            "jobrelay_schedule_ticks_skipped",
            "Ticks that came due and got no job, by reason (catchup: missed while no "
            "scheduler ran, beyond JOBRELAY_SCHEDULE_CATCHUP; paused).",
            ["schedule", "reason"],
            registry=r,
        )
        self.schedule_failures = Counter(
            "jobrelay_schedule_failures",
            "Scheduler passes in which one schedule failed (logged as schedule_failed); the "
            "pass went on with the other schedules.",
            ["schedule"],
            registry=r,
        )
        self.schedule_ticks_late = Counter(
            "jobrelay_schedule_ticks_late",
            "Tick jobs written more than 5 s after their tick (caught up after an outage, or "
            "a stalled scheduler).",
            ["schedule"],
            registry=r,
        )
        self.schedule_tick_delay = Histogram(
            "jobrelay_schedule_tick_delay_seconds",
            "From a tick's time to the pass that wrote its job (ticks this scheduler wrote).",
            buckets=(*_LATENCY_BUCKETS, 30.0, 60.0, 300.0, 3600.0),
            registry=r,
        )
        self.loop_lag = Histogram(
            "jobrelay_event_loop_lag_seconds",
            "How late a worker's event loop answered its watchdog (blocking code in an async "
            "def job makes it late).",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.loop_blocked = Counter(
            "jobrelay_event_loop_blocked",
            "Times a worker's event loop did not answer within JOBRELAY_LOOP_LAG_WARN_SECONDS "
            "(each logged as loop_blocked, naming the job).",
            registry=r,
        )
        self.threads_abandoned = Counter(
            "jobrelay_sync_threads_abandoned",
            "def job bodies left running in their thread when their attempt ended without "
            "them (time limit, lost lease, cancel, stop).",
            registry=r,
        )
        self.threads_abandoned_running = Gauge(
            "jobrelay_sync_threads_abandoned_running",
            "Abandoned def job bodies still running in this worker's threads.",
            registry=r,
        )
        self.http_requests = Counter(
            "jobrelay_http_requests",
            "HTTP requests answered by the API, by route template and status.",
            ["method", "route", "status"],
            registry=r,
        )
        # When the database gauges were last read (``refresh_database_gauges``), and the
        # lock that makes concurrent scrapes wait for one reading instead of each doing one.
        self.gauges_read_at: datetime | None = None
        self.gauges_lock = asyncio.Lock()
        # The labelled children the hot path updates per job, looked up once: ``labels()``
        # takes a lock and builds a key each call (about 3 µs; the child's own update 0.6).
        self._transition_children: dict[tuple[str, str], Any] = {}
        self._duration_children: dict[tuple[str, str], Any] = {}

    # --- recording helpers (one line at each call site) -----------------------------------

    def transition(self, source: str, target: str) -> None:
        child = self._transition_children.get((source, target))
        if child is None:
            child = self.transitions.labels(from_state=source, to_state=target)
            self._transition_children[(source, target)] = child
        child.inc()

    def job_took(self, job_type: str, outcome: str, seconds: float) -> None:
        child = self._duration_children.get((job_type, outcome))
        if child is None:
            child = self.job_duration.labels(type=job_type, outcome=outcome)
            self._duration_children[(job_type, outcome)] = child
        child.observe(seconds)

    def admission(self, throttled: int, waits: tuple[tuple[str, float], ...]) -> None:
        """A relay's admission round (``storage.admission.Admitted``)."""
        if throttled:
            self.throttled.inc(throttled)
        for job_type, seconds in waits:
            self.admission_wait.labels(type=job_type).observe(seconds)

    def quarantined(self, source: str, reason: str) -> None:
        self.transition(source, "quarantined")
        self.quarantines.labels(cause=quarantine_cause(reason)).inc()

    # --- database gauges and exposition ---------------------------------------------------

    def set_database_gauges(
        self,
        by_state: dict[str, int],
        unpublished: int,
        oldest: datetime | None,
        now: datetime,
    ) -> None:
        from jobrelay.domain.states import JobState

        for state in JobState:
            self.jobs.labels(state=state.value).set(by_state.get(state.value, 0))
        self.outbox_unpublished.set(unpublished)
        age = (now - oldest).total_seconds() if oldest is not None else 0.0
        self.outbox_oldest_age.set(max(age, 0.0))

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def names(self) -> list[str]:
        """Every metric family name as exposed (counters with their ``_total``)."""
        return sorted(
            family.name + ("_total" if family.type == "counter" else "")
            for family in self.registry.collect()
        )


def quarantine_cause(reason: str) -> str:
    """A low-cardinality label for a quarantine reason."""
    if reason.startswith("attempts exhausted"):
        return "exhausted"
    if reason.startswith("invalid payload"):
        return "invalid"
    return "permanent"


class GaugeSource(Protocol):
    """What the database gauges are read through: a ``Runtime`` is one (named here, so that
    metrics, which every role imports, does not import the runtime that wires them)."""

    @property
    def metrics(self) -> Metrics: ...
    @property
    def store(self) -> StorePort: ...
    @property
    def clock(self) -> Callable[[], datetime]: ...


async def refresh_database_gauges(rt: GaugeSource, max_age: float = 0.0) -> None:
    """Set the gauges read from the database: jobs by state, outbox backlog and its age;
    unless they were read (or tried) less than ``max_age`` seconds ago."""
    from jobrelay.storage.admin import AdminQueries

    metrics = rt.metrics
    async with metrics.gauges_lock:
        now, last = rt.clock(), metrics.gauges_read_at
        if last is not None and 0 <= (now - last).total_seconds() < max_age:
            return
        metrics.gauges_read_at = now  # a failing database is not asked on every scrape either
        by_state = await rt.store.count_by_state()
        unpublished, oldest = await AdminQueries(rt.store).outbox_stats()
        metrics.set_database_gauges(by_state, unpublished, oldest, rt.clock())


def authorized(token: str | None, authorization: str | None) -> bool:
    """Whether a scrape may be served: no token configured, or ``Bearer <token>`` sent
    (compared in constant time)."""
    if token is None:
        return True
    scheme, _, given = (authorization or "").partition(" ")
    return scheme.lower() == "bearer" and secrets.compare_digest(
        given.strip().encode(), token.encode()
    )


# --- the --metrics-port server ----------------------------------------------------------------

Refresh = Callable[[], Awaitable[None]]


async def serve_metrics(
    metrics: Metrics,
    host: str,
    port: int,
    stop: asyncio.Event,
    *,
    refresh: Refresh | None = None,
    started: asyncio.Event | None = None,
    sock: socket.socket | None = None,
    token: str | None = None,
) -> None:
    """Answer ``GET /metrics`` (and ``/healthz``) on ``host:port`` until ``stop`` is set.

    A deliberately tiny HTTP/1.0 server: one request per connection, no keep-alive, nothing
    but two paths. A failing ``refresh`` (the database is down) still serves the counters.
    With ``token``, ``/metrics`` needs ``Authorization: Bearer <token>`` (else ``401``).
    """

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(10):
                request_line = await reader.readline()
                authorization = None
                while line := (await reader.readline()).strip():
                    name, _, value = line.decode("latin-1").partition(":")
                    if name.strip().lower() == "authorization":
                        authorization = value.strip()
            parts = request_line.decode("latin-1").split()
            method, path = (parts[0], parts[1].split("?")[0]) if len(parts) >= 2 else ("", "")
            if method not in ("GET", "HEAD") or path not in ("/metrics", "/healthz"):
                status, body, ctype = "404 Not Found", b"not found\n", "text/plain"
            elif path == "/healthz":
                status, body, ctype = "200 OK", b"ok\n", "text/plain"
            elif not authorized(token, authorization):
                status, body, ctype = (
                    "401 Unauthorized",
                    b"a metrics token is needed\n",
                    "text/plain",
                )
            else:
                if refresh is not None:
                    try:
                        await refresh()
                    except Exception as exc:
                        log.warning(
                            "metrics refresh failed: %s", exc, extra={"event": "metrics_refresh"}
                        )
                status, body, ctype = "200 OK", metrics.render(), CONTENT_TYPE
            head = (
                f"HTTP/1.0 {status}\r\nContent-Type: {ctype}\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
            )
            # HEAD (load balancers, uptime checks): the same headers, no body.
            writer.write(head.encode("latin-1") + (b"" if method == "HEAD" else body))
            await writer.drain()
        except (TimeoutError, ConnectionError, ValueError):  # ValueError: a line over 64 KiB
            pass
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    # ``sock``: bound by the caller before start-up, so a port in use is a one-line error.
    if sock is not None:
        server = await asyncio.start_server(handle, sock=sock)
    else:
        server = await asyncio.start_server(handle, host, port)
    log.info(
        "metrics served on %s:%d", host, port, extra={"event": "metrics_started", "port": port}
    )
    if started is not None:
        started.set()
    async with server:
        await stop.wait()
