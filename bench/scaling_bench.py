"""How relay rate and worker drain scale with processes, on one RabbitMQ node and on three.

A cell is one configuration on one broker: R relay processes publishing N waiting outbox
rows (rows/s), or W worker processes draining N queued ``bench.noop`` messages (jobs/s).
Each column (the broker on 5672, then ``--cluster N``: a throwaway N-node RabbitMQ cluster on
loopback, ``jobrelay.chaos.rabbit_cluster``) gets a fresh database and runs rounds; round i
uses ``RELAYS[i % len]`` relays and ``WORKERS[i]`` workers, so with the defaults 1/1, 2/2, 1/4
(the single-relay figure is the mean of its two samples). In each round:

1. W workers start and, once each logged ``worker_started``, are frozen (SIGSTOP): they keep
   their connections and consumers but take no CPU, so the relay cell is not shared with them.
2. R relays start; once all logged ``relay_started``, the benchmark commits N noop jobs in one
   transaction (``noop.enqueue``, as an application would). Relay rate: N / (that commit →
   no outbox row unpublished). The relays are then stopped (SIGTERM).
3. The workers are thawed (SIGCONT) together. Worker drain: N / (thaw → all N succeeded).
   They are then stopped (SIGTERM).

So process start-up is never in a rate, and every process of a cell starts its work at the
same instant. The cluster column's processes get ``JOBRELAY_BROKER_URL`` = every node's
URL, comma-separated (each connects to one node, starting at a random one); the work queue
is a quorum queue replicated on every node, so the cluster column over the single-node one
is the cost of replication. Two shared cores bound the absolute figures; read the table
for its shape.

Each cell's machine-readable line (``scaling-cell: {json}``) has the cores used meanwhile:
``jobrelay`` (the cell's processes), ``postgres`` and ``rabbitmq`` (every PostgreSQL process
and every Erlang VM on the machine), ``others`` (anything else, the largest by name: a
neighbour's run makes that cell suspect) and ``total`` (the machine, interrupts included).
The run ends with one ``scaling: single_relay_x1=… cluster3_drain_x4=…`` line and writes
``bench-results/scaling-*.json``. Exit 1 on a functional failure (a quarantined or lost job, a
process that died, a timeout, a cluster that would not start); the table is printed with
whatever was measured.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import asyncpg
import bench_cpu
from bench_app import noop
from bench_env import BenchFailure, RoleProcess, Sandbox, run_command
from bench_report import say
from scaling_cluster import (
    ClusterError,
    RabbitCluster,
    cluster_broker_url,
    free_base_port,
    queue_members,
    unavailable,
)
from sqlalchemy.ext.asyncio import create_async_engine

from jobrelay.transport.topology import work_queue

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench-results"
READY_TIMEOUT = 90.0
POLL_SECONDS = 0.05
SINGLE = "single node"


@dataclass(frozen=True)
class Options:
    jobs: int
    relays: tuple[int, ...]
    workers: tuple[int, ...]
    cluster: int
    phase_timeout: float


@dataclass
class Column:
    """One broker's figures: samples per config, rows/s or jobs/s."""

    name: str
    relay: dict[int, list[float]] = field(default_factory=dict)
    drain: dict[int, list[float]] = field(default_factory=dict)
    cells: list[dict[str, Any]] = field(default_factory=list)
    failure: str | None = None
    broker: str = "amqp://127.0.0.1:5672 (a vhost of its own)"


def parse_args(argv: list[str] | None) -> Options:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--jobs", type=int, default=2000, help="jobs per cell (default 2000)")
    parser.add_argument("--relays", default="1,2", help="relay counts (default 1,2)")
    parser.add_argument("--workers", default="1,2,4", help="worker counts (default 1,2,4)")
    parser.add_argument(
        "--cluster", type=int, default=0, metavar="N", help="also on an N-node cluster (0: skip)"
    )
    parser.add_argument("--phase-timeout", type=float, default=120.0, help="seconds per cell")
    args = parser.parse_args(argv)

    def counts(text: str) -> tuple[int, ...]:
        try:
            values = tuple(int(v) for v in text.split(",") if v.strip())
        except ValueError:
            parser.error(f"expected comma-separated counts, got {text!r}")
        if not values or min(values) < 1:
            parser.error(f"expected counts of at least 1, got {text!r}")
        return values

    if args.jobs < 1 or args.cluster < 0:
        parser.error("--jobs must be at least 1 and --cluster at least 0")
    return Options(
        args.jobs, counts(args.relays), counts(args.workers), args.cluster, args.phase_timeout
    )


