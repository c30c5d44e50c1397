"""The soak: ``bench.noop`` jobs over HTTP at a fixed rate for a long while; do sizes stay flat?

It starts an API, a relay and ``--workers`` workers (separate ``python -m jobrelay``
processes) on a fresh PostgreSQL database and RabbitMQ vhost, with ``JOBRELAY_RETENTION_DAYS``
set to ``--retention-minutes`` as a fraction of a day (the relay's reconciler leader prunes
finished jobs, their events and published outbox rows older than that; a jobrelay without the
setting ignores it and the tables just grow). Then it sends ``POST /v1/jobs`` on a fixed
schedule (request i at i / rate s, over ``--concurrency`` keep-alive connections) for
``--soak`` seconds; ``--rate`` defaults to half the rate of a quick burn-down measured first
(``--probe-jobs`` jobs, accept to all succeeded).

Every ``--interval`` seconds (60) it prints one row (``soak_report``): jobs sent and first seen
succeeded in the interval, the outbox backlog, relay lag p99, end-to-end p99, and per table
live rows / dead rows / MiB (table + indexes + TOAST). At the end it stops sending, waits for
the jobs in flight, and checks that every job it was given an id for was seen ``succeeded``
(none lost, none quarantined), then prints the verdict (``soak: verdict …``): the first
samples after the warm-up against the last ones. Exit 0 only if flat and nothing lost; 1
otherwise (also when too short to judge), 130 when interrupted. The samples land in
``bench-results/soak-*.json``, the process logs under ``bench-results/logs/soak-*``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import sys
import time
from dataclasses import dataclass, fields
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import asyncpg
import bench_cpu
import soak_report
from bench_client import Lane, api_client, request_for, submit, wait_ready
from bench_env import BenchFailure, RoleProcess, Sandbox, free_port, run_command
from bench_report import say
from soak_report import Sample

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench-results"
READY_TIMEOUT = 60.0
DRAIN_TIMEOUT = 120.0  # after the last POST, for the jobs in flight
WATCH_SECONDS = 2.0  # how often the ids sent are looked up (small batches, not a minute's)


@dataclass(frozen=True)
class Options:
    soak: float
    rate: float | None
    interval: float
    retention_minutes: float
    reconcile_seconds: float
    workers: int
    concurrency: int
    probe_jobs: int
    tolerance: float


def parse_args(argv: list[str] | None) -> Options:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--soak", type=float, default=600.0, metavar="SECONDS", help="(600)")
    parser.add_argument("--rate", type=float, help="jobs/s (default: half a measured maximum)")
    parser.add_argument("--interval", type=float, default=60.0, help="seconds per row (60)")
    parser.add_argument(
        "--retention-minutes", type=float, default=2.0, help="JOBRELAY_RETENTION_DAYS (2 min)"
    )
    parser.add_argument(
        "--reconcile-seconds", type=float, default=30.0, help="JOBRELAY_RECONCILE_SECONDS (30)"
    )
    parser.add_argument("--workers", type=int, default=2, help="worker processes (2)")
    parser.add_argument("--concurrency", type=int, default=32, help="HTTP connections (32)")
    parser.add_argument("--probe-jobs", type=int, default=500, help="burn-down for the rate")
    parser.add_argument("--tolerance", type=float, default=0.25, help="flat: within +25%%")
    a = parser.parse_args(argv)
    if a.soak <= 0 or a.interval <= 0 or a.retention_minutes <= 0 or (a.rate or 1) <= 0:
        parser.error("--soak, --interval, --retention-minutes and --rate must be positive")
    return Options(**{f.name: getattr(a, f.name) for f in fields(Options)})


class Soak:
    def __init__(self, options: Options, stamp: str) -> None:
        self.options = options
        self.log_dir = RESULTS / "logs" / f"soak-{stamp}"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.sandbox = Sandbox.new(self.log_dir)
        tuning = {
            "retention_days": f"{options.retention_minutes / 1440:.8f}",
            "reconcile_seconds": f"{options.reconcile_seconds:g}",
        }
        self.env = self.sandbox.env(tuning)
        self.procs: list[RoleProcess] = []
        self.db: asyncpg.Connection | None = None
        self.pending: dict[str, float] = {}  # job id → when sent (s since the soak started)
        self.done: list[float] = []  # accept → result_saved (s) of jobs seen succeeded lately
        self.sent = 0  # in the current interval
        self.total_sent = 0
        self.total_succeeded = 0
        self.samples: list[Sample] = []
        self.rate = 0.0
        self.started = 0.0
        self.failures: list[str] = []
        self.verdict: soak_report.Verdict | None = None
        self.autovacuum = "?"

    async def run(self) -> None:
        await self.sandbox.create()
        await self.jobrelay("db", "upgrade")
        self.token = (await self.jobrelay("token", "create", "--admin", "--label", "soak")).split()[
            -1
        ]
        self.db = await asyncpg.connect(self.sandbox.database_url)
        self.autovacuum = str(await self.db.fetchval("SHOW autovacuum"))
        if self.autovacuum != "on":
            say(
                "soak: note: autovacuum is off on this PostgreSQL: the relay leading the "
                "reconciler vacuums jobrelay's tables after each prune (JOBRELAY_SELF_VACUUM)"
            )
        port = free_port()
        api = self.spawn("api", ["api", "--host", "127.0.0.1", "--port", str(port)])
        relay = self.spawn("relay", ["relay"])
        workers = [self.spawn(f"worker-{i + 1}", ["worker"]) for i in range(self.options.workers)]
        async with api_client(port, self.token, self.options.concurrency) as client:
            await wait_ready(client, api, READY_TIMEOUT)
            await relay.wait_for_event("relay_started", READY_TIMEOUT)
            for worker in workers:
                await worker.wait_for_event("worker_started", READY_TIMEOUT)
            self.rate = self.options.rate or await self.probe(client) / 2
            say(
                f"soak: {self.options.soak:g}s at {self.rate:.1f} jobs/s, retention "
                f"{self.options.retention_minutes:g} min, a row every {self.options.interval:g}s"
            )
            say(f"soak: {soak_report.LEGEND}")
            say(soak_report.HEADER)
            self.started = time.monotonic()
            self.cpu_before = await self.cpu_snapshot()
            self.db_since = await self.db.fetchval("SELECT now()")
            sender = asyncio.create_task(self.send(port))
            watcher = asyncio.create_task(self.watch())
            try:
                await self.sample_until(sender)
                await self.drain(watcher)
            finally:
                for task in (sender, watcher):
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
        warm_up = self.options.retention_minutes * 60 + 2 * self.options.reconcile_seconds
        self.verdict = soak_report.verdict(
            self.samples, warm_up, self.options.tolerance, self.rate, self.options.reconcile_seconds
        )

    async def probe(self, client: Any) -> float:
        """Jobs/s of a burn-down (accept → all succeeded) of ``--probe-jobs`` jobs."""
        n = self.options.probe_jobs
        started = time.monotonic()
        submitted = await submit(client, n, 32, f"soak-{self.sandbox.run_id}-probe", "noop")
        pending = list(submitted.job_ids)
        while pending:
            self.check_alive()
            assert self.db is not None
            done = await soak_report.newly_succeeded(self.db, pending)
            pending = [job for job in pending if job not in done]
            if time.monotonic() - started > READY_TIMEOUT:
                raise BenchFailure(f"probe: {len(pending)} of {n} jobs not succeeded in time")
            await asyncio.sleep(0.05)
        rate = n / (time.monotonic() - started)
        say(f"soak: burn-down of {n} jobs: {rate:.1f} jobs/s end to end")
        return rate

    async def send(self, port: int) -> None:
        """POST request i at i / rate seconds; failures are kept (they fail the run)."""
        indices = iter(range(10**9))
        headers = {"Authorization": f"Bearer {self.token}"}
        prefix = f"soak-{self.sandbox.run_id}"

        async def lane() -> None:
            connection = Lane("127.0.0.1", port, headers)
            try:
                for i in indices:
                    due = self.started + i / self.rate
                    if due - self.started >= self.options.soak:
                        return
                    await asyncio.sleep(max(0.0, due - time.monotonic()))
                    path, body, extra = request_for("noop", i, f"{prefix}-{i}")
                    try:
                        status, payload = await connection.post(
                            path, json.dumps(body).encode(), extra
                        )
                    except (OSError, ValueError, asyncio.IncompleteReadError) as exc:
                        self.failures.append(f"request {i}: {exc!r}")
                        continue
                    if status != 202:
                        self.failures.append(f"request {i}: {status} {payload[:200]!r}")
                        continue
                    self.pending[str(json.loads(payload)["jobId"])] = due - self.started
                    self.sent += 1
                    self.total_sent += 1
            finally:
                await connection.close()

        await asyncio.gather(*(lane() for _ in range(self.options.concurrency)))

    async def sample_until(self, sender: asyncio.Task[None]) -> None:
        """A sample every ``--interval`` seconds up to the end of the soak."""
        k = 1
        while k * self.options.interval <= self.options.soak + 1e-6:
            await asyncio.sleep(
                max(0.0, self.started + k * self.options.interval - time.monotonic())
            )
            if sender.done():
                sender.result()  # a crash of the sender surfaces here
            await self.sample()
            k += 1
        await sender

    async def sample(self) -> Sample:
        assert self.db is not None
        self.check_alive()
        at = time.monotonic() - self.started
        now = await self.db.fetchval("SELECT now()")
        done, self.done = self.done, []
        lags = await soak_report.relay_lags(self.db, self.db_since, now)
        self.db_since = now
        e2e = [v for v in done if v == v]  # without NaN (no result_saved event)
        backlog = await self.db.fetchval("SELECT count(*) FROM outbox WHERE published_at IS NULL")
        bad = await self.db.fetch(
            "SELECT state, count(*) AS n FROM jobs WHERE state IN ('quarantined', 'cancelled')"
            " GROUP BY state"
        )
        sample = Sample(
            at=at,
            submitted=self.sent,
            succeeded=len(done),
            tables=await soak_report.read_tables(self.db),
            backlog=int(backlog),
            relay_p99_ms=_ms(soak_report.p99(lags)),
            e2e_p99_ms=_ms(soak_report.p99(e2e)),
            cores=await self.cores_since_last(),
            extra={
                "in_flight": len(self.pending),
                "bad_states": {r["state"]: r["n"] for r in bad},
                "sample_s": round(time.monotonic() - self.started - at, 3),
            },
        )
        if bad:
            self.failures.append(f"jobs in bad states at {sample.at:.0f}s: {sample.extra}")
        self.sent = 0
        self.samples.append(sample)
        say(soak_report.format_row(sample))
        return sample

    async def cpu_snapshot(self) -> bench_cpu.Snapshot:
        assert self.db is not None
        postgres = await bench_cpu.postgres_pids(self.db, self.sandbox.database)
        return bench_cpu.snapshot({p.name: p.popen.pid for p in self.procs}, postgres, None)

    async def cores_since_last(self) -> dict[str, float]:
        """The machine's busy cores since the last sample, and those of processes not ours
        (not jobrelay's, PostgreSQL's, an Erlang VM's or this script's): a neighbour's run."""
        after = await self.cpu_snapshot()
        used = bench_cpu.cores_used(self.cpu_before, after)
        self.cpu_before = after
        ours = ("other: postgres", "other: beam.smp")
        others = sum(v for k, v in used.items() if k.startswith("other: ") and k not in ours)
        return {"total": used.get("total", 0.0), "others": round(others, 2)}

    async def watch(self) -> None:
        """Every ``WATCH_SECONDS``, which of the ids sent are now succeeded (own connection)."""
        db = await asyncpg.connect(self.sandbox.database_url)
        try:
            while True:
                await asyncio.sleep(WATCH_SECONDS)
                done = await soak_report.newly_succeeded(db, list(self.pending))
                for job, seconds in done.items():
                    del self.pending[job]
                    self.done.append(seconds)
                self.total_succeeded += len(done)
        finally:
            await db.close()

    async def drain(self, watcher: asyncio.Task[None]) -> None:
        """After the last POST: wait for the jobs in flight; any left is lost (or stuck)."""
        deadline = time.monotonic() + DRAIN_TIMEOUT
        assert self.db is not None
        while self.pending and time.monotonic() < deadline and not watcher.done():
            self.check_alive()
            await asyncio.sleep(0.5)
        if watcher.done():
            watcher.result()  # its failure, not a loss
        if self.pending:
            rows = await self.db.fetch(
                "SELECT state, count(*) AS n FROM jobs WHERE id = ANY($1::text[]) GROUP BY state",
                list(self.pending),
            )
            states = {r["state"]: int(r["n"]) for r in rows}
            missing = len(self.pending) - sum(states.values())
            self.failures.append(
                f"{len(self.pending)} jobs not seen succeeded {DRAIN_TIMEOUT:g}s after the last "
                f"POST: by state {states}, {missing} gone from the database"
            )

    def check_alive(self) -> None:
        for proc in self.procs:
            proc.check_alive()

    async def jobrelay(self, *args: str) -> str:
        return await run_command(
            [sys.executable, "-m", "jobrelay", *args], env=self.env, log=self.log_dir / "setup.log"
        )

    def spawn(self, name: str, args: list[str]) -> RoleProcess:
        proc = RoleProcess.spawn(name, args, self.env, self.log_dir, profile=False)
        self.procs.append(proc)
        return proc

    async def clean_up(self) -> None:
        for proc in self.procs:
            if proc.exit_code is None and await proc.stop() != 0:
                self.failures.append(f"{proc.name} exited {proc.exit_code} on SIGTERM")
        for proc in self.procs:
            for complaint, count in proc.log_summary()["complaints"].items():
                say(f"soak: {proc.name} log: {count} x {complaint}")
        if self.db is not None:
            with contextlib.suppress(Exception):
                await self.db.close()
        for problem in await self.sandbox.destroy():
            print(f"soak: cleanup: {problem}", file=sys.stderr)


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 1)


