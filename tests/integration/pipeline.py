"""An in-process pipeline for scenario tests: the real store, transport, relay and worker.

Everything is the shipped code; only the process boundary is simulated. A ``crash`` fault
raises ``SimulatedCrash`` (a BaseException, so no handler in the worker can swallow it),
and the harness then cancels that worker's consume loop without settling anything, which
is what the broker sees when a process dies. Subprocess tests with real ``os._exit`` live in
tests/acceptance.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

from jobrelay.domain.ids import request_hash
from jobrelay.exports.seed import seed
from jobrelay.observe.faults import Faults
from jobrelay.relay.publisher import Relay
from jobrelay.runtime.wiring import Runtime, build_transport, open_runtime
from jobrelay.settings import Settings
from jobrelay.storage.store import JobRecord, NewJob
from jobrelay.transport.base import Transport
from jobrelay.worker.consumer import Worker
from tests.id_keys import request_id

FAST = {
    "retry_delays": "1",
    "lease_seconds": "1.5",
    "visibility_seconds": "1.5",
    "relay_poll_seconds": "0.05",
    "relay_claim_seconds": "3",
    "confirm_timeout": "5",
    "prefetch": "4",
    "drain_seconds": "3",
    # Workers look at the queue pauses every 2 s by default: a test waits a tenth of that.
    "queue_pause_poll_seconds": "0.2",
}


class SimulatedCrash(BaseException):
    """Stands in for os._exit inside one test process."""


def settings_for(database_url: str, broker_url: str, results_dir: Path, **extra: Any) -> Settings:
    values: dict[str, Any] = {
        **FAST,
        "database_url": database_url,
        "broker_url": broker_url,
        "results_url": f"file://{results_dir}",
        **extra,
    }
    return Settings(**values)


@dataclass
class Pipeline:
    rt: Runtime
    crashed: asyncio.Event = field(default_factory=asyncio.Event)
    workers: list[asyncio.Task[None]] = field(default_factory=list)
    relays: list[asyncio.Task[None]] = field(default_factory=list)
    stops: list[asyncio.Event] = field(default_factory=list)
    worker_transports: list[Transport] = field(default_factory=list)

    @property
    def store(self) -> Any:
        return self.rt.store

    async def submit(
        self, account: str = "acme", period: str = "2020-05", key: str | None = None
    ) -> str:
        params = {"accountId": account, "period": period}
        job = NewJob(
            job_id=await request_id(self.store, account, params, key),
            type="report.export",
            account_id=account,
            params=params,
            request_hash=request_hash(account, "report.export", params),
            max_attempts=self.rt.settings.max_attempts,
            idempotency_key=key,
        )
        job_id, _ = await self.rt.store.submit(job, self.rt.clock())
        return job_id

    def _start(self, coro_factory: Callable[[asyncio.Event], Any], bucket: list[Any]) -> None:
        stop = asyncio.Event()
        self.stops.append(stop)
        bucket.append(asyncio.create_task(coro_factory(stop)))

    def start_relay(self) -> None:
        self._start(Relay(self.rt).run, self.relays)

    async def start_worker(self) -> None:
        """A worker "process": its own broker connection, so killing it drops only its own."""
        transport = build_transport(self.rt.settings, self.rt.engine, self.rt.clock, self.rt.app)
        await transport.connect()
        self.worker_transports.append(transport)
        self._start(Worker(dataclasses.replace(self.rt, transport=transport)).run, self.workers)

    async def kill_crashed_worker(self, timeout: float = 20) -> None:
        """Wait for a SimulatedCrash, then end the workers without settling anything and
        drop their connections, which is what the broker sees when a process dies."""
        await asyncio.wait_for(self.crashed.wait(), timeout)
        for task in self.workers:
            task.cancel()
        for task in self.workers:
            with contextlib.suppress(asyncio.CancelledError, SimulatedCrash):
                await task
        for transport in self.worker_transports:
            await transport.close()
        self.workers.clear()
        self.worker_transports.clear()
        self.crashed.clear()

    async def wait_for(
        self, job_id: str, predicate: Callable[[JobRecord], bool], timeout: float = 30
    ) -> JobRecord:
        deadline = time.monotonic() + timeout
        job = None
        while time.monotonic() < deadline:
            job = await self.rt.store.get_job(job_id)
            if job is not None and predicate(job):
                return job
            await asyncio.sleep(0.05)
        raise AssertionError(f"timed out waiting on job {job_id}; last seen: {job}")

    async def kinds(self, job_id: str) -> list[str]:
        return [e.kind for e in await self.rt.store.events(job_id)]

    async def stop_all(self) -> None:
        for stop in self.stops:
            stop.set()
        for task in [*self.workers, *self.relays]:
            with contextlib.suppress(asyncio.CancelledError, SimulatedCrash):
                await asyncio.wait_for(task, 15)
        for transport in self.worker_transports:
            await transport.close()


@contextlib.asynccontextmanager
async def pipeline(settings: Settings, rows_per_month: int = 40) -> AsyncIterator[Pipeline]:
    crashed = asyncio.Event()

    def crash(point: str) -> NoReturn:
        crashed.set()
        raise SimulatedCrash(point)

    faults = Faults(settings.faults, crash_handler=crash)
    async with open_runtime(settings, faults=faults) as rt:
        await seed(rt.engine, rows_per_month)
        p = Pipeline(rt, crashed=crashed)
        try:
            yield p
        finally:
            await p.stop_all()