class ColumnRun:
    """One column: a fresh database (and vhost), the rounds, the processes, the cleanup."""

    def __init__(self, options: Options, column: Column, log_dir: Path) -> None:
        self.options = options
        self.column = column
        self.log_dir = log_dir
        log_dir.mkdir(parents=True, exist_ok=True)
        self.sandbox = Sandbox.new(log_dir)
        self.env = self.sandbox.env({})
        self.procs: list[RoleProcess] = []
        self.db: asyncpg.Connection | None = None
        self.total = 0  # jobs committed so far in this column's database

    async def run(self, broker_url: str | None) -> None:
        await self.sandbox.create()
        if broker_url is not None:
            self.env["JOBRELAY_BROKER_URL"] = broker_url
        await run_command(
            [sys.executable, "-m", "jobrelay", "db", "upgrade"],
            env=self.env,
            log=self.log_dir / "setup.log",
        )
        self.db = await asyncpg.connect(self.sandbox.database_url)
        dsn = self.sandbox.database_url.replace("postgresql://", "postgresql+asyncpg://", 1)
        self.engine = create_async_engine(dsn, pool_size=1)
        for i, workers in enumerate(self.options.workers):
            relays = self.options.relays[i % len(self.options.relays)]
            await self.round(i + 1, relays, workers)
        # Relay counts beyond the rounds (more relay than worker configs): relay cells only.
        for relays in self.options.relays[len(self.options.workers) :]:
            await self.round(0, relays, 0)

    async def round(self, number: int, relays: int, workers: int) -> None:
        n, tag = self.options.jobs, f"r{number}"
        frozen = [self.spawn(f"{tag}-worker-{k + 1}", "worker") for k in range(workers)]
        async with self.bounded(f"{workers} workers starting"):
            for proc in frozen:
                await proc.wait_for_event("worker_started", READY_TIMEOUT)
        for proc in frozen:
            proc.popen.send_signal(signal.SIGSTOP)

        async def thaw() -> None:
            for proc in frozen:
                with contextlib.suppress(ProcessLookupError):
                    proc.popen.send_signal(signal.SIGCONT)

        try:
            publishing = [self.spawn(f"{tag}-relay-{k + 1}", "relay") for k in range(relays)]
            async with self.bounded(f"{relays} relays"):
                for proc in publishing:
                    await proc.wait_for_event("relay_started", READY_TIMEOUT)
                async with self.engine.connect() as conn:
                    transaction = await conn.begin()
                    for i in range(n):
                        await noop.enqueue(conn, {"n": self.total + i})
                    self.total += n
                    # The clock starts when the N jobs commit: from then on relays see them.
                    seconds, cores = await self.timed(self.outbox_drained, transaction.commit)
            self.record("relay", relays, n / seconds, seconds, cores)
            await self.stop(publishing)
            if workers:
                async with self.bounded(f"{workers} workers draining"):
                    seconds, cores = await self.timed(self.all_succeeded, thaw)
                self.record("drain", workers, n / seconds, seconds, cores)
                await self.stop(frozen)
        finally:
            await thaw()  # on a failure too: a frozen process would not stop on SIGTERM

    def spawn(self, name: str, role: str) -> RoleProcess:
        proc = RoleProcess.spawn(name, [role], self.env, self.log_dir, profile=False)
        self.procs.append(proc)
        return proc

    async def stop(self, procs: list[RoleProcess]) -> None:
        codes = await asyncio.gather(*(p.stop() for p in procs))
        for proc, code in zip(procs, codes, strict=True):
            if code != 0:
                raise BenchFailure(f"{proc.name} exited {code} on SIGTERM:\n{proc.tail()}")
            complaints = proc.log_summary()["complaints"]
            if complaints:
                say(f"scaling: {self.column.name}: {proc.name} log complained: {complaints}")

    async def timed(
        self, probe: Callable[[], Awaitable[bool]], start: Callable[[], Awaitable[None]]
    ) -> tuple[float, dict[str, float]]:
        """Seconds from ``start()`` returning until ``probe`` holds, and the cores used
        meanwhile (counted from just before ``start``): the cell's processes, PostgreSQL,
        RabbitMQ, others' and the machine's total."""
        assert self.db is not None
        running = {p.name: p.popen.pid for p in self.procs if p.exit_code is None}
        postgres = await bench_cpu.postgres_pids(self.db, self.sandbox.database)
        before = bench_cpu.snapshot(running, postgres, None)
        await start()
        started = time.perf_counter()
        while not await probe():
            for proc in self.procs:
                if proc.exit_code is None:
                    proc.check_alive()
            await asyncio.sleep(POLL_SECONDS)
        seconds = time.perf_counter() - started
        used = bench_cpu.cores_used(before, bench_cpu.snapshot(running, postgres, None))
        others = {
            k: v
            for k, v in used.items()
            if k.startswith("other: ") and k not in ("other: beam.smp", "other: postgres")
        }
        cores = {
            "jobrelay": sum(used.get(name, 0.0) for name in running),
            "postgres": used.get("postgres", 0.0) + used.get("other: postgres", 0.0),
            "rabbitmq": used.get("other: beam.smp", 0.0),
            "others": sum(others.values()),
            "total": used.get("total", 0.0),
        }
        cores |= {k: v for k, v in others.items() if v >= 0.05}
        return seconds, {k: round(v, 2) for k, v in cores.items()}

    async def outbox_drained(self) -> bool:
        assert self.db is not None
        query = "SELECT count(*) FROM outbox WHERE published_at IS NULL"
        return int(await self.db.fetchval(query)) == 0

    async def all_succeeded(self) -> bool:
        assert self.db is not None
        rows = await self.db.fetch("SELECT state, count(*) AS n FROM jobs GROUP BY state")
        states = {r["state"]: int(r["n"]) for r in rows}
        if states.get("quarantined") or states.get("failed"):
            raise BenchFailure(f"{self.column.name}: jobs by state {states}")
        return states.get("succeeded", 0) == self.total

    def record(
        self, kind: str, count: int, rate: float, seconds: float, cores: dict[str, float]
    ) -> None:
        samples = self.column.relay if kind == "relay" else self.column.drain
        samples.setdefault(count, []).append(rate)
        cell = {
            "column": self.column.name,
            "kind": kind,
            "processes": count,
            "jobs": self.options.jobs,
            "seconds": round(seconds, 3),
            "rate": round(rate, 1),
            "cores": cores,
        }
        self.column.cells.append(cell)
        say("scaling-cell: " + json.dumps(cell))

    @contextlib.asynccontextmanager
    async def bounded(self, what: str) -> AsyncIterator[None]:
        try:
            async with asyncio.timeout(self.options.phase_timeout):
                yield
        except TimeoutError:
            raise BenchFailure(
                f"{self.column.name}: {what}: not done within {self.options.phase_timeout:g}s"
                f" (--phase-timeout); logs in {self.log_dir}"
            ) from None

    async def clean_up(self) -> None:
        for proc in self.procs:
            with contextlib.suppress(ProcessLookupError):
                proc.popen.send_signal(signal.SIGCONT)
            if proc.exit_code is None:
                await proc.stop()
        if self.db is not None:
            with contextlib.suppress(Exception):
                await self.db.close()
        if hasattr(self, "engine"):
            await self.engine.dispose()
        for problem in await self.sandbox.destroy():
            print(f"scaling: cleanup: {problem}", file=sys.stderr)


