"""The one settings object: read once from ``JOBRELAY_*`` and CLI options, frozen, passed down.

Every value has an environment variable and a CLI option of the same name. A bad value is a
``ConfigError`` that names the variable, so the CLI can print one line and exit non-zero
before anything is created.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import Field, ValidationError, ValidationInfo, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from jobrelay.errors import ConfigError

ENV_PREFIX = "JOBRELAY_"
# S3 bucket naming rules: 3-63 lowercase letters, digits, dots and hyphens, alnum at the ends.
_S3_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
_ID_SECRET = re.compile(r"[0-9a-fA-F]{64}")


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, frozen=True, extra="ignore")

    # The application whose jobs this process runs (pkg.module:attribute); none: the shipped one.
    app: str | None = None
    database_url: str = "sqlite:///./var/jobrelay.db"
    # "local", or the AMQP URL of RabbitMQ; several comma-separated URLs are the nodes of one
    # cluster, tried in turn (a lost connection moves to the next).
    broker_url: str = "local"
    # RabbitMQ's management API, for `broker declare` to show each queue's leader and members;
    # unset: http://host:15672 of each broker node, with the broker's credentials.
    broker_management_url: str | None = None
    # Cluster nodes holding each quorum queue (fewer when the cluster is smaller).
    quorum_group_size: int = Field(default=3, ge=1, le=7)
    results_url: str = "file://./var/exports"
    # The largest value a job may return, as JSON (``jobrelay.Result(value=…)``): it is kept
    # on the job's row; anything larger is an object to store, named by ``Result.key``.
    result_max_bytes: int = Field(default=256 * 1024, ge=1, le=64 * 1024 * 1024)
    # The most jobs one job may run after (``after=``): each is a row of its own, written in
    # the enqueue's transaction and read by ``ctx.dependencies()``.
    max_dependencies: int = Field(default=10_000, ge=1, le=100_000)
    max_attempts: int = Field(default=3, ge=1, le=100)
    retry_delays: Annotated[tuple[int, ...], NoDecode] = (5, 30)
    # A claimed job's lease; the heartbeat renews it every third of this.
    lease_seconds: float = Field(default=30.0, gt=0)
    # The broker window: deliveries a worker holds unsettled per queue, started or waiting
    # for a slot; a full window keeps the next batch at hand and lets acks go as one frame.
    prefetch: int = Field(default=256, ge=1, le=5000)
    # Jobs a worker runs at once per queue (capped by ``prefetch``); each is claimed only
    # when it has a slot, so a crash never spends an attempt of a job that was not started.
    # A def job's delivery waiting for a thread gives its slot up meanwhile.
    concurrency: int = Field(default=16, ge=1, le=1000)
    # Threads that run plain ``def`` jobs, per worker (its own pool, shared by its queues).
    sync_threads: int = Field(default=8, ge=1, le=256)
    # Abandoned def job bodies (past their time limit, lease or cancel; a thread cannot be
    # interrupted) a worker replaces with new threads while they run on; past it they keep
    # their threads, and def jobs wait (unclaimed) once none is left.
    sync_abandoned_max: int = Field(default=8, ge=0, le=256)
    # A worker's event loop answering its watchdog later than this is logged (loop_blocked),
    # naming the async def job that blocks it.
    loop_lag_warn_seconds: float = Field(default=1.0, gt=0, le=300)
    # How often, at most, a worker asks whether an operator cancelled a running job: its
    # lease renewal carries the answer, and is sent at least this often while a job runs.
    cancel_check_seconds: float = Field(default=2.0, gt=0, le=300)
    # The time limit of an attempt of a job type without its own ``timeout=``; none: no limit.
    job_timeout: float | None = Field(default=None, gt=0)
    # Claims and completions of concurrent deliveries share one statement each (SQLite: one
    # write transaction each).
    batching: bool = True
    # Crash-loop backstop on the work queue (RabbitMQ x-delivery-limit; local transport too).
    # Every worker death or connection cut counts once for EVERY message the worker held,
    # started or waiting in its window, so it sits far above what deaths can add up to for a
    # waiting message; the attempt counter (``max_attempts``) quarantines a crash-looping job.
    delivery_limit: int = Field(default=50, ge=1)
    confirm_timeout: float = Field(default=10.0, gt=0)
    relay_batch: int = Field(default=200, ge=1, le=10_000)
    # Rows a relay may have published and not yet confirmed and marked: it claims the next
    # batch while earlier batches' confirms are pending, up to this many rows in flight.
    relay_window: int = Field(default=1000, ge=1, le=100_000)
    # Fair types (``@app.job(fair_by=…)``): how many of a type's jobs the relay admits ahead
    # of their end. Above every worker's slots for the type, so none waits idle; below a
    # backlog, so the turns across keys decide what the broker gets next.
    fair_ahead: int = Field(default=512, ge=1, le=100_000)
    # Prioritized queues (a type on it declared ``@app.job(priority=…)``): how many of the
    # queue's jobs the relay admits ahead of their end. The bound on how many jobs already in
    # the broker's FIFO queue a newly enqueued job of higher priority waits behind; keep it
    # above the slots the workers of the queue have, so none waits idle.
    priority_ahead: int = Field(default=128, ge=1, le=100_000)
    relay_poll_seconds: float = Field(default=1.0, gt=0)
    # How often a worker reads which queues an operator paused (``jobrelay queues pause``).
    queue_pause_poll_seconds: float = Field(default=2.0, gt=0, le=60)
    # How often each worker and relay writes its heartbeat row (the overview's processes).
    heartbeat_seconds: float = Field(default=5.0, gt=0, le=300)
    # How long a relay owns the outbox rows it claimed before another relay may take them.
    relay_claim_seconds: float = Field(default=30.0, gt=0)
    # Local transport: how long a delivery stays invisible to other consumers without a renewal.
    visibility_seconds: float = Field(default=30.0, gt=0)
    # How long SIGTERM lets in-flight deliveries finish before the process stops without
    # settling the rest (they are delivered again). On RabbitMQ a stopped consumer's channel
    # stays open this long too, so a delivery finished while draining can still be acked.
    drain_seconds: float = Field(default=60.0, gt=0)
    # The relay's reconciler: how often it runs (0: never), and how far past its due time a
    # lease, a retry or an unpublished outbox row must be before it is repaired or reported.
    reconcile_seconds: float = Field(default=30.0, ge=0)
    reconcile_grace_seconds: float = Field(default=60.0, ge=0)
    # Retention: finished jobs (succeeded, cancelled) with their events, effects rows and
    # result objects, published outbox rows and dead-lettered local-queue rows are deleted
    # this many days after they last changed (fractions allowed: a soak test uses minutes).
    retention_days: float = Field(default=30.0, gt=0)
    # Leave result objects in place when their job is pruned (a bucket lifecycle rule
    # deletes them instead).
    retention_keep_results: bool = False
    # When the PostgreSQL server runs without autovacuum, the reconciler leader vacuums
    # jobrelay's churning tables after each prune (storage/vacuum.py); false: never.
    self_vacuum: bool = True
    # Periodic jobs: which ticks missed while no scheduler ran are still enqueued when one
    # comes back: "last" (only the latest), "all", or a window such as 15m, 2h or 1d. The
    # others are skipped and recorded in an event (docs/how-to/periodic-jobs.md).
    schedule_catchup: str = "last"
    faults: str = ""
    log_level: str = "INFO"
    # json (one object per line) or text (one line for people); unset: text when stderr is
    # a terminal, json otherwise (observe.logs).
    log_format: Literal["json", "text"] | None = None
    # OpenTelemetry (observe.tracing; the exporter is named by the OTEL_* variables): a run's
    # span LINKED to the job's enqueue span, or a CHILD of it; the account on spans as a
    # hash, or omitted.
    otel_parent: Literal["link", "child"] = "link"
    otel_account: Literal["hash", "omit"] = "hash"
    # Where `job show` and the console link a trace: a URL with {trace_id} in it
    # (https://tempo.example/trace/{trace_id}); unset: the trace id alone.
    trace_url: str | None = None
    # S3-compatible endpoint for s3:// results (MinIO, Ceph, moto); unset means AWS itself.
    # Credentials and region come from the standard AWS variables, never from here.
    s3_endpoint_url: str | None = None
    # Outgoing mail for notify.email jobs: smtp://[user:pass@]host[:port] or smtps://…
    smtp_url: str | None = None
    mail_from: str | None = Field(default=None, validate_default=True)
    # The reverse proxies whose X-Forwarded-For/-Proto the API believes (comma-separated IPs
    # or networks); none by default, so a client cannot claim another address or scheme.
    trusted_proxies: str = ""
    # Per token and API process, on job creation and admin actions: RATE/second|minute|hour
    # with an optional :BURST (100/second:300), or off.
    rate_limit: str = "10/second:100"
    # Unfinished jobs (queued, delayed, running, waiting to retry) one account may keep: a
    # job over it is refused (429) on every API route that accepts jobs; 0: no quota.
    account_max_unfinished_jobs: int = Field(default=100_000, ge=0)
    # Per client address and API process: requests whose token is not valid (each one a
    # database lookup); the same form, or off.
    auth_failure_limit: str = "1/second:30"
    # /metrics: the database gauges (a GROUP BY over the jobs) are read at most once per
    # this many seconds whatever the scrape rate (0: on every scrape); and, when a token is
    # set, only a request with "Authorization: Bearer <it>" is served.
    metrics_cache_seconds: float = Field(default=5.0, ge=0, le=3600)
    metrics_token: str | None = None
    # The secret job ids are keyed with, 64 hex characters, instead of the one the database
    # keeps (``installation``): for operators who keep secrets outside the database. Every
    # process of an installation must then have the same value; rotate it by changing it.
    id_secret: str | None = Field(default=None, repr=False)
    # The API's HTTP server, before a request reaches the application (processes/http_guard.py):
    # the most bytes of a request line and headers (431 beyond), how long a new connection,
    # or a next request on a kept-alive one, has to send its whole head (closed after), and
    # how many connections one API process holds at once (503 beyond).
    api_max_head_bytes: int = Field(default=32 * 1024, ge=1024, le=1024 * 1024)
    api_head_timeout_seconds: float = Field(default=10.0, gt=0, le=300)
    api_max_connections: int = Field(default=1000, ge=1, le=100_000)
    # How long a request's body has from the end of its head (408 and closed after); how
    # long a response may wait for a client that takes none of it (dropped after); and how
    # many connections one client address holds at once (503 beyond; the trusted proxies'
    # addresses are not capped).
    api_body_timeout_seconds: float = Field(default=30.0, gt=0, le=3600)
    api_write_timeout_seconds: float = Field(default=30.0, gt=0, le=3600)
    api_max_connections_per_address: int = Field(default=100, ge=1, le=100_000)
    # Where people reach the API; links in e-mails are built from it.
    public_url: str = "http://127.0.0.1:8000"

    @field_validator("retry_delays", mode="before")
    @classmethod
    def _parse_delays(cls, value: Any) -> Any:
        if isinstance(value, str):
            parts = [p.strip() for p in value.split(",") if p.strip()]
            try:
                value = tuple(int(p) for p in parts)
            except ValueError:
                raise ValueError(f"expected comma-separated whole seconds, got {value!r}") from None
        if not value:
            raise ValueError("at least one delay is required")
        if any(d <= 0 for d in value):
            raise ValueError("delays must be positive whole seconds")
        return value

    @field_validator("trace_url")
    @classmethod
    def _trace_url(cls, value: str | None) -> str | None:
        if value is not None and "{trace_id}" not in value:
            raise ValueError("expected a URL with {trace_id} in it")
        return value

    @field_validator("schedule_catchup")
    @classmethod
    def _check_catchup(cls, value: str) -> str:
        from jobrelay.domain.schedules import Catchup

        Catchup.parse(value)
        return value.strip().lower()

    @field_validator("log_level")
    @classmethod
    def _check_log_level(cls, value: str) -> str:
        levels = ("DEBUG", "INFO", "WARNING", "ERROR")
        if value.upper() not in levels:
            raise ValueError(f"expected one of {', '.join(levels)}, got {value!r}")
        return value.upper()

    @field_validator("faults")
    @classmethod
    def _check_faults(cls, value: str) -> str:
        from jobrelay.observe.faults import parse

        try:
            parse(value)
        except ConfigError as exc:
            raise ValueError(exc.problem) from None
        return value

    @field_validator("database_url")
    @classmethod
    def _check_database_url(cls, value: str) -> str:
        scheme = urlsplit(value).scheme
        if scheme not in {"sqlite", "sqlite+aiosqlite", "postgresql", "postgresql+asyncpg"}:
            raise ValueError(f"expected sqlite:///PATH or postgresql://…, got {value!r}")
        try:
            check_database_url(value)
        except ConfigError as exc:
            raise ValueError(exc.problem) from None
        return value

    @field_validator("broker_url")
    @classmethod
    def _check_broker_url(cls, value: str) -> str:
        if value == "local":
            return value
        from jobrelay.transport.rabbit_nodes import split_broker_urls

        return ",".join(split_broker_urls(value))

    @field_validator("rate_limit", "auth_failure_limit")
    @classmethod
    def _check_rate_limit(cls, value: str) -> str:
        from jobrelay.api.buckets import parse_limit

        parse_limit(value)
        return value.strip()

    @field_validator("metrics_token")
    @classmethod
    def _check_metrics_token(cls, value: str | None) -> str | None:
        if value is not None and (len(value) < 16 or not value.isprintable() or " " in value):
            raise ValueError("expected at least 16 visible characters and no spaces")
        return value

    @field_validator("id_secret")
    @classmethod
    def _check_id_secret(cls, value: str | None) -> str | None:
        if value is None:
            return None
        if not _ID_SECRET.fullmatch(value):
            raise ValueError(
                "expected 64 hexadecimal characters (32 bytes, e.g. `openssl rand -hex 32`)"
            )
        return value.lower()

    @field_validator("trusted_proxies")
    @classmethod
    def _check_proxies(cls, value: str) -> str:
        import ipaddress

        parts = [p.strip() for p in value.split(",") if p.strip()]
        for part in parts:
            if part == "*":
                continue
            try:
                ipaddress.ip_network(part, strict=False)
            except ValueError:
                raise ValueError(
                    f"expected comma-separated IP addresses or networks (or *), got {part!r}"
                ) from None
        return ",".join(parts)

    @field_validator("broker_management_url")
    @classmethod
    def _check_management_url(cls, value: str | None) -> str | None:
        if value is None:
            return value
        for part in value.split(","):
            parts = urlsplit(part.strip())
            if parts.scheme not in {"http", "https"} or not parts.hostname:
                raise ValueError(f"expected http(s)://host:15672[,…], got {redact_url(part)!r}")
        return value

    @field_validator("results_url")
    @classmethod
    def _check_results_url(cls, value: str) -> str:
        parts = urlsplit(value)
        if parts.scheme == "s3":
            if not _S3_BUCKET.fullmatch(parts.netloc) or parts.query or parts.fragment:
                raise ValueError(
                    f"expected s3://bucket[/prefix] with a valid bucket name, got {value!r}"
                )
            return value
        if parts.scheme != "file" or not (parts.netloc + parts.path):
            raise ValueError(f"expected file://PATH or s3://bucket[/prefix], got {value!r}")
        return value

    @field_validator("s3_endpoint_url")
    @classmethod
    def _check_s3_endpoint_url(cls, value: str | None) -> str | None:
        if value is None:
            return None
        parts = urlsplit(value)
        if parts.scheme not in {"http", "https"} or not parts.hostname:
            raise ValueError(f"expected http(s)://host[:port], got {redact_url(value)!r}")
        return value

    @field_validator("smtp_url")
    @classmethod
    def _check_smtp_url(cls, value: str | None) -> str | None:
        if value is None:
            return None
        parts = urlsplit(value)
        try:
            parts.port  # noqa: B018 - raises on a non-numeric port
        except ValueError:
            parts = parts._replace(scheme="")
        if parts.scheme not in {"smtp", "smtps"} or not parts.hostname:
            raise ValueError(
                f"expected smtp://host:port or smtps://host:port, got {redact_url(value)!r}"
            )
        return value

    @field_validator("mail_from")
    @classmethod
    def _check_mail_from(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is None:
            if info.data.get("smtp_url"):
                raise ValueError(
                    "required when JOBRELAY_SMTP_URL is set (e.g. jobrelay@example.com)"
                )
            return None
        from jobrelay.domain.effects import check_address

        return check_address(value)

    @field_validator("public_url")
    @classmethod
    def _check_public_url(cls, value: str) -> str:
        parts = urlsplit(value)
        if parts.scheme not in {"http", "https"} or not parts.hostname or parts.query:
            raise ValueError(f"expected http(s)://host[:port][/path], got {value!r}")
        return value.rstrip("/")

    @property
    def uses_local_broker(self) -> bool:
        return self.broker_url == "local"

    @property
    def id_secret_key(self) -> bytes | None:
        """``JOBRELAY_ID_SECRET`` as the bytes ids are keyed with; None: the stored one."""
        return None if self.id_secret is None else bytes.fromhex(self.id_secret)

    def redacted(self) -> dict[str, Any]:
        """Settings safe to log: passwords in URLs, the metrics token and the id secret
        replaced."""
        out = self.model_dump()
        for key in ("metrics_token", "id_secret"):
            if out[key] is not None:
                out[key] = "***"
        keys = ("database_url", "broker_url", "broker_management_url", "results_url")
        for key in (*keys, "s3_endpoint_url", "smtp_url"):
            if out[key] is not None:
                out[key] = redact_url(out[key])
        return out


def check_database_url(database_url: str) -> None:
    """Refuse, with a ``ConfigError``, a database URL SQLAlchemy would fail on with a bare
    ``ValueError`` (``invalid literal for int()``).

    Several PostgreSQL hosts are given in libpq's form (``h1:5432,h2:5432``, a primary and its
    standbys): each port must be a number. ``storage.engine.sqlalchemy_url`` turns the form
    into SQLAlchemy's. The message never repeats the URL (it may hold a password).
    """
    parts = urlsplit(database_url)
    hosts = parts.netloc.rpartition("@")[2]
    for host in hosts.split(",") if "," in hosts else [hosts]:
        port = host.rpartition(":")[2] if ":" in host and not host.endswith("]") else ""
        if "," in hosts and not host:
            raise ConfigError(ENV_PREFIX + "DATABASE_URL", "an empty host in the list of hosts")
        if port and not (port.isdigit() and int(port) <= 65535):
            raise ConfigError(
                ENV_PREFIX + "DATABASE_URL", "the port is not a number from 0 to 65535"
            )


def redact_url(url: str) -> str:
    """The URL (or comma-separated URLs) with any password replaced by ***."""
    if "," in url:
        return ",".join(redact_url(part) for part in url.split(","))
    parts = urlsplit(url)
    if parts.password:
        return url.replace(f":{parts.password}@", ":***@", 1)
    return url


def load_settings(**overrides: Any) -> Settings:
    """Build Settings from the environment plus non-None overrides (CLI options)."""
    given = {k: v for k, v in overrides.items() if v is not None}
    try:
        return Settings(**given)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = str(first["loc"][0]) if first["loc"] else "settings"
        message = str(first["msg"]).removeprefix("Value error, ")
        raise ConfigError(ENV_PREFIX + field.upper(), message) from None
