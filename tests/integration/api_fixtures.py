"""Helpers for the HTTP API tests: a real Runtime on a real database, a controllable clock,
tokens, and a broker stand-in.

The readiness tests use the real ``LocalTransport``. Everywhere else ``ProbeTransport`` is
used, and it is not a fake broker: the API never publishes or consumes, it only asks the
transport whether the broker answers (``/readyz``), so anything but ``ping`` raises and a
route that started talking to the broker would fail these tests loudly. It also lets a test
make the broker alone fail, with a chosen exception.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
from pydantic import BaseModel

import jobrelay
from jobrelay.api import create_app
from jobrelay.api.auth import hash_token, new_token
from jobrelay.observe.faults import Faults
from jobrelay.results.files import FileResults
from jobrelay.runtime.wiring import Runtime, topology_for
from jobrelay.settings import Settings
from jobrelay.storage.engine import create_engine
from jobrelay.storage.store import Store
from jobrelay.transport.base import Delivery, OutgoingMessage, Transport
from jobrelay.transport.local import LocalTransport

T0 = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
MAX_ATTEMPTS = 4  # not the default (3), so the test sees it came from Settings
LEASE = timedelta(seconds=30)


@dataclass
class Clock:
    now: datetime = T0

    def __call__(self) -> datetime:
        return self.now

    def advance(self, seconds: float) -> datetime:
        self.now += timedelta(seconds=seconds)
        return self.now


class ProbeTransport:
    """Answers ``ping`` (or raises ``failure``); every other broker call is a test failure."""

    def __init__(self, failure: BaseException | None = None) -> None:
        self.failure = failure
        self.closed = False
        self.ready = 0  # what ``work_ready`` answers (the reconciler asks)

    async def connect(self) -> None:
        return None

    async def close(self) -> None:
        self.closed = True

    async def ping(self) -> None:
        if self.failure is not None:
            raise self.failure

    async def publish(self, message: OutgoingMessage) -> None:
        raise AssertionError(f"the API must not publish (got {message.destination})")

    def consume(
        self, prefetch: int, queue: str = "default", *, keep_in_flight: bool = False
    ) -> AsyncIterator[Delivery]:
        raise AssertionError("the API must not consume")

    async def quarantine_depth(self) -> int:
        raise AssertionError("the API must not inspect queues")

    async def work_ready(self) -> int:
        return self.ready


def settings_for(database_url: str, tmp_path: Path) -> Settings:
    return Settings(
        database_url=database_url,
        results_url=f"file://{tmp_path}/exports",
        max_attempts=MAX_ATTEMPTS,
    )


def build_runtime(
    database_url: str,
    tmp_path: Path,
    *,
    transport: ProbeTransport | None = None,
    local_transport: bool = False,
    faults: Faults | None = None,
    clock: Clock | None = None,
) -> Runtime:
    """A Runtime on ``database_url``; ``local_transport`` for the real database-backed broker."""
    settings = settings_for(database_url, tmp_path)
    engine = create_engine(database_url)
    clock = clock or Clock()
    topology = topology_for(settings)
    broker: Transport = (
        LocalTransport(engine, topology, clock=clock)
        if local_transport
        else transport or ProbeTransport()
    )
    return Runtime(
        settings=settings,
        engine=engine,
        store=Store(engine, clock=clock),
        transport=broker,
        results=FileResults(settings.results_url),
        faults=faults or Faults(),
        topology=topology,
        clock=clock,
    )


class Ping(BaseModel):
    """The params of a job that does nothing: for tests of how a job is enqueued."""

    n: int


def ping_app(job_type: str) -> tuple[jobrelay.App, jobrelay.JobDefinition[Ping]]:
    """An app of one job, ``job_type``, that does nothing (enqueueable over HTTP)."""
    app = jobrelay.App()

    async def ping(ctx: jobrelay.JobContext[Ping], params: Ping) -> None:
        return None

    return app, app.job(job_type, params=Ping, http=True)(ping)


@contextlib.asynccontextmanager
async def runtime_with_app(
    app: jobrelay.App, database_url: str, tmp_path: Path
) -> AsyncIterator[Runtime]:
    """``build_runtime`` running ``app`` (a test module's own jobs); disposed at the end."""
    runtime = dataclasses.replace(build_runtime(database_url, tmp_path), app=app)
    try:
        yield runtime
    finally:
        await runtime.engine.dispose()


async def make_token(runtime: Runtime, account_id: str | None, *, admin: bool = False) -> str:
    token = new_token()
    await runtime.store.add_token(hash_token(token), account_id, admin, runtime.clock())
    return token


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


async def finish_job(runtime: Runtime, job_id: str, csv: bytes) -> str:
    """Move a queued job to succeeded the way a worker does: result first, then the state."""
    key = f"exports/acme/{job_id}.csv"
    session = runtime.results.writer(key)
    async with session as out:
        await out.write(csv)
    now = runtime.clock()
    await runtime.store.admit_waiting(100)  # the relay's step (the export is fair by account)
    claim = await runtime.store.claim_job(job_id, "worker-test", now, LEASE)
    assert claim is not None
    assert (await runtime.store.complete(claim, key, {"rows": 2}, now)).won
    return key


@contextlib.asynccontextmanager
async def api_client(runtime: Runtime) -> AsyncIterator[httpx.AsyncClient]:
    """An HTTP client for the API app on ``runtime``, in process (no server, no socket)."""
    app = create_app(runtime.settings, runtime=runtime)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://api.test") as client:
        yield client
