"""The embedded default's throughput: ``bench.noop`` end to end in one ``jobrelay up``.

SQLite + the local transport, no services: what a user who runs ``jobrelay up`` gets. N jobs
are enqueued the way an application would, in ONE transaction of its own on the same SQLite
file (``noop.enqueue_sync``), while ``jobrelay up`` (API, relay and worker in one process) is
running; timed from that commit until all N are ``succeeded`` (so it includes the relay
noticing a commit made by another process: its poll, ``JOBRELAY_RELAY_POLL_SECONDS``). Then
cold: the N jobs committed first and ``jobrelay up`` spawned after, timed from the spawn.
Nothing here is asserted about speed: it fails only if the jobs do not all succeed in time.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

from bench_app import noop
from bench_env import LIFTED, BenchFailure, RoleProcess, free_port, run_command, say_lifted
from bench_probes import FASTEST_RATE, QUARANTINE_LOOK_SECONDS, sqlite_succeeded
from sqlalchemy import create_engine

READY_TIMEOUT = 60.0
POLL_SECONDS = 0.05


async def embedded_drain(
    n: int,
    env: dict[str, str],
    log_dir: Path,
    timeout: float,
    *,
    profile: bool = False,
    cold: bool = False,
) -> float:
    """Jobs per second through one ``jobrelay up`` on a fresh SQLite file (under cProfile,
    to ``LOG_DIR/embedded.prof`` or ``embedded-cold.prof``, with ``profile``: for diagnosis,
    not a comparable figure).

    Warm (the default): ``up`` is ready, then the application commits the N jobs; timed from
    that commit. ``cold``: the N jobs are committed first, then ``up`` is spawned; timed from
    the spawn, so its start-up (imports, migrations check, first claims) is in the figure.
    """
    with tempfile.TemporaryDirectory(prefix="jobrelay-embedded-") as scratch:
        database = Path(scratch) / "jobrelay.db"
        env = {
            **{k: v for k, v in env.items() if not k.startswith("JOBRELAY_")},
            "JOBRELAY_DATABASE_URL": f"sqlite:///{database}",
            "JOBRELAY_BROKER_URL": "local",
            "JOBRELAY_RESULTS_URL": f"file://{scratch}/results",
            "JOBRELAY_APP": "bench_app:app",
            **LIFTED,
        }
        say_lifted()
        await run_command(
            [sys.executable, "-m", "jobrelay", "db", "upgrade"], env=env, log=log_dir / "setup.log"
        )
        if cold:
            _enqueue(database, n)
        started = time.perf_counter()
        up = RoleProcess.spawn(
            "embedded-cold" if cold else "embedded",
            ["up", "--port", str(free_port())],
            env,
            log_dir,
            profile=profile,
        )
        try:
            if not cold:
                await up.wait_for_event("worker_started", READY_TIMEOUT)
                _enqueue(database, n)
                started = time.perf_counter()
            deadline = started + timeout
            counted = time.perf_counter()
            while True:
                up.check_alive()
                # By state once a second meanwhile: a quarantine still ends the run at once.
                look = time.perf_counter() - counted >= QUARANTINE_LOOK_SECONDS
                done, quarantined, unfinished = sqlite_succeeded(database, by_state=look)
                counted = time.perf_counter() if look else counted
                if quarantined:
                    raise BenchFailure(f"embedded: {quarantined} jobs quarantined")
                if done == n:
                    return n / (time.perf_counter() - started)
                if time.perf_counter() > deadline:
                    raise BenchFailure(
                        f"embedded: not all {n} jobs finished and succeeded within {timeout:g}s"
                    )
                # Those left cannot all be done sooner (``bench_probes.FASTEST_RATE``).
                await asyncio.sleep(POLL_SECONDS + unfinished / FASTEST_RATE)
        finally:
            await up.stop()


def _enqueue(database: Path, n: int) -> None:
    """N jobs in ONE transaction of the application's own, as ``enqueue_sync`` makes them."""
    engine = create_engine(f"sqlite:///{database}", connect_args={"timeout": 30})
    with engine.begin() as conn:
        for i in range(n):
            noop.enqueue_sync(conn, {"n": i})
    engine.dispose()


def main() -> None:
    """``python embedded_bench.py --jobs 3000``: the embedded drain alone, from ``bench/``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--jobs", type=int, default=3000, help="jobs (default 3000)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds (default 300)")
    parser.add_argument("--profile", action="store_true", help="run jobrelay up under cProfile")
    parser.add_argument("--log-dir", type=Path, default=Path("bench-results/logs/embedded"))
    args = parser.parse_args()
    args.log_dir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    warm = asyncio.run(
        embedded_drain(args.jobs, env, args.log_dir, args.timeout, profile=args.profile)
    )
    cold = asyncio.run(
        embedded_drain(args.jobs, env, args.log_dir, args.timeout, profile=args.profile, cold=True)
    )
    print(
        f"bench: embedded_jobs_s={warm:.1f} embedded_cold_jobs_s={cold:.1f} jobs={args.jobs}"
        f" profile={args.profile}"
    )


if __name__ == "__main__":
    main()