async def amain(options: Options) -> int:
    task = asyncio.current_task()
    assert task is not None
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    soak = Soak(options, stamp)
    say(f"soak: logs in {soak.log_dir.relative_to(REPO)}")
    try:
        await soak.run()
    except BenchFailure as exc:
        soak.failures.append(str(exc))
    finally:
        await soak.clean_up()
        verdict = soak.verdict
        path = RESULTS / f"soak-{stamp}.json"
        document = {
            "started_at": stamp,
            "options": {**options.__dict__},
            "rate": soak.rate,
            "autovacuum": soak.autovacuum,
            "sent": soak.total_sent,
            "succeeded": soak.total_succeeded,
            "samples": [s.as_dict() for s in soak.samples],
            "verdict": verdict.text if verdict else None,
            "failures": soak.failures,
        }
        path.write_text(json.dumps(document, indent=2, default=str) + "\n")
        lost = soak.total_sent - soak.total_succeeded
        say(
            f"soak: sent {soak.total_sent}, succeeded {soak.total_succeeded}, lost {lost}; "
            f"figures in {path.relative_to(REPO)}"
        )
        for failure in soak.failures[:10]:
            say(f"soak: FAILED: {failure}")
        text = verdict.text if verdict else "not judged: the run did not finish"
        if soak.autovacuum == "off":
            text += " (autovacuum is off on this server; jobrelay vacuumed its own tables)"
        say(f"soak: verdict {text}")
    ok = verdict is not None and verdict.flat and not soak.failures and lost == 0
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    options = parse_args(argv)
    try:
        return asyncio.run(amain(options))
    except (KeyboardInterrupt, asyncio.CancelledError):
        print("soak: interrupted; cleaned up", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
