"""The task-queue peers of the worker drain: Dramatiq, Celery and Procrastinate, same work.

Issue 11 sets jobrelay's worker drain beside the queues a team would otherwise pick, each
doing what a user of it must do to keep a status row as jobrelay keeps ``jobs``: per job a
claim (``running``, attempt + 1) and a finish (``succeeded`` + a result key), each its own
PostgreSQL commit, with the same budget of worker processes and concurrency, and every
durability switch on (see ``bench/peers/peer_*.py`` for each peer's exact settings).

The peers never touch the project's venv: they run under ``bench/.peers-venv``, made on
first use from the pinned ``bench/peers/requirements.txt`` (``bench/peers/venv.py``), and
``bench/peers/drain.py`` does the measuring in there. This module is the project's side:
``run_peer`` makes sure of the venv, runs the harness as a subprocess and returns its JSON
figures. Timed like jobrelay's drain phase: from the first worker process ready until all N
rows are ``succeeded``; start-up is reported apart.

As a script, it measures each peer named on a fresh database and vhost of its own, dropped
at the end, also on failure or Ctrl-C (run it under the machine's benchmark lock)::

    flock /tmp/jobrelay-bench.lock .venv/bin/python bench/peer_queues.py dramatiq celery \\
        procrastinate --jobs 1000 --processes 2 --concurrency 8

It prints each peer's JSON line on stdout and exits 1 if any peer failed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import sys
from pathlib import Path
from typing import Any

from bench_env import AMQP_SERVER, PG_SERVER, BenchFailure, run_command
from peers.venv import PeerVenvError, ensure_peer_venv

from jobrelay.chaos.sandbox import ChaosSetupError, Scratch, Services

PEER_NAMES = ("dramatiq", "celery", "procrastinate")
DRAIN = Path(__file__).resolve().parent / "peers" / "drain.py"
# Past the harness's own --timeout: set-up, enqueueing N jobs, and stopping the workers.
HARNESS_MARGIN = 90.0
_FIGURES = (
    "peer",
    "version",
    "jobs",
    "seconds",
    "jobs_per_s",
    "startup_s",
    "peak_rss_mib",
    "db_seconds",
    "cold_jobs_per_s",
    "queue_type",
)


async def run_peer(
    name: str,
    dsn: str,
    amqp_url: str,
    jobs: int,
    processes: int = 2,
    concurrency: int = 8,
    *,
    timeout: float = 120.0,
    queue_type: str | None = None,
) -> dict[str, Any]:
    """One peer's worker drain on ``dsn`` (an empty database) and ``amqp_url`` (a vhost).

    The figures as ``drain.py`` prints them: ``jobs_per_s``, ``seconds``, ``startup_s``,
    ``peak_rss_mib`` per worker process, the durability settings, the versions.
    ``BenchFailure`` with the harness's one-line reason when the peer did not drain.
    """
    if name not in PEER_NAMES:
        raise ValueError(f"unknown peer {name!r}; one of {', '.join(PEER_NAMES)}")
    try:
        python = await asyncio.to_thread(ensure_peer_venv)
    except PeerVenvError as exc:
        raise BenchFailure(str(exc)) from None
    argv = [str(python), str(DRAIN), name, "--dsn", dsn, "--jobs", str(jobs)]
    argv += ["--processes", str(processes), "--concurrency", str(concurrency)]
    argv += ["--timeout", f"{timeout:g}"]
    if name != "procrastinate":
        argv += ["--amqp", amqp_url]
    if queue_type is not None:
        argv += ["--queue-type", queue_type]
    stdout = await run_command(argv, env=_peer_env(), timeout=timeout + HARNESS_MARGIN)
    lines = [line for line in stdout.splitlines() if line.startswith("{")]
    try:
        figures = json.loads(lines[-1])
    except (IndexError, ValueError):
        raise BenchFailure(f"peer {name}: no JSON line in its output: {stdout[-500:]!r}") from None
    if not isinstance(figures, dict) or not all(key in figures for key in _FIGURES):
        raise BenchFailure(f"peer {name}: unexpected figures {lines[-1][:500]}")
    return figures


def _peer_env() -> dict[str, str]:
    """Our environment without what would steer the peers' interpreter or jobrelay."""
    dropped = {"PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV"}
    return {
        key: value
        for key, value in os.environ.items()
        if key not in dropped and not key.startswith(("JOBRELAY_", "PEER_"))
    }


async def measure(
    name: str,
    jobs: int,
    processes: int = 2,
    concurrency: int = 8,
    *,
    timeout: float = 120.0,
    queue_type: str | None = None,
) -> dict[str, Any]:
    """``run_peer`` on a scratch database (and vhost) made for this one run, then dropped."""
    scratch_name = f"jobrelay_peer_{secrets.token_hex(4)}"
    vhosts = () if name == "procrastinate" else (scratch_name,)
    scratch = Scratch(Services(pg_server=PG_SERVER, amqp_server=AMQP_SERVER), scratch_name, vhosts)
    try:
        try:
            await scratch.create()
        except ChaosSetupError as exc:
            raise BenchFailure(str(exc)) from None
        return await run_peer(
            name,
            f"{PG_SERVER}/{scratch_name}",
            f"{AMQP_SERVER}/{scratch_name}",
            jobs,
            processes,
            concurrency,
            timeout=timeout,
            queue_type=None if name == "procrastinate" else queue_type,
        )
    finally:
        for problem in await scratch.destroy():
            print(f"peer_queues: cleanup: {problem}", file=sys.stderr)


async def amain(args: argparse.Namespace) -> int:
    failed = 0
    for name in args.peers:
        try:
            figures = await measure(
                name,
                args.jobs,
                args.processes,
                args.concurrency,
                timeout=args.timeout,
                queue_type=args.queue_type,
            )
        except BenchFailure as exc:
            print(f"peer_queues: {name}: FAILED: {exc}", file=sys.stderr)
            failed += 1
            continue
        print(json.dumps(figures), flush=True)
        rss = ", ".join(f"{k} {v:.0f}" for k, v in figures["peak_rss_mib"].items())
        print(
            f"peer_queues: {name} {figures['version']}: {figures['jobs_per_s']:.0f} jobs/s "
            f"({figures['jobs']} in {figures['seconds']:.2f}s; start-up {figures['startup_s']:.2f}s"
            f" not counted; peak RSS MiB {rss})",
            file=sys.stderr,
        )
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("peers", nargs="*", choices=PEER_NAMES, default=list(PEER_NAMES))
    parser.add_argument("--jobs", type=int, default=1000)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per drain")
    parser.add_argument("--queue-type", choices=("classic", "quorum"), help="dramatiq/celery only")
    args = parser.parse_args(argv)
    try:
        return asyncio.run(amain(args))
    except KeyboardInterrupt:
        print("peer_queues: interrupted; cleaned up", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
