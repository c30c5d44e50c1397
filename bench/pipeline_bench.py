"""Throughput of jobrelay's pipeline through separate api, relay and worker processes.

What is measured, on PostgreSQL + RabbitMQ, with N ``report.export`` jobs of a small ledger
(20 rows per account and month), each role a separate ``python -m jobrelay`` process:

1. accept: only the API runs; N ``POST /v1/exports`` (unique Idempotency-Key each, so every
   one creates a job) at concurrency C, every answer a 202. Jobs accepted per second.
2. relay: one relay starts against the N waiting outbox rows; from its ``relay_started`` log
   line until no outbox row is unpublished. Rows published (and confirmed) per second.
3. worker drain: W workers start against the N queued messages; from the first
   ``worker_started`` until all N jobs are ``succeeded``. Jobs per second.
4. end to end: everything running, N more jobs; from the first POST to the last job
   succeeded, plus the per-job accept→succeeded latency (``jobs.created_at`` to the
   ``result_saved`` event).

Process start-up (imports, connecting, declaring) is reported apart from the rates. Next to
each figure: the cores each process group used during the phase (from ``/proc``, so a
saturated machine or a busy neighbour shows), and at the end PostgreSQL's own counters for
the benchmark database divided by the jobs: transactions and rows per job. ``--profile
ROLES`` runs those roles under cProfile for diagnosis (slower; not comparable figures).

Why those peers: each is the floor under one phase, done with the raw library on the same
services with the same payload, so ``ours / peer`` says how much of the floor we reach.
The accept phase's peer is a bare Starlette + asyncpg endpoint (``starlette_peer.py``, with
``--job noop``) doing the same token check and the same job + outbox + event + NOTIFY
transaction under the same uvicorn process count and client; below it, the accept path must
commit a job row and an outbox row in one transaction (raw asyncpg, 8 connections, reported
as ``db``); the relay must publish persistent messages with confirms to a quorum queue
(raw aio-pika, 500 in flight); a worker must at least consume and ack (raw aio-pika,
prefetch 200). What jobrelay adds above each floor (HTTP, auth, the ``accepted`` event and
NOTIFY; the claim and mark transactions; the claim, export, commit and event writes per
job) is the cost of its guarantees, which this report makes visible, not a defect by itself.

The benchmark client shares the machine's two cores with the processes it measures, and the
processes log at jobrelay's default level (INFO), as a deployment would.

``--soak SECONDS`` hands the run over to the soak mode (``bench/soak_bench.py``, its options).

It isolates itself (a fresh database and vhosts, dropped at the end, also on failure or
Ctrl-C; ``--keep`` leaves them), bounds every phase (``--phase-timeout``), keeps process logs
under ``bench-results/logs/``, and writes the figures to ``bench-results/pipeline-*.json``.
It asserts nothing about speed: it exits 1 only on a functional failure (a non-202, a
quarantined or lost job, a phase timeout, a process that died) and 130 when interrupted.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import csv
import io
import json
import signal
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import bench_cpu
import bench_peers
import httpx
import pipeline_peers
import soak_bench
from bench_client import Submitted, api_client, submit, submit_at_rate, wait_ready
from bench_env import (
    BENCH_DIR,
    BenchFailure,
    CountedConnection,
    RoleProcess,
    Sandbox,
    describe_environment,
    free_port,
    peak_rss_mib,
    rabbitmqctl,
    run_command,
    summarise_profile,
)
from bench_probes import FASTEST_RATE, QUARANTINE_LOOK_SECONDS, UNFINISHED, UNPUBLISHED
from bench_report import (
    Figure,
    Results,
    bench_line,
    cpu_detail,
    in_ms,
    percentiles,
    print_phase,
    print_table,
    say,
    write_json,
)

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench-results"
ROWS_PER_MONTH = 20
POLL_SECONDS = 0.05
READY_TIMEOUT = 60.0
RESULT_SAMPLES = 3
FIXED_RATE_SECONDS = 10.0  # how long the fixed-rate phase sends
DEFAULT_PREFETCH = 256  # JOBRELAY_PREFETCH's default: each worker's broker window
DEFAULT_CONCURRENCY = 16  # JOBRELAY_CONCURRENCY's default: the jobs each worker runs at once


@dataclass(frozen=True)
class Options:
    jobs: int
    concurrency: int
    workers: int
    keep: bool
    skip_peers: bool
    phase_timeout: float
    tuning: dict[str, str]  # extra JOBRELAY_* settings for every process
    profile: frozenset[str]  # roles run under cProfile (diagnosis; slows them down)
    job: str = "export"  # what every phase runs: report.export, or bench.noop


def parse_args(argv: list[str] | None) -> Options:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--jobs", type=int, default=1000, help="jobs per phase (default 1000)")
    parser.add_argument("--concurrency", type=int, default=32, help="HTTP clients (default 32)")
    parser.add_argument("--workers", type=int, default=2, help="worker processes (default 2)")
    parser.add_argument("--keep", action="store_true", help="keep the database and vhosts")
    parser.add_argument("--skip-peers", action="store_true", help="do not measure the peers")
    parser.add_argument("--phase-timeout", type=float, default=300.0, help="seconds per phase")
    parser.add_argument("--prefetch", type=int, help="JOBRELAY_PREFETCH for the workers")
    parser.add_argument(
        "--worker-concurrency",
        type=int,
        help="JOBRELAY_CONCURRENCY for the workers (and the queue peers' concurrency)",
    )
    parser.add_argument("--relay-batch", type=int, help="JOBRELAY_RELAY_BATCH for the relay")
    parser.add_argument("--log-level", help="JOBRELAY_LOG_LEVEL for every process")
    parser.add_argument(
        "--job",
        choices=("export", "noop"),
        default="export",
        help="report.export (20-row months) or bench.noop (what jobrelay always does per job)",
    )
    parser.add_argument(
        "--profile",
        default="",
        metavar="ROLES",
        help="comma-separated roles (api,relay,worker) to run under cProfile, for diagnosis "
        "only: profiled figures are slower; the dumps land next to the logs",
    )
    args = parser.parse_args(argv)
    profile = frozenset(r.strip() for r in args.profile.split(",") if r.strip())
    if not profile <= {"api", "relay", "worker"}:
        parser.error("--profile takes api, relay and/or worker")
    if args.jobs < 1 or args.concurrency < 1 or args.workers < 1:
        parser.error("--jobs, --concurrency and --workers must be at least 1")
    tuning = {
        name: str(value)
        for name, value in (
            ("prefetch", args.prefetch),
            ("concurrency", args.worker_concurrency),
            ("relay_batch", args.relay_batch),
            ("log_level", args.log_level),
        )
        if value is not None
    }
    if args.job == "export":
        # report.export is fair by account: the relay admits at most JOBRELAY_FAIR_AHEAD
        # (512) of its unfinished jobs, so the relay phase, which runs with no worker, would
        # stop there. Lifted to N for the run (said on stdout).
        tuning.setdefault("fair_ahead", str(max(args.jobs, 512)))
        print(
            f"bench: JOBRELAY_FAIR_AHEAD={tuning['fair_ahead']}: report.export's fairness "
            "window is lifted to N, so the relay phase (no worker) can publish all N",
            flush=True,
        )
    return Options(
        jobs=args.jobs,
        concurrency=args.concurrency,
        workers=args.workers,
        keep=args.keep,
        skip_peers=args.skip_peers,
        phase_timeout=args.phase_timeout,
        tuning=tuning,
        profile=profile,
        job=args.job,
    )


class Bench:
    def __init__(self, options: Options, stamp: str) -> None:
        self.options = options
        self.log_dir = RESULTS / "logs" / f"pipeline-{stamp}"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.sandbox = Sandbox.new(self.log_dir)
        self.env = self.sandbox.env(options.tuning)
        self.procs: list[RoleProcess] = []
        self.peaks: dict[str, float | None] = {}  # peak RSS of the processes stopped so far
        self.port = 0
        self.db: CountedConnection | None = None
        self.token = ""
        self.db_baseline: dict[str, int] = {}
        self.peer_sample: dict[str, Any] = {}
        self.client: httpx.AsyncClient | None = None
        self.results = Results(
            stamp=stamp,
            options={
                "jobs": options.jobs,
                "concurrency": options.concurrency,
                "workers": options.workers,
                "rows_per_month": ROWS_PER_MONTH,
                "phase_timeout_s": options.phase_timeout,
                "tuning": options.tuning,
                "profiled_roles": sorted(options.profile),
                "job": options.job,
            },
        )
        self.broker_pid: int | None = None
        self.last_seen = "nothing polled yet"  # the latest poll, for a timeout's message
        self.counted_at = 0.0  # when the jobs were last counted by state (``all_succeeded``)

    # --- the run ------------------------------------------------------------------------

    async def run(self) -> None:
        await self.set_up()
        self.port = free_port()
        async with api_client(self.port, self.token, self.options.concurrency) as self.client:
            startup = await self.start_api("api")
            say(f"bench: api ready after {startup:.2f}s")
            await self.phase_accept()
            await self.phase_relay()
            await self.phase_drain()
            if self.options.job == "export":
                await self.phase_bare_export()
            await self.start_everything_again()
            await self.phase_end_to_end()
            await self.phase_fixed_rate()
            await self.check_results()
        await self.stop_processes()
        await self.check_leftovers()
        await self.account_database_work()
        if not self.options.skip_peers:
            prefetch = int(self.options.tuning.get("prefetch", DEFAULT_PREFETCH))
            concurrency = int(self.options.tuning.get("concurrency", DEFAULT_CONCURRENCY))
            await pipeline_peers.measure_peers(self, prefetch, min(concurrency, prefetch))

    async def set_up(self) -> None:
        options = self.options
        say(
            f"bench: {options.jobs} jobs per phase, concurrency {options.concurrency}, "
            f"{options.workers} workers, logs in {self.log_dir.relative_to(REPO)}"
        )
        if options.profile:
            say(
                f"bench: PROFILING {', '.join(sorted(options.profile))}: figures are not comparable"
            )
        level = options.tuning.get("log_level", "INFO").upper()
        per_job = {
            "DEBUG": "3 worker lines and 1 relay line per job",
            "INFO": (
                "one per job, the API's job_accepted; a worker line per second, "
                "a relay line per batch"
            ),
        }.get(level, "")
        say(
            f"bench: log policy: jobrelay at {level}{f' ({per_job})' if per_job else ''}; "
            "Dramatiq at INFO, Celery and Procrastinate at WARNING (none per job)"
        )
        load = await bench_cpu.machine_load()
        self.results.environment["machine_busy_cores_before"] = round(load, 2)
        if load > 0.2:
            say(f"bench: WARNING: the machine is already busy ({load:.2f} cores) before we start")
        await self.sandbox.create()
        say(f"bench: sandbox {self.sandbox.describe()}")
        with contextlib.suppress(BenchFailure, ValueError):
            self.broker_pid = int((await rabbitmqctl("eval", "os:getpid().")).strip().strip('"'))
        await self.jobrelay("db", "upgrade")
        await self.jobrelay("seed", "--rows-per-month", str(ROWS_PER_MONTH))
        created = await self.jobrelay("token", "create", "--admin", "--label", "bench")
        self.token = created.strip().splitlines()[-1]
        self.db_baseline = await self.sandbox.database_activity()
        self.db = await CountedConnection.open(self.sandbox.database_url)
        server_version = await self.scalar("SHOW server_version")
        self.results.environment |= await describe_environment(REPO) | {"postgres": server_version}

    async def jobrelay(self, *args: str) -> str:
        return await run_command(
            [sys.executable, "-m", "jobrelay", *args], env=self.env, log=self.log_dir / "setup.log"
        )

    def spawn(self, name: str, args: list[str], env: dict[str, str] | None = None) -> RoleProcess:
        profile = args[0] in self.options.profile
        proc = RoleProcess.spawn(name, args, self.env | (env or {}), self.log_dir, profile=profile)
        self.procs.append(proc)
        return proc

    @property
    def live(self) -> list[RoleProcess]:
        return [p for p in self.procs if p.exit_code is None]

    async def start_api(self, name: str) -> float:
        """An API process on ``self.port``, ready (``/readyz``); its start-up seconds."""
        assert self.client is not None
        api = self.spawn(name, ["api", "--host", "127.0.0.1", "--port", str(self.port)])
        return await wait_ready(self.client, api, READY_TIMEOUT)

    async def retire(self, procs: list[RoleProcess]) -> None:
        """Stop ``procs`` before the next phase (a phase has the machine to itself)."""
        for proc in procs:
            self.peaks[proc.name] = peak_rss_mib(proc.popen.pid)
            code = await proc.stop()
            if code != 0:
                self.results.findings.append(f"{proc.name} exited {code} on SIGTERM (expected 0)")

    async def settled_counters(self) -> dict[str, int]:
        """PostgreSQL's counters for our database with nobody connected (``database_activity``
        waits for that): our own connection is closed for the read, then opened again."""
        assert self.db is not None
        own = self.db.statements + 1  # and the close
        await self.db.close()
        counters = await self.sandbox.database_activity()
        self.db = await CountedConnection.open(self.sandbox.database_url)
        return counters | {"bench_statements": own}

    async def start_everything_again(self) -> None:
        """API, relay and workers for the end-to-end phases, each ready before they start."""
        await self.start_api("api-e2e")
        relay = self.spawn("relay-e2e", ["relay"])
        workers = [
            self.spawn(f"worker-e2e-{i + 1}", ["worker"]) for i in range(self.options.workers)
        ]
        await relay.wait_for_event("relay_started", READY_TIMEOUT)
        for worker in workers:
            await worker.wait_for_event("worker_started", READY_TIMEOUT)

    # --- phases -------------------------------------------------------------------------

    async def phase_accept(self) -> None:
        n = self.options.jobs
        async with self.bounded("accept"), self.cpu() as cpu:
            submitted = await self.submit(n, "accept")
        stored = await self.scalar(
            "SELECT count(*) FROM jobs WHERE id = ANY($1::text[])", submitted.job_ids
        )
        waiting = await self.unpublished()
        if stored != n or waiting != n:
            raise BenchFailure(
                f"accept: {n} POSTs answered 202 but {stored} jobs are stored and "
                f"{waiting} outbox rows wait"
            )
        post = percentiles(submitted.latencies)
        figure = Figure(n, submitted.seconds, {"post_ms": in_ms(post), **cpu_detail(cpu, n)})
        note = f"POST p50 {post['p50'] * 1000:.1f} ms, p95 {post['p95'] * 1000:.1f} ms"
        self.record("accept", figure, note)

    async def phase_relay(self) -> None:
        """The relay alone (the API idle): its reconciler is off for the phase, so its first
        pass, prune and VACUUM stay out of the window; the end-to-end relay runs it."""
        relay = self.spawn("relay", ["relay"], {"JOBRELAY_RECONCILE_SECONDS": "0"})
        async with self.bounded("relay"):
            ready = await relay.wait_for_event("relay_started", READY_TIMEOUT)
            async with self.cpu() as cpu:
                done = await self.poll(self.outbox_drained)
        span = await self.scalar(
            "SELECT EXTRACT(EPOCH FROM max(published_at) - min(published_at)) FROM outbox"
        )
        startup = ready - relay.spawned_at
        cold = self.options.jobs / (done - relay.spawned_at)
        detail = {
            "startup_s": round(startup, 3),
            "cold_rate": round(cold, 1),
            "db_published_at_spread_s": float(span or 0),  # one mark per batch
            **cpu_detail(cpu, self.options.jobs),
        }
        self.record(
            "relay",
            Figure(self.options.jobs, done - ready, detail),
            f"start-up {startup:.2f}s not counted; cold from spawn {cold:.0f}/s",
        )

    async def phase_drain(self) -> None:
        """The workers alone: the API and the relay are stopped first. Timed from the first
        claim to the last result (the events' own timestamps, as every peer is timed); warm
        (first ``worker_started`` to all seen succeeded) and cold (from the spawn) beside it;
        PostgreSQL's commits during the phase, per job."""
        await self.retire(self.live)
        before = await self.settled_counters()
        workers = [self.spawn(f"worker-{i + 1}", ["worker"]) for i in range(self.options.workers)]
        n = self.options.jobs
        async with self.bounded("worker drain"):
            readies = [await w.wait_for_event("worker_started", READY_TIMEOUT) for w in workers]
            async with self.cpu() as cpu:
                done = await self.poll(lambda: self.all_succeeded(n))
        ready = min(readies)
        span = float(
            await self.scalar(
                "SELECT EXTRACT(EPOCH FROM max(at) FILTER (WHERE kind = 'result_saved')"
                " - min(at) FILTER (WHERE kind = 'claimed')) FROM job_events"
            )
            or 0
        )
        await self.retire(workers)
        after = await self.settled_counters()
        commits = after["xact_commit"] - before["xact_commit"] - after["bench_statements"]
        spawned = min(w.spawned_at for w in workers)
        startup = ready - spawned
        detail = {
            "startup_s": round(startup, 3),
            "workers_ready_spread_s": round(max(readies) - ready, 3),
            "warm_rate": round(n / (done - ready), 1),
            "cold_rate": round(n / (done - spawned), 1),
            "commits_per_job": round(commits / n, 2),
            **cpu_detail(cpu, n),
        }
        self.record(
            "worker drain",
            Figure(n, span, detail),
            f"first claim to last result; warm {detail['warm_rate']:.0f}/s, cold "
            f"{detail['cold_rate']:.0f}/s (start-up {startup:.2f}s); "
            f"{detail['commits_per_job']:.2f} commits per job",
        )

    async def phase_bare_export(self) -> None:
        """The drain's exports again, with no queue (``export_bare.py``): as many processes
        as the drain had workers, each at the workers' concurrency, the same months in the
        same order. Timed from their common start to the last one's end; the drain's rate
        over this one is ``export_vs_bare``: how much of the drain's time is the export's."""
        n, processes = self.options.jobs, self.options.workers
        concurrency = int(self.options.tuning.get("concurrency", DEFAULT_CONCURRENCY))
        start_at = time.time() + 3.0  # every process imported and connected by then
        share = -(-n // processes)
        release = self.log_dir / "bare-release"  # they exit once their CPU has been read
        runs = [
            RoleProcess.spawn_command(
                f"bare-{i + 1}",
                [
                    str(BENCH_DIR / "export_bare.py"),
                    self.sandbox.database_url,
                    str(self.sandbox.results_dir / "bare"),
                    str(i * share),
                    str(max(min(share, n - i * share), 0)),
                    str(concurrency),
                    str(start_at),
                    str(release),
                ],
                self.env,
                self.log_dir,
            )
            for i in range(processes)
        ]

        def finished() -> list[dict[str, Any]] | None:
            lines = [run.log_path.read_text().strip().splitlines() for run in runs]
            if not all(each and each[-1].startswith("{") for each in lines):
                return None
            return [json.loads(each[-1]) for each in lines]

        async with self.bounded("bare export"):
            await asyncio.sleep(max(start_at - time.time() - 0.2, 0))
            async with self.cpu(runs) as cpu:
                while (done := finished()) is None:
                    for run in runs:
                        if run.popen.poll() is not None:
                            raise BenchFailure(
                                f"bare export: {run.name} exited {run.popen.returncode}; "
                                f"logs in {self.log_dir}"
                            )
                    await asyncio.sleep(POLL_SECONDS)
            release.touch()
            codes = [await asyncio.to_thread(run.popen.wait) for run in runs]
        if any(codes):
            raise BenchFailure(f"bare export: exit codes {codes}; logs in {self.log_dir}")
        seconds = max(d["finished"] for d in done) - min(d["started"] for d in done)
        self.record(
            "bare export",
            Figure(
                n,
                seconds,
                {"processes": processes, "concurrency": concurrency, **cpu_detail(cpu, n)},
            ),
            f"report.export's body alone: {processes} processes x {concurrency}, no queue",
        )

    async def phase_end_to_end(self) -> None:
        n, total = self.options.jobs, 2 * self.options.jobs
        async with self.bounded("end to end"), self.cpu() as cpu:
            started = time.time()
            submitting = asyncio.create_task(self.submit(n, "e2e"))

            async def finished() -> bool:
                if submitting.done():
                    submitting.result()  # a non-202 surfaces here, not as a timeout
                return await self.all_succeeded(total)

            try:
                done = await self.poll(finished)
                submitted = await submitting
            finally:
                if not submitting.done():
                    submitting.cancel()
                    with contextlib.suppress(asyncio.CancelledError, BenchFailure):
                        await submitting
        assert self.db is not None
        rows = await self.db.fetch(
            "SELECT EXTRACT(EPOCH FROM min(e.at) - j.created_at) AS seconds"
            " FROM jobs j JOIN job_events e ON e.job_id = j.id AND e.kind = 'result_saved'"
            " WHERE j.id = ANY($1::text[]) GROUP BY j.id, j.created_at",
            submitted.job_ids,
        )
        if len(rows) != n:
            raise BenchFailure(
                f"end to end: {n} jobs succeeded but {len(rows)} have a result_saved event"
            )
        latency = percentiles([float(r["seconds"]) for r in rows])
        accepting = n / submitted.seconds
        detail = {
            "accept_rate_under_load": round(accepting, 1),
            "latency_ms": in_ms(latency),
            **cpu_detail(cpu, n),
        }
        self.record(
            "end to end",
            Figure(n, done - started, detail),
            f"accept→succeeded p50 {latency['p50'] * 1000:.0f} ms, "
            f"p95 {latency['p95'] * 1000:.0f} ms; accepting at {accepting:.0f}/s meanwhile",
        )

    async def phase_fixed_rate(self) -> None:
        """Latency at half the end-to-end maximum: a steady load, not a burn-down."""
        e2e = self.results.figures["end to end"]
        rate = e2e.rate / 2
        n = max(1, min(self.options.jobs, int(rate * FIXED_RATE_SECONDS)))
        total = 2 * self.options.jobs + n
        assert self.client is not None
        async with self.bounded("fixed rate"), self.cpu() as cpu:
            started = time.time()
            submitted = await submit_at_rate(
                self.client, n, rate, f"bench-{self.sandbox.run_id}-rate", self.options.job
            )
            done = await self.poll(lambda: self.all_succeeded(total))
        latency = await self.latencies(submitted.job_ids)
        detail = {"rate": round(rate, 1), "latency_ms": in_ms(latency), **cpu_detail(cpu, n)}
        self.record(
            "fixed rate",
            Figure(n, done - started, detail),
            f"{n} jobs sent at {rate:.0f}/s (half the end-to-end maximum); accept→succeeded "
            f"p50 {latency['p50'] * 1000:.0f} ms, p99 {latency['p99'] * 1000:.0f} ms",
        )

    async def latencies(self, job_ids: list[str]) -> dict[str, float]:
        """Percentiles of accept (the job row's created_at) → its result_saved event."""
        assert self.db is not None
        rows = await self.db.fetch(
            "SELECT EXTRACT(EPOCH FROM min(e.at) - j.created_at) AS seconds"
            " FROM jobs j JOIN job_events e ON e.job_id = j.id AND e.kind = 'result_saved'"
            " WHERE j.id = ANY($1::text[]) GROUP BY j.id, j.created_at",
            job_ids,
        )
        if len(rows) != len(job_ids):
            raise BenchFailure(
                f"{len(job_ids)} jobs succeeded but {len(rows)} have a result_saved event"
            )
        return percentiles([float(r["seconds"]) for r in rows])

    # --- checks -------------------------------------------------------------------------

    async def check_results(self) -> None:
        """What a healthy run leaves behind: one result per job, readable over HTTP."""
        assert self.db is not None and self.client is not None
        rows = await self.db.fetch("SELECT kind, count(*) AS n FROM job_events GROUP BY kind")
        kinds = {r["kind"]: int(r["n"]) for r in rows}
        twice = await self.scalar(
            "SELECT count(*) FROM (SELECT job_id FROM job_events WHERE kind = 'result_saved'"
            " GROUP BY job_id HAVING count(*) > 1) t"
        )
        retried = await self.scalar("SELECT count(*) FROM jobs WHERE attempt > 1")
        outbox_rows = await self.scalar("SELECT count(*) FROM outbox")
        self.results.checks |= {
            "events": kinds,
            "jobs_with_two_results": twice,
            "jobs_attempted_twice": retried,
            "outbox_rows": outbox_rows,
        }
        total = int(await self.scalar("SELECT count(*) FROM jobs"))  # every phase's jobs
        findings = self.results.findings
        if twice:
            findings.append(f"{twice} jobs have more than one result_saved event")
        if retried or outbox_rows != total:
            findings.append(
                f"{retried} jobs needed more than one attempt; "
                f"{outbox_rows} outbox rows for {total} jobs"
            )
        for kind in ("duplicate_acked", "deferred", "lease_lost", "retry_scheduled"):
            if kinds.get(kind):
                findings.append(f"{kinds[kind]} '{kind}' events")
        if kinds.get("ack_sent", 0) != total:
            findings.append(f"{kinds.get('ack_sent', 0)} ack_sent events for {total} jobs")
        samples = await self.db.fetch(
            "SELECT id FROM jobs ORDER BY created_at DESC LIMIT $1", RESULT_SAMPLES
        )
        for row in samples if self.options.job == "export" else []:
            response = await self.client.get(f"/v1/jobs/{row['id']}/result")
            lines = list(csv.reader(io.StringIO(response.text)))
            if response.status_code != 200 or len(lines) != ROWS_PER_MONTH + 1:
                raise BenchFailure(
                    f"result of job {row['id']}: HTTP {response.status_code} with "
                    f"{len(lines)} CSV rows (expected 200 with {ROWS_PER_MONTH + 1})"
                )

    async def stop_processes(self) -> None:
        """API first (stop accepting), then the relay, then the workers drain."""
        peaks = self.peaks | {p.name: peak_rss_mib(p.popen.pid) for p in self.live}
        self.results.checks["peak_rss_mib"] = peaks
        say(
            "bench: peak RSS (MiB): "
            + ", ".join(f"{name} {mib:.0f}" for name, mib in peaks.items() if mib is not None)
        )
        for proc in self.live:
            code = await proc.stop()
            if code != 0:
                self.results.findings.append(f"{proc.name} exited {code} on SIGTERM (expected 0)")
        for proc in self.procs:
            dump = self.log_dir / f"{proc.name}.prof"
            if dump.exists():
                say(f"bench: profile of {proc.name}: {summarise_profile(dump).relative_to(REPO)}")
        logs = {p.name: p.log_summary() for p in self.procs}
        self.results.checks["logs"] = logs
        beside = sum(s["stopped"].get("claimsBesideLender", 0) for s in logs.values())
        after = sum(s["stopped"].get("claimsAfterLender", 0) for s in logs.values())
        if beside + after:
            say(
                f"bench: claims in lent slots: {beside} beside their lender's completion, "
                f"{after} after its commit ({100 * beside / (beside + after):.0f} % beside)"
            )
        for name, summary in logs.items():
            for complaint, count in summary["complaints"].items():
                sample = summary["samples"][complaint]
                self.results.findings.append(f"{name} log: {count} x {complaint} ({sample!r})")

    async def check_leftovers(self) -> None:
        """After a graceful stop every message is settled: nothing in any jobrelay queue.

        Depths come from a passive ``queue.declare`` (the queue's own answer): the counts in
        ``rabbitmqctl list_queues`` lag behind for quorum queues by a few seconds.
        """
        listing = await rabbitmqctl(
            "list_queues", "-p", self.sandbox.vhost, "--no-table-headers", "name"
        )
        names = [line.strip() for line in listing.splitlines() if line.strip()]
        queues = await bench_peers.queue_depths(self.sandbox.broker_url, names)
        self.results.checks["queues_after_stop"] = queues
        if queues.get("jobrelay.quarantine"):
            raise BenchFailure(
                f"{queues['jobrelay.quarantine']} messages in jobrelay.quarantine, "
                "though every job succeeded"
            )
        for name, depth in queues.items():
            if depth:
                self.results.findings.append(f"{depth} messages left in {name} after the stop")

    async def account_database_work(self) -> None:
        """Transactions and rows per job, from PostgreSQL's own counters for our database."""
        assert self.db is not None
        row = await self.db.fetchrow("SELECT id, job_id, body, headers FROM outbox LIMIT 1")
        self.peer_sample = dict(row)
        jobs = int(await self.scalar("SELECT count(*) FROM jobs"))
        own = self.db.statements + 1  # and the close
        await self.db.close()
        self.db = None
        after = await self.sandbox.database_activity()
        delta = {key: after[key] - self.db_baseline.get(key, 0) for key in after}
        delta["xact_commit"] -= own
        per_job = {key: round(value / jobs, 2) for key, value in delta.items()}
        self.results.checks["database_per_job"] = per_job | {"benchmark_statements": own}
        say(
            f"bench: PostgreSQL work per job (api + relay + worker, every phase): "
            f"{per_job['xact_commit'] + per_job['xact_rollback']:.1f} transactions "
            f"({per_job['xact_commit']:.1f} committed, {per_job['xact_rollback']:.1f} rolled "
            f"back), {per_job['tup_inserted']:.1f} rows inserted, "
            f"{per_job['tup_updated']:.1f} updated"
        )

    # --- helpers ------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def bounded(self, phase: str) -> AsyncIterator[None]:
        """Fail the run with a clear message when ``phase`` outlives ``--phase-timeout``."""
        self.last_seen = "nothing polled yet"
        timeout = self.options.phase_timeout
        try:
            async with asyncio.timeout(timeout):
                yield
        except TimeoutError:
            raise BenchFailure(
                f"{phase}: not finished within {timeout:g}s (--phase-timeout); "
                f"last seen: {self.last_seen}; logs in {self.log_dir}"
            ) from None

    @contextlib.asynccontextmanager
    async def cpu(self, extra: Sequence[RoleProcess] = ()) -> AsyncIterator[bench_cpu.CpuUse]:
        """Cores and CPU seconds per process group while the block runs (filled in when it
        ends); ``extra``: processes counted beside the live roles."""
        assert self.db is not None
        roles = {p.name: p.popen.pid for p in (*self.live, *extra)}
        postgres = await bench_cpu.postgres_pids(self.db, self.sandbox.database)
        before = bench_cpu.snapshot(roles, postgres, self.broker_pid)
        used = bench_cpu.CpuUse({}, {})
        yield used
        postgres = await bench_cpu.postgres_pids(self.db, self.sandbox.database)
        after = bench_cpu.snapshot(roles, postgres, self.broker_pid)
        used.cores.update(bench_cpu.cores_used(before, after))
        used.seconds.update(bench_cpu.cpu_seconds(before, after))

    async def submit(self, n: int, tag: str) -> Submitted:
        assert self.client is not None
        prefix = f"bench-{self.sandbox.run_id}-{tag}"
        return await submit(self.client, n, self.options.concurrency, prefix, self.options.job)

    async def poll(self, probe: Callable[[], Awaitable[bool]]) -> float:
        """Poll ``probe`` until it holds; the epoch time it was seen holding."""
        while True:
            for proc in self.live:
                proc.check_alive()
            if await probe():
                return time.time()
            await asyncio.sleep(POLL_SECONDS)

    async def scalar(self, query: str, *args: Any) -> Any:
        assert self.db is not None
        return await self.db.fetchval(query, *args)

    async def unpublished(self) -> int:
        """The outbox rows not yet published, through the relay's partial indexes
        (``bench_probes.UNPUBLISHED`` says how and why)."""
        return int(await self.scalar(UNPUBLISHED))

    async def outbox_drained(self) -> bool:
        waiting = await self.unpublished()
        self.last_seen = f"{waiting} unpublished outbox rows"
        await asyncio.sleep(waiting / FASTEST_RATE)  # not done before that anyway
        return waiting == 0

    async def all_succeeded(self, total: int) -> bool:
        """True once exactly ``total`` jobs exist and all succeeded; fails on a quarantine.
        Only the unfinished are counted while there are any, the jobs by state once a second
        meanwhile and once none is left (``bench_probes`` says why)."""
        assert self.db is not None
        unfinished = int(await self.scalar(UNFINISHED))
        if unfinished and time.monotonic() - self.counted_at < QUARANTINE_LOOK_SECONDS:
            self.last_seen = f"{unfinished} unfinished jobs"
            await asyncio.sleep(unfinished / FASTEST_RATE)  # not done before that anyway
            return False
        # Every job finished, or a second since the last look for a quarantine.
        self.counted_at = time.monotonic()
        rows = await self.db.fetch("SELECT state, count(*) AS n FROM jobs GROUP BY state")
        states = {r["state"]: int(r["n"]) for r in rows}
        self.last_seen = f"jobs by state {states}, {await self.unpublished()} unpublished rows"
        if states.get("quarantined"):
            bad = await self.db.fetch(
                "SELECT id, quarantine_reason, last_error FROM jobs"
                " WHERE state = 'quarantined' ORDER BY updated_at LIMIT 3"
            )
            raise BenchFailure(
                f"{states['quarantined']} jobs quarantined; first: "
                + "; ".join(f"{r['id']}: {r['quarantine_reason'] or r['last_error']}" for r in bad)
                + f" (rerun with --keep and use `jobrelay job show`; logs in {self.log_dir})"
            )
        return states.get("succeeded", 0) == total == sum(states.values())

    def record(self, phase: str, figure: Figure, note: str) -> None:
        self.results.figures[phase] = figure
        print_phase(phase, figure, note)

    async def clean_up(self) -> None:
        """Stop what still runs, then drop the sandbox (unless ``--keep``); never raises."""
        for proc in self.procs:
            if proc.exit_code is None:
                await proc.stop()
        if self.db is not None:
            with contextlib.suppress(Exception):
                await self.db.close()
        if self.options.keep:
            say(f"bench: kept {self.sandbox.describe()}")
            say(
                f"bench: inspect with JOBRELAY_DATABASE_URL={self.sandbox.database_url} "
                f"JOBRELAY_BROKER_URL={self.sandbox.broker_url} .venv/bin/jobrelay jobs list"
            )
            return
        self.results.cleanup_problems = await self.sandbox.destroy()
        for problem in self.results.cleanup_problems:
            print(f"bench: cleanup: {problem}", file=sys.stderr)


async def amain(options: Options, kind: type[Bench] = Bench, name: str = "pipeline") -> int:
    """Run ``kind`` (this bench, or one built on it: ``tracing_bench``), always cleaning up;
    its figures go to ``bench-results/NAME-*.json``."""
    task = asyncio.current_task()
    assert task is not None
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
    started = time.monotonic()
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    bench = kind(options, stamp)
    results = bench.results
    try:
        await bench.run()
    except BenchFailure as exc:
        results.failure = str(exc)
    except asyncio.CancelledError:
        results.failure = "interrupted"
        raise
    finally:
        await bench.clean_up()
        elapsed = time.monotonic() - started
        path = RESULTS / f"{name}-{stamp}.json"
        write_json(results, path, elapsed, str(bench.log_dir.relative_to(REPO)))
        print_table(results)
        say(bench_line(results))
        if results.failure is not None:
            print(f"\nbench: FAILED: {results.failure}", file=sys.stderr)
        say(
            f"\nbench: figures in {path.relative_to(REPO)}, logs in "
            f"{bench.log_dir.relative_to(REPO)}; took {elapsed:.1f}s"
        )
    return 0 if results.failure is None else 1


def amain_with(kind: type[Bench], options: Options, name: str) -> int:
    """``amain`` from a script's ``main``: 130 when interrupted."""
    try:
        return asyncio.run(amain(options, kind, name))
    except (KeyboardInterrupt, asyncio.CancelledError):
        print("bench: interrupted; cleaned up", file=sys.stderr)
        return 130


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if any(arg == "--soak" or arg.startswith("--soak=") for arg in args):
        return soak_bench.main(args)  # the soak mode: bench/soak_bench.py, its own options
    return amain_with(Bench, parse_args(args), "pipeline")


if __name__ == "__main__":
    sys.exit(main())
