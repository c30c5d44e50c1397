"""The Procrastinate peer: the status-row body as an async task, the queue in PostgreSQL.

Procrastinate's selling point is the transactional enqueue: a job is a row in the same
database, so deferring it can share the transaction of the caller's own writes. The body
here is the same as the other peers' (the claim and the finish, each committed on its own),
on its own async pool of ``concurrency`` connections per process.

Durability: the queue IS PostgreSQL. ``batch_defer_async`` commits the job rows; a worker
takes a job in one transaction (``procrastinate_fetch_job``: status ``doing``, with ``FOR
UPDATE SKIP LOCKED``) and records the outcome in another (``procrastinate_finish_job``:
``succeeded``), all with ``synchronous_commit=on``. Finished jobs are kept (Procrastinate's
default ``--delete-jobs never``). No broker: ``--amqp`` is ignored.

Worker processes: ``procrastinate worker --concurrency C``, one per process in the budget,
LISTEN/NOTIFY on (the default). Procrastinate's own pool (fetch, finish, heartbeats) is sized
``concurrency`` too, so its bookkeeping does not queue behind its own jobs (psycopg_pool's
default is 4). A worker is ready when its run loop starts listening for jobs (the loop's
first act after it logged ``start_worker``, right before its first fetch; seen through the
connector's ``listen_notify``); both pools are open by then, as the body's is opened with
the app. Log level WARNING (``--log-level warning``): Procrastinate's default, INFO, writes
two lines per job, which neither other peer does (nor could jobrelay's figure then be
compared with a peer's cost of logging rather than of queueing).
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Iterable
from importlib import metadata
from typing import Any

import procrastinate
import psycopg_pool
import status
from procrastinate.types import JSONDict

QUEUE = "peer"
DEFAULT_QUEUE_TYPE = "postgresql"
VERSION = metadata.version("procrastinate")
PACKAGES = {name: metadata.version(name) for name in ("procrastinate", "psycopg", "psycopg-pool")}
DEFER_BATCH = 500


def queue_type() -> str:
    return DEFAULT_QUEUE_TYPE


def durability() -> dict[str, str]:
    return {
        "publish": "batch_defer_async: job rows committed (synchronous_commit=on)",
        "delivery_mode": "n/a (a job is a row in procrastinate_jobs)",
        "queue": "PostgreSQL table procrastinate_jobs, LISTEN/NOTIFY on",
        "ack": "fetch (status doing) and finish (status succeeded) each a committed transaction",
    }


BODY = status.AsyncBody()


class PeerConnector(procrastinate.PsycopgConnector):
    """Procrastinate's psycopg connector that also opens the body's pool in a worker."""

    async def open_async(self, pool: psycopg_pool.AsyncConnectionPool | None = None) -> None:
        await super().open_async(pool)
        if status.in_worker():
            await BODY.open()

    async def close_async(self) -> None:
        await BODY.close()
        await super().close_async()

    async def listen_notify(self, on_notification: Any, channels: Iterable[str]) -> None:
        # The worker's run loop starts its listener first thing, then fetches: ready.
        if status.in_worker():
            status.mark_ready()
        await super().listen_notify(on_notification, channels)


_size = status.concurrency()
app = procrastinate.App(
    connector=PeerConnector(
        conninfo=status.dsn(),
        min_size=_size,
        max_size=_size,
        kwargs={"options": "-c synchronous_commit=on"},
    )
)


@app.task(name="peer_job", queue=QUEUE)
async def peer_job(job_id: str) -> None:
    await BODY.run(job_id)


def prepare() -> None:
    """Procrastinate's schema (tables, functions, triggers) in the run's database."""

    async def apply() -> None:
        async with app.open_async():
            await app.schema_manager.apply_schema_async()

    asyncio.run(apply())


def enqueue(job_ids: list[str]) -> None:
    async def defer() -> None:
        async with app.open_async():
            for start in range(0, len(job_ids), DEFER_BATCH):
                batch: list[JSONDict] = [
                    {"job_id": job_id} for job_id in job_ids[start : start + DEFER_BATCH]
                ]
                await peer_job.batch_defer_async(*batch)

    asyncio.run(defer())


def worker_commands(processes: int, concurrency: int) -> list[tuple[str, list[str]]]:
    argv = [sys.executable, "-m", "procrastinate", "--app", "peer_procrastinate.app"]
    argv += ["--log-level", "warning", "worker"]  # a main option: before the sub-command
    flags = ["--concurrency", str(concurrency), "--queues", QUEUE]
    return [(f"worker-{i}", [*argv, *flags]) for i in range(1, processes + 1)]
