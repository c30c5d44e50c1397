"""Worker drain of one task-queue peer: N status-row jobs through its own worker processes.

Run by the peers' venv (``bench/.peers-venv/bin/python bench/peers/drain.py PEER ...``),
never by jobrelay's: it imports Dramatiq, Celery or Procrastinate and nothing of jobrelay.

What it measures, to set beside jobrelay's worker-drain phase (``bench/pipeline_bench.py``):

1. set-up, untimed: ``peer_status`` with N rows ``queued``, the peer's own set-up
   (Procrastinate's schema), then N jobs enqueued (``enqueue_s`` is reported apart).
2. ``--processes`` worker processes started with the library's own worker CLI, each running
   up to ``--concurrency`` jobs at once; every job makes the status-row writes of
   ``status.py``.
3. the drain, timed three ways: from the first claim to the last finish (the rows' own
   ``claimed_at``/``updated_at``, as jobrelay's drain is timed from its events: the figure
   compared); warm, from the FIRST worker process's ready marker (the library's own "ready"
   hook, like jobrelay's first ``worker_started``) until the harness sees all N rows
   ``succeeded``, polling every 50 ms; and cold, from the spawn. Process spawn to first
   ready is ``startup_s``. Also reported: the peak RSS (``VmHWM``) of every worker process, the
   cores the worker processes used during the drain, and rows attempted more than once.
4. the workers are stopped (SIGTERM to each, SIGKILL to its process group after 20 s) and
   ``peer_status`` is dropped. The database and vhost belong to the caller, which drops them.

It prints ONE JSON line on stdout. On failure (a worker died, not all N succeeded within
``--timeout``) it prints one line on stderr, keeps the worker logs and exits 1; exit 2 is a
usage error.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import importlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

PEERS = ("dramatiq", "celery", "procrastinate")
POLL_SECONDS = 0.05
STOP_TIMEOUT = 20.0
PEERS_DIR = Path(__file__).resolve().parent
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
_PR_SET_PDEATHSIG = 1


class DrainFailure(Exception):
    """The peer did not drain the jobs: the one line the harness prints before exit 1."""


@dataclass
class WorkerProcess:
    """One worker command, in a process group of its own, logging to a file."""

    label: str
    popen: subprocess.Popen[bytes]
    log_path: Path
    spawned_at: float

    def tail(self, lines: int = 3) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return " | ".join(line.strip() for line in text.strip().splitlines()[-lines:])

    def check_alive(self) -> None:
        code = self.popen.poll()
        if code is not None:
            raise DrainFailure(f"{self.label} exited with code {code}: {self.tail()}")

    def stop(self) -> int:
        """SIGTERM, SIGKILL to its whole group after 20 s.

        SIGTERM goes to the spawned process only: a supervisor (Dramatiq's) forwards it to
        its children, and a child that got a second one from the group would stop hard.
        """
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait()
        # Children a supervisor left behind (it exited first): the group is ours to end.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.popen.pid, signal.SIGKILL)
        return self.popen.returncode


@dataclass
class Drain:
    peer: str
    module: ModuleType
    jobs: int
    processes: int
    concurrency: int
    timeout: float
    workdir: Path
    workers: list[WorkerProcess] = field(default_factory=list)

    @property
    def ready_dir(self) -> Path:
        return self.workdir / "ready"

    def spawn(self, env: dict[str, str]) -> None:
        self.ready_dir.mkdir()
        for label, argv in self.module.worker_commands(self.processes, self.concurrency):
            log_path = self.workdir / f"{label}.log"
            with log_path.open("ab") as log:
                popen = subprocess.Popen(
                    argv,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=env,
                    cwd=PEERS_DIR,
                    start_new_session=True,  # its own group: stop() reaches its children
                    preexec_fn=_die_with_parent,
                )
            self.workers.append(WorkerProcess(label, popen, log_path, time.time()))

    def readies(self) -> dict[int, float]:
        found: dict[int, float] = {}
        for marker in self.ready_dir.iterdir():
            if not marker.name.startswith("."):
                found[int(marker.name)] = float(marker.read_text())
        return found

    def watch(self, db: Any) -> dict[str, Any]:
        """Poll until all N succeeded; the figures, taken while the workers still run."""
        deadline = time.monotonic() + self.timeout
        cpu_at_ready: dict[int, float] | None = None
        succeeded = 0
        while True:
            for worker in self.workers:
                worker.check_alive()
            if cpu_at_ready is None and self.readies():
                cpu_at_ready = self.cpu_seconds()
            row = db.execute(
                "SELECT count(*) FILTER (WHERE state = 'succeeded') FROM peer_status"
            ).fetchone()
            succeeded = int(row[0])
            if succeeded == self.jobs:
                done = time.time()
                break
            if time.monotonic() > deadline:
                states = dict(db.execute("SELECT state, count(*) FROM peer_status GROUP BY 1"))
                raise DrainFailure(
                    f"{succeeded}/{self.jobs} jobs succeeded within --timeout {self.timeout:g}s"
                    f" (rows by state {states}, {len(self.readies())} worker processes ready)"
                )
            time.sleep(POLL_SECONDS)
        cpu_at_done = self.cpu_seconds()
        readies = self.readies()
        if not readies or cpu_at_ready is None:
            raise DrainFailure("all jobs succeeded but no worker process marked itself ready")
        first_ready = min(readies.values())
        seconds = done - first_ready
        spawned = min(w.spawned_at for w in self.workers)
        used = sum(cpu_at_done.get(pid, 0.0) - cpu_at_ready.get(pid, 0.0) for pid in cpu_at_done)
        retried = db.execute("SELECT count(*) FROM peer_status WHERE attempt > 1").fetchone()
        window = db.execute(
            "SELECT EXTRACT(EPOCH FROM max(updated_at) - min(claimed_at)) FROM peer_status"
        ).fetchone()
        db_seconds = float(window[0] or 0)
        return {
            "seconds": round(seconds, 3),
            "jobs_per_s": round(self.jobs / seconds, 1),
            "startup_s": round(first_ready - spawned, 3),
            "ready_processes": len(readies),
            "ready_spread_s": round(max(readies.values()) - first_ready, 3),
            "peak_rss_mib": self.peak_rss(),
            "worker_cpu_cores": round(used / seconds, 2),
            "jobs_attempted_more_than_once": int(retried[0]),
            "db_seconds": round(db_seconds, 3),
            "db_jobs_per_s": round(self.jobs / db_seconds, 1) if db_seconds > 0 else 0.0,
            "cold_jobs_per_s": round(self.jobs / (done - spawned), 1),
        }

    def process_tree(self) -> list[tuple[str, int]]:
        """(label, pid) of every worker process: the spawned ones and their children."""
        children = _children_by_parent()
        tree: list[tuple[str, int]] = []
        for worker in self.workers:
            tree.append((worker.label, worker.popen.pid))
            stack = sorted(children.get(worker.popen.pid, []))
            forked = 0
            while stack:
                pid = stack.pop(0)
                forked += 1
                tree.append((f"{worker.label}/worker-{forked}", pid))
                stack.extend(sorted(children.get(pid, [])))
        return tree

    def peak_rss(self) -> dict[str, float]:
        peaks: dict[str, float] = {}
        for label, pid in self.process_tree():
            with contextlib.suppress(OSError):
                for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                    if line.startswith("VmHWM:"):
                        peaks[label] = round(int(line.split()[1]) / 1024, 1)
        return peaks

    def cpu_seconds(self) -> dict[int, float]:
        used: dict[int, float] = {}
        for _, pid in self.process_tree():
            with contextlib.suppress(OSError, ValueError, IndexError):
                stat = Path(f"/proc/{pid}/stat").read_text()
                fields = stat.rsplit(")", 1)[1].split()
                used[pid] = (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS
        return used

    def stop(self) -> dict[str, int]:
        return {worker.label: worker.stop() for worker in self.workers}


def _children_by_parent() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, ValueError, IndexError):
            stat = (entry / "stat").read_text()
            parent = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(parent, []).append(int(entry.name))
    return children


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM it when the harness dies (even by SIGKILL).

    A caller's timeout kills the harness outright; without this its workers, each in a
    session of its own, would go on consuming. SIGTERM lets them stop gracefully.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("peer", choices=PEERS)
    parser.add_argument("--dsn", required=True, help="postgresql://... of a fresh database")
    parser.add_argument(
        "--amqp", default="", help="amqp://... of a fresh vhost (not for procrastinate)"
    )
    parser.add_argument("--jobs", type=int, default=1000)
    parser.add_argument("--processes", type=int, default=2, help="worker processes")
    parser.add_argument("--concurrency", type=int, default=8, help="threads or jobs per process")
    parser.add_argument(
        "--timeout", type=float, default=120.0, help="seconds from spawn to drained"
    )
    parser.add_argument(
        "--queue-type",
        choices=("classic", "quorum"),
        help="RabbitMQ queue type (default: dramatiq classic, celery quorum; see their modules)",
    )
    args = parser.parse_args(argv)
    if args.jobs < 1 or args.processes < 1 or args.concurrency < 1:
        parser.error("--jobs, --processes and --concurrency must be at least 1")
    if args.peer != "procrastinate" and not args.amqp:
        parser.error(f"{args.peer} needs --amqp")
    if args.peer == "procrastinate" and args.queue_type:
        parser.error("procrastinate has no RabbitMQ queue: no --queue-type")
    return args


def run(args: argparse.Namespace) -> dict[str, Any]:
    # The peer module reads its configuration from the environment (the library's worker
    # CLI imports it in the worker processes, which get the same variables).
    settings = {
        "PEER_DSN": args.dsn,
        "PEER_AMQP_URL": args.amqp,
        "PEER_CONCURRENCY": str(args.concurrency),
        "PEER_QUEUE_TYPE": args.queue_type or "",
    }
    os.environ.update(settings)
    os.environ.pop("PEER_READY_DIR", None)
    sys.path.insert(0, str(PEERS_DIR))
    status = importlib.import_module("status")
    module = importlib.import_module(f"peer_{args.peer}")
    workdir = Path(tempfile.mkdtemp(prefix=f"jobrelay-peer-{args.peer}-"))
    drain = Drain(
        args.peer, module, args.jobs, args.processes, args.concurrency, args.timeout, workdir
    )
    ids = [f"job-{i:06d}" for i in range(args.jobs)]
    with status.connect() as db:
        db.execute(
            "CREATE TABLE peer_status (id text PRIMARY KEY, state text NOT NULL,"
            " attempt integer NOT NULL DEFAULT 0, result_key text, updated_at timestamptz,"
            " claimed_at timestamptz)"
        )
        try:
            with (
                db.cursor() as cur,
                cur.copy("COPY peer_status (id, state, updated_at) FROM STDIN") as copy,
            ):
                for job_id in ids:
                    copy.write_row((job_id, "queued", "now"))
            module.prepare()
            started = time.perf_counter()
            module.enqueue(ids)
            enqueue_s = time.perf_counter() - started
            env = os.environ | {
                "PEER_READY_DIR": str(drain.ready_dir),
                "PYTHONPATH": str(PEERS_DIR),
            }
            try:
                drain.spawn(env)
                figures = drain.watch(db)
            except DrainFailure as exc:
                drain.stop()
                raise DrainFailure(f"{exc}; worker logs kept in {workdir}") from None
            except BaseException:
                drain.stop()
                shutil.rmtree(workdir, ignore_errors=True)
                raise
            exits = drain.stop()
        finally:
            db.execute("DROP TABLE IF EXISTS peer_status")
    shutil.rmtree(workdir, ignore_errors=True)
    return {
        "peer": args.peer,
        "version": module.VERSION,
        "jobs": args.jobs,
        "seconds": figures["seconds"],
        "jobs_per_s": figures["jobs_per_s"],
        "processes": args.processes,
        "concurrency": args.concurrency,
        "startup_s": figures["startup_s"],
        "peak_rss_mib": figures["peak_rss_mib"],
        "timed": "first claim -> last finish (the rows' own timestamps); also first worker"
        " process ready -> all jobs seen succeeded (50 ms polls) and spawn -> seen (cold)",
        "db_seconds": figures["db_seconds"],
        "db_jobs_per_s": figures["db_jobs_per_s"],
        "cold_jobs_per_s": figures["cold_jobs_per_s"],
        "ready_processes": figures["ready_processes"],
        "ready_spread_s": figures["ready_spread_s"],
        "enqueue_s": round(enqueue_s, 3),
        "worker_cpu_cores": figures["worker_cpu_cores"],
        "jobs_attempted_more_than_once": figures["jobs_attempted_more_than_once"],
        "queue_type": module.queue_type(),
        "durability": module.durability(),
        "packages": module.PACKAGES,
        "python": sys.version.split()[0],
        "stop_exit_codes": exits,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # A SIGTERM from the caller unwinds like Ctrl-C, so the workers are stopped.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        result = run(args)
    except DrainFailure as exc:
        print(f"drain: {args.peer}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"drain: {args.peer}: interrupted; workers stopped", file=sys.stderr)
        return 130
    except Exception as exc:  # set-up: a refused connection, a broker error, an import error
        message = " ".join(f"{type(exc).__name__}: {exc}".split())
        print(f"drain: {args.peer}: {message}", file=sys.stderr)
        return 1
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
