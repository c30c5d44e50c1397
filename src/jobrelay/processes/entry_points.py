"""The async entry points behind the CLI: one function per process or set-up step."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from jobrelay.database_files import new_database, require_database
from jobrelay.processes.listen import listen_socket
from jobrelay.runtime.wiring import Runtime, open_runtime, schema_revision, topology_for
from jobrelay.settings import Settings
from jobrelay.storage.engine import check_reachable, create_engine, upgrade_async

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncEngine

    from jobrelay.storage.grants import Granted

log = logging.getLogger("jobrelay")


async def serve_api(settings: Settings, host: str, port: int, stop: asyncio.Event) -> None:
    from jobrelay.processes.api_server import build_server, serve_until

    sock = listen_socket(host, port)  # a busy port fails before the database is touched
    with sock:
        # The intake: the accepts' own connections (``Driver.write_new_job``).
        async with open_runtime(settings) as rt, rt.store.intake_connections():
            await open_pool(rt)
            await serve_until(build_server(rt, host, port), stop, sock)


async def open_pool(rt: Runtime) -> None:
    """Open the PostgreSQL pool's connections before the first request rather than during
    the first burst, where each one waits for a backend to start (the slowest answers).
    Best effort: a connection that fails now is opened later, on demand, as before."""
    size = getattr(rt.engine.pool, "size", None)
    if not rt.store.capabilities.prewarms or size is None:
        return
    async with contextlib.AsyncExitStack() as opened:
        await asyncio.gather(
            *(opened.enter_async_context(rt.engine.connect()) for _ in range(size())),
            return_exceptions=True,
        )


@dataclass(frozen=True)
class MetricsAddress:
    host: str
    port: int

    def listen(self) -> socket.socket:
        return listen_socket(
            self.host, self.port, host_option="--metrics-host", port_option="--metrics-port"
        )


async def run_relay(
    settings: Settings, stop: asyncio.Event, metrics_at: MetricsAddress | None = None
) -> None:
    """The relay, its reconciler (one leader at a time), the app's scheduler (every relay
    runs one: a tick is one job by its key), and optionally a metrics port."""
    from jobrelay.maintenance.reconcile import Reconciler
    from jobrelay.maintenance.scheduler import Scheduler
    from jobrelay.observe.metrics import refresh_database_gauges
    from jobrelay.relay.publisher import Relay

    sock = metrics_at.listen() if metrics_at is not None else None  # before connecting
    async with open_runtime(settings) as rt:
        parts = {
            "relay": Relay(rt).run(stop),
            "reconciler": Reconciler(rt).run(stop),
            "scheduler": Scheduler(rt).run(stop),
        }
        if sock is not None:
            parts["metrics"] = _metrics_server(rt, sock, stop, refresh_database_gauges)
        await run_parts(parts, stop)


async def run_worker(
    settings: Settings,
    stop: asyncio.Event,
    metrics_at: MetricsAddress | None = None,
    queues: Sequence[str] = (),
) -> None:
    """A worker of ``queues`` (each with its own prefetch), or of every queue of the app."""
    from jobrelay.library.loader import load_app
    from jobrelay.worker.consumer import Worker, check_queues

    # Before connecting anywhere: a mistyped --queue is a usage error, not an outage.
    check_queues(queues, topology_for(settings, load_app(settings.app)).queues)
    sock = metrics_at.listen() if metrics_at is not None else None
    async with open_runtime(settings) as rt:
        parts = {"worker": Worker(rt, queues=queues or None).run(stop)}
        if sock is not None:
            parts["metrics"] = _metrics_server(rt, sock, stop)
        await run_parts(parts, stop)


def _metrics_server(
    rt: Runtime,
    sock: socket.socket,
    stop: asyncio.Event,
    refresh: Callable[[Runtime, float], Awaitable[None]] | None = None,
) -> Coroutine[Any, Any, None]:
    from jobrelay.observe.metrics import serve_metrics

    host, port = sock.getsockname()[:2]
    max_age = rt.settings.metrics_cache_seconds
    return serve_metrics(
        rt.metrics,
        host,
        port,
        stop,
        refresh=(lambda: refresh(rt, max_age)) if refresh else None,
        sock=sock,
        token=rt.settings.metrics_token,
    )


async def run_parts(parts: dict[str, Coroutine[Any, Any, None]], stop: asyncio.Event) -> None:
    """Run the parts of one process together; one that dies stops the others (and fails)."""
    tasks = {name: asyncio.create_task(coro) for name, coro in parts.items()}
    for name, task in tasks.items():
        task.add_done_callback(_stop_if_dead(name, stop))
    try:
        await asyncio.gather(*tasks.values(), return_exceptions=True)
    finally:
        stop.set()
        await asyncio.gather(*tasks.values(), return_exceptions=True)
    failed = [n for n, t in tasks.items() if not t.cancelled() and t.exception()]
    if failed:
        raise SystemExit(f"jobrelay: error: {', '.join(failed)} died; see the log above")


async def run_up(settings: Settings, host: str, port: int, stop: asyncio.Event) -> None:
    """API, relay and worker sharing one runtime; the API stops first, then both drain."""
    sock = listen_socket(host, port)  # before the schema, the relay and the worker
    with sock:
        await _run_up(settings, host, port, stop, sock)


async def _run_up(
    settings: Settings, host: str, port: int, stop: asyncio.Event, sock: socket.socket
) -> None:
    from jobrelay.maintenance.reconcile import Reconciler
    from jobrelay.maintenance.scheduler import Scheduler
    from jobrelay.processes.api_server import build_server, serve_until
    from jobrelay.relay.publisher import Relay
    from jobrelay.worker.consumer import Worker

    await upgrade_database(settings)
    async with open_runtime(settings) as rt, rt.store.intake_connections():
        parts = {
            "relay": asyncio.create_task(Relay(rt).run(stop)),
            "worker": asyncio.create_task(Worker(rt).run(stop)),
            "reconciler": asyncio.create_task(Reconciler(rt).run(stop)),
            "scheduler": asyncio.create_task(Scheduler(rt).run(stop)),
        }
        for name, task in parts.items():
            task.add_done_callback(_stop_if_dead(name, stop))
        announce(start_line(settings, rt, sock))
        try:
            await serve_until(build_server(rt, host, port), stop, sock)
        finally:
            stop.set()
            await asyncio.gather(*parts.values(), return_exceptions=True)
        failed = [n for n, t in parts.items() if not t.cancelled() and t.exception()]
        if failed:
            raise SystemExit(f"jobrelay: error: {', '.join(failed)} died; see the log above")


def announce(line: str) -> None:
    """``up``'s start line, as a log record (every line a process logs is JSON, for whatever
    collects them) and, for a person at a terminal, as plain text on stdout too."""
    log.info(line, extra={"event": "up_listening"})
    if sys.stdout.isatty():
        print(line, flush=True)


def start_line(settings: Settings, rt: Runtime, sock: socket.socket) -> str:
    """What ``up`` tells the person who started it: where to point a browser, which app runs
    which job types, and on what."""
    from jobrelay.library.loader import DEFAULT_APP
    from jobrelay.settings import redact_url

    bound_host, bound_port = sock.getsockname()[:2]
    shown_host = f"[{bound_host}]" if ":" in bound_host else bound_host
    url = f"http://{shown_host}:{bound_port}"
    app = rt.job_app()
    types = sorted({*app.jobs, *app.included_types})
    transport = (
        "the local transport"
        if settings.uses_local_broker
        else f"RabbitMQ {redact_url(settings.broker_url)}"
    )
    return (
        f"jobrelay up: listening on {url} (console {url}/console, API docs {url}/docs); "
        f"app {settings.app or DEFAULT_APP} ({', '.join(types) or 'no job types'}); "
        f"database {redact_url(settings.database_url)}; {transport}; Ctrl-C stops"
    )


def _stop_if_dead(name: str, stop: asyncio.Event) -> Callable[[asyncio.Task[None]], None]:
    """In ``up``, a relay or worker that dies must take the API down with it: a process that
    answers 202 while nothing delivers its jobs would hide the failure."""

    def check(task: asyncio.Task[None]) -> None:
        if not stop.is_set() and not task.cancelled():
            log.error(
                "%s stopped unexpectedly: %r",
                name,
                task.exception(),
                extra={"event": "component_died", "component": name},
            )
            stop.set()

    return check


@contextlib.asynccontextmanager
async def _reachable_database(settings: Settings) -> AsyncIterator[AsyncEngine]:
    """An engine on a database that answers (else the one-line JOBRELAY_DATABASE_URL error),
    disposed afterwards: for the one-shot set-up commands."""
    from jobrelay.errors import ConfigError, StoreError

    engine = create_engine(settings.database_url)
    try:
        try:
            await check_reachable(engine)
        except StoreError as exc:
            raise ConfigError("JOBRELAY_DATABASE_URL", str(exc)) from None
        yield engine
    finally:
        await engine.dispose()


async def upgrade_database(settings: Settings) -> str | None:
    from jobrelay.library.loader import load_app

    app = load_app(settings.app)
    # The file is created here if need be, and removed again if the upgrade fails.
    with new_database(settings.database_url):
        async with _reachable_database(settings) as engine:
            await upgrade_async(settings.database_url)
            # The application's own tables too, as the owner: a least-privileged runtime role
            # (``jobrelay db grant``) may not create them.
            await app.create_tables(engine)
            return await schema_revision(engine)


async def grant_role(settings: Settings, role: str) -> Granted:
    from jobrelay.library.loader import load_app
    from jobrelay.storage.grants import grant_runtime_role

    app = load_app(settings.app)
    require_database(settings.database_url)  # grants go on a database db upgrade made
    async with _reachable_database(settings) as engine:
        return await grant_runtime_role(engine, role, app.table_metadata)


async def declare_broker(settings: Settings) -> str:
    if settings.uses_local_broker:
        return "local transport: its queue is a table, created by `jobrelay db upgrade`"
    from jobrelay.errors import ConfigError, TransportError
    from jobrelay.library.loader import load_app
    from jobrelay.transport.rabbitmq import declare_topology
    from jobrelay.transport.topology import DEAD_LETTER_EXCHANGE, EXCHANGE

    topology = topology_for(settings, load_app(settings.app))
    from jobrelay.transport.rabbit_management import placements, render

    try:
        await declare_topology(settings.broker_url, topology)
    except TransportError as exc:
        # A broker that answered and refused the topology is no unreachable one.
        refused = str(exc).startswith("topology mismatch")
        reason = str(exc) if refused else f"broker unreachable: {exc}"
        raise ConfigError("JOBRELAY_BROKER_URL", reason) from None
    where = await placements(settings.broker_url, settings.broker_management_url, topology.names())
    declared = f"declared {EXCHANGE}, {DEAD_LETTER_EXCHANGE}, {', '.join(topology.names())}"
    return f"{declared}\n{render(where)}"


async def create_token(
    settings: Settings,
    account: str | None,
    admin: bool,
    label: str | None,
    expires_in: timedelta | None = None,
) -> str:
    from jobrelay.api.auth import hash_token, new_token

    token = new_token()
    async with open_runtime(settings, connect_transport=False) as rt:
        now = await rt.store.db_now()
        expires = None if expires_in is None else now + expires_in
        await rt.store.add_token(hash_token(token), account, admin, now, label, expires)
    return token
