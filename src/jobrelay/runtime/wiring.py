"""Wiring: turn one Settings into the live adapters, and check they answer before anything runs.

This is the only module that chooses between adapters (SQLite or PostgreSQL, local or
RabbitMQ). The relay, worker and API receive a ``Runtime`` and never look at URLs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime

from sqlalchemy import inspect, text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncEngine

from jobrelay.database_files import require_database
from jobrelay.errors import ConfigError, StoreError, TransportError
from jobrelay.library.app import App
from jobrelay.library.loader import load_app
from jobrelay.observe.faults import ConnectionCut, Faults
from jobrelay.observe.metrics import Metrics
from jobrelay.results.base import ResultStore
from jobrelay.results.files import FileResults
from jobrelay.settings import Settings
from jobrelay.storage.engine import (
    SCHEMA_HEAD,
    VERSION_TABLE,
    check_reachable,
    create_engine,
    failover_error,
    first_line,
)
from jobrelay.storage.port import StorePort
from jobrelay.storage.store import Store
from jobrelay.transport.base import Transport
from jobrelay.transport.topology import Topology

Clock = Callable[[], datetime]

log = logging.getLogger("jobrelay.start")


def utc_now() -> datetime:
    return datetime.now(UTC)


@dataclass
class Runtime:
    settings: Settings
    engine: AsyncEngine
    store: StorePort
    transport: Transport
    results: ResultStore
    faults: Faults
    topology: Topology
    clock: Clock = field(default=utc_now)
    metrics: Metrics = field(default_factory=Metrics)
    # The application whose jobs run here (``--app``); None in tests that wire a registry.
    app: App | None = None
    # Every retry waits in the database until due, then goes to its work queue (never a
    # delay queue): a test's fake clock decides when it is due (``jobrelay.testing``).
    hold_retries: bool = False

    def job_app(self) -> App:
        """``app``, or (a runtime built without one) the app the settings name."""
        return self.app if self.app is not None else load_app(self.settings.app)


def topology_for(settings: Settings, app: App | None = None) -> Topology:
    """The broker names in force: an app's own retry delays each get a tier too, and each
    queue its job types use gets a work queue and tiers of its own."""
    if app is None:
        return Topology(
            retry_delays=settings.retry_delays,
            delivery_limit=settings.delivery_limit,
            quorum_size=settings.quorum_group_size,
            dynamic_delays=settings.uses_local_broker,
        )
    return Topology(
        retry_delays=app.retry_tiers(settings),
        delivery_limit=settings.delivery_limit,
        queues=app.queues,
        quorum_size=settings.quorum_group_size,
        dynamic_delays=settings.uses_local_broker,
    )


def build_transport(
    settings: Settings, engine: AsyncEngine, clock: Clock = utc_now, app: App | None = None
) -> Transport:
    topology = topology_for(settings, app)
    if settings.uses_local_broker:
        from jobrelay.transport.local import LocalTransport

        return LocalTransport(
            engine, topology, visibility_seconds=settings.visibility_seconds, clock=clock
        )
    from jobrelay.transport.rabbitmq import RabbitTransport

    # A worker draining after SIGTERM acks on the channel its deliveries came on: keep that
    # channel settleable for as long as the drain may last.
    return RabbitTransport(
        settings.broker_url,
        topology,
        confirm_timeout=settings.confirm_timeout,
        settle_grace_seconds=settings.drain_seconds,
    )


def build_results(settings: Settings) -> ResultStore:
    if settings.results_url.startswith("s3://"):
        from jobrelay.results.s3 import S3Results

        return S3Results(settings.results_url, endpoint_url=settings.s3_endpoint_url)
    return FileResults(settings.results_url)


async def schema_revision(engine: AsyncEngine) -> str | None:
    """The revision the database is at (Alembic's ``alembic_version``), or None."""
    async with engine.connect() as conn:
        if not await conn.run_sync(lambda sync: inspect(sync).has_table(VERSION_TABLE)):
            return None
        revision = await conn.scalar(text(f"SELECT version_num FROM {VERSION_TABLE}"))
        return None if revision is None else str(revision)


async def check_schema(engine: AsyncEngine) -> None:
    """Refuse to run on a schema that is not the one this code was written for.

    Compared with ``SCHEMA_HEAD``, not with Alembic's script directory, so that a worker
    does not import Alembic (and Mako) to start: a test keeps the two the same.
    """
    current = await schema_revision(engine)
    if current != SCHEMA_HEAD:
        raise ConfigError(
            "JOBRELAY_DATABASE_URL",
            f"schema is at {current or 'nothing'}, expected {SCHEMA_HEAD}: "
            "run `jobrelay db upgrade`",
        )


@contextlib.asynccontextmanager
async def open_runtime(
    settings: Settings,
    *,
    connect_transport: bool = True,
    clock: Clock | None = None,
    faults: Faults | None = None,
    app: App | None = None,
) -> AsyncIterator[Runtime]:
    """Open the database and broker, failing fast with the variable to fix.

    ``clock`` (tests) drives both this process and the store. Without it the store judges
    leases and due times by the database's clock on PostgreSQL, never by this host's.
    ``app``: the jobs' App itself, instead of ``settings.app`` (``jobrelay.testing``).
    """
    store_clock = clock
    clock = clock or utc_now
    app = load_app(settings.app) if app is None else app
    engine = create_engine(settings.database_url)
    transport: Transport | None = None
    results: ResultStore | None = None
    try:
        transport = build_transport(settings, engine, clock, app)
        # A remote broker is checked first, so an unreachable one fails before the database
        # is touched; the local transport lives in the database and must come after it.
        if connect_transport and not settings.uses_local_broker:
            await _connect(transport)
        require_database(settings.database_url)  # before SQLite would create the file
        store = Store(engine, clock=store_clock, id_secret=settings.id_secret_key)
        faults = faults if faults is not None else Faults(settings.faults)
        local = transport if connect_transport and settings.uses_local_broker else None
        await _check_database(engine, app, local, store, faults)
        # Not probed here: an unreachable S3 endpoint is a transient failure of the jobs
        # that write to it (retried), never a reason for a worker not to start.
        results = build_results(settings)
        yield Runtime(
            settings=settings,
            engine=engine,
            store=store,
            transport=transport,
            results=results,
            faults=faults,
            topology=topology_for(settings, app),
            clock=clock,
            app=app,
        )
    finally:
        if results is not None:
            with contextlib.suppress(Exception):
                await results.aclose()
        if transport is not None:
            with contextlib.suppress(Exception):
                await transport.close()
        await engine.dispose()


# A database this process found that goes away during its own start-up is an outage (a
# failover: pg_auto_failover promotes a standby in 10-30 s), not a wrong setting: waited out
# for this long, as a running process waits one out, before the process gives up (exit 2).
START_OUTAGE_SECONDS = 60.0


async def _check_database(
    engine: AsyncEngine,
    app: App,
    local: Transport | None,
    store: StorePort,
    faults: Faults,
    outage_seconds: float = START_OUTAGE_SECONDS,
) -> None:
    """The database's start-up checks (and the local transport's, which lives in it).

    A database never reached fails at once: that is a setting to fix. One that answered
    and then dropped the connection (or now answers as a standby) is checked again from the
    start, with a pause, until it answers or ``outage_seconds`` have passed. So is a URL of
    several hosts none of which answers at all (refused, timed out): that is a primary and
    its standbys mid-failover, the old primary gone and the new one not yet taking
    connections (a process restarted then exited 2 in CI's failover soak), not a setting.
    """
    deadline: float | None = None
    pause = 0.1
    several_hosts = isinstance(engine.url.query.get("host"), tuple)
    gone = "the database went away during start-up"
    while True:
        try:
            try:
                await check_reachable(engine)
            except StoreError as exc:
                if deadline is None:
                    mid_failover = several_hosts and went_away(exc)
                    if not (_answered(exc) or mid_failover):
                        # Never reached: a wrong URL, no server running.
                        raise ConfigError("JOBRELAY_DATABASE_URL", str(exc)) from None
                    # It answered, then closed the connection mid-query (a failover), or
                    # no host of several answers yet.
                    if not _answered(exc):
                        gone = "no host of several answered at start-up"
                    deadline = time.monotonic() + outage_seconds
                raise
            if deadline is None:
                deadline = time.monotonic() + outage_seconds
            await check_schema(engine)
            try:
                await faults.ahit("start.after_schema")
            except ConnectionCut:
                # As a failover does, mid-start: the server ends the pool's sessions (the one
                # held here among them; the cut's own is spared, it is the one asking).
                async with engine.connect():
                    await store.cut_sessions()
            await _create_tables(engine, app)
            if local is not None:
                await _connect(local)
            return
        # OSError: a connection the driver could not even open (refused, timed out, the
        # server mid-failover); SQLAlchemy passes that through unwrapped.
        except (ConfigError, StoreError, DBAPIError, OSError) as exc:
            if deadline is None or not (isinstance(exc, StoreError) or went_away(exc)):
                raise
            if time.monotonic() >= deadline:
                raise ConfigError(
                    "JOBRELAY_DATABASE_URL",
                    f"{gone} and did not answer again in {outage_seconds:g} s: {first_line(exc)}",
                ) from None
            log.warning(
                "%s, checking again: %s",
                gone,
                first_line(exc),
                extra={"event": "start_database_wait"},
            )
            await asyncio.sleep(pause)
            pause = min(pause * 2, 2.0)


def _answered(exc: BaseException) -> bool:
    """Whether the server was reached before ``exc``: the driver's error says a connection
    it had was lost, or that the server is not the primary now (not a connect that failed,
    which is a bare ``OSError``)."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, DBAPIError) and (
            seen.connection_invalidated or failover_error(seen.orig)
        ):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def went_away(exc: BaseException) -> bool:
    """Whether a lost connection, or a server that is not the primary now, is behind
    ``exc`` (anywhere in its chain: the start-up checks wrap the driver's error)."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, OSError):  # refused, reset or timed out: no answer at all
            return True
        seen = seen.__cause__ or seen.__context__
    return _answered(exc)


async def _create_tables(engine: AsyncEngine, app: App) -> None:
    try:
        await app.create_tables(engine)
    except DBAPIError as exc:  # a least-privileged role (db grant) may not CREATE
        if went_away(exc):
            raise
        first = str(exc.orig).strip().splitlines()[0] if exc.orig else type(exc).__name__
        raise ConfigError(
            "JOBRELAY_DATABASE_URL",
            f"the application's tables are missing and cannot be created ({first}): "
            "run `jobrelay db upgrade` as the schema's owner",
        ) from None


async def _connect(transport: Transport) -> None:
    try:
        await transport.connect()
    except TransportError as exc:
        # A broker that answered and refused the topology is no unreachable one.
        refused = str(exc).startswith("topology mismatch")
        reason = str(exc) if refused else f"broker unreachable: {exc}"
        raise ConfigError("JOBRELAY_BROKER_URL", reason) from None