async def measure_column(options: Options, column: Column, log_dir: Path) -> None:
    run = ColumnRun(options, column, log_dir)
    cluster: Any = None
    try:
        broker_url = None
        if column.name != SINGLE:
            cluster = RabbitCluster(options.cluster, base_port=free_base_port(options.cluster))
            say(f"scaling: starting a {options.cluster}-node RabbitMQ cluster")
            started = time.perf_counter()
            await asyncio.to_thread(cluster.start)
            say(f"scaling: cluster ready after {time.perf_counter() - started:.1f}s")
            broker_url = await cluster_broker_url(cluster)
            column.broker = broker_url.replace("guest:guest@", "")
            say(f"scaling: the processes connect to {column.broker}")
        await run.run(broker_url)
        if cluster is not None:
            members = await asyncio.to_thread(queue_members, cluster, work_queue())
            column.broker += f"; {work_queue()} replicated on {members}"
            say(f"scaling: {work_queue()} is a quorum queue on {members}")
    except (BenchFailure, ClusterError) as exc:
        column.failure = str(exc)
    finally:
        await run.clean_up()
        if cluster is not None:
            await asyncio.to_thread(cluster.stop)


def print_table(options: Options, columns: list[Column]) -> None:
    def cell(samples: dict[int, list[float]], count: int) -> str:
        values = samples.get(count)
        return f"{sum(values) / len(values):.0f}" if values else "-"

    rows = [(f"relay x{r} (rows/s)", "relay", r) for r in options.relays]
    rows += [(f"workers x{w} (jobs/s)", "drain", w) for w in options.workers]
    say()
    say(f"{'config':<22}" + "".join(f"{c.name:>18}" for c in columns) + "   cluster/single")
    for label, kind, count in rows:
        values = [cell(c.relay if kind == "relay" else c.drain, count) for c in columns]
        ratio = "-"
        if len(values) == 2 and "-" not in values:
            ratio = f"{float(values[1]) / float(values[0]):.2f}"
        say(f"{label:<22}" + "".join(f"{v:>18}" for v in values) + f"{ratio:>17}")
    for column in columns:
        if column.failure:
            say(f"{column.name}: FAILED: {column.failure}")


def scaling_line(options: Options, columns: list[Column]) -> str:
    fields: list[str] = []
    for column in columns:
        key = "single" if column.name == SINGLE else f"cluster{options.cluster}"
        for kind, samples in (("relay", column.relay), ("drain", column.drain)):
            for count, values in sorted(samples.items()):
                fields.append(f"{key}_{kind}_x{count}={sum(values) / len(values):.0f}")
    return "scaling: " + " ".join(fields)


async def amain(options: Options) -> int:
    task = asyncio.current_task()
    assert task is not None
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    log_dir = RESULTS / "logs" / f"scaling-{stamp}"
    started = time.monotonic()
    columns = [Column(SINGLE)]
    if options.cluster:
        if reason := unavailable():
            say(f"scaling: no cluster column: {reason}")
        else:
            columns.append(Column(f"{options.cluster}-node cluster"))
    say(
        f"scaling: {options.jobs} noop jobs per cell, relays {options.relays}, workers "
        f"{options.workers}, logs in {log_dir.relative_to(REPO)}"
    )
    try:
        for column in columns:
            await measure_column(options, column, log_dir / column.name.replace(" ", "-"))
    finally:
        print_table(options, columns)
        say(scaling_line(options, columns))
        path = RESULTS / f"scaling-{stamp}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        document = {
            "started_at": stamp,
            "elapsed_s": round(time.monotonic() - started, 1),
            "options": {**options.__dict__},
            "cells": [c for column in columns for c in column.cells],
            "failures": {c.name: c.failure for c in columns if c.failure},
            "brokers": {c.name: c.broker for c in columns},
        }
        path.write_text(json.dumps(document, indent=2) + "\n")
        say(f"scaling: figures in {path.relative_to(REPO)}; took {document['elapsed_s']}s")
    return 1 if any(c.failure for c in columns) else 0


def main(argv: list[str] | None = None) -> int:
    options = parse_args(argv)
    try:
        return asyncio.run(amain(options))
    except (KeyboardInterrupt, asyncio.CancelledError):
        print("scaling: interrupted; cleaned up", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
