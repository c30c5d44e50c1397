"""Limits per key, measured (issue 36): what admission costs a drain, and how full a binding
limit keeps each key.

Three cells, each on a fresh database and vhost (``bench_env.Sandbox``), one relay and two
workers (``JOBRELAY_APP=bench_app:app``): N ``bench.noop`` jobs (no limits), N ``bench.open``
(``ConcurrencyLimit(64)`` per key over 100 keys: never binds with 2 workers' slots) and N
``bench.bound`` (``ConcurrencyLimit(2)`` per key over 10 keys: binds; each job sleeps 5 ms so
that it is seen running). The N jobs are committed in one transaction once every process has
started; a cell's rate is N / (that commit -> all N succeeded). During the bound cell the
benchmark samples, every 20 ms, the jobs running per key (from the database): the most ever
seen (never above 2, or the limit leaked) and the utilisation (the mean of running / limit
over the keys that still had work waiting). Ends with one line:

``limits: none_jobs_s=… open_jobs_s=… open_vs_none=… bound_jobs_s=… bound_max_running=…
bound_utilisation=…``
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

import asyncpg
from bench_app import BOUND_KEYS, BOUND_MAX, bound_noop, noop, open_noop
from bench_env import BenchFailure, RoleProcess, Sandbox, run_command
from sqlalchemy.ext.asyncio import create_async_engine

REPO = Path(__file__).resolve().parent.parent
READY_TIMEOUT = 90.0


async def cell(name: str, job: object, n: int, log_dir: Path) -> tuple[float, int, float]:
    """(jobs/s, most running per key seen, utilisation) of N jobs of ``job``."""
    log = log_dir / name
    log.mkdir(parents=True, exist_ok=True)
    sandbox = Sandbox.new(log)
    env = sandbox.env({})
    await sandbox.create()
    procs: list[RoleProcess] = []
    try:
        await run_command(
            [sys.executable, "-m", "jobrelay", "db", "upgrade"], env=env, log=log / "setup.log"
        )
        procs = [RoleProcess.spawn("relay", ["relay"], env, log, profile=False)]
        procs += [
            RoleProcess.spawn(f"worker-{k}", ["worker"], env, log, profile=False) for k in (1, 2)
        ]
        await procs[0].wait_for_event("relay_started", READY_TIMEOUT)
        for proc in procs[1:]:
            await proc.wait_for_event("worker_started", READY_TIMEOUT)
        db = await asyncpg.connect(sandbox.database_url)
        engine = create_async_engine(
            sandbox.database_url.replace("postgresql://", "postgresql+asyncpg://", 1)
        )
        async with engine.connect() as conn:
            transaction = await conn.begin()
            for i in range(n):
                await job.enqueue(conn, {"n": i})  # type: ignore[attr-defined]
            await transaction.commit()
        started = time.monotonic()
        most, shares = 0, []
        while True:
            states = {
                r["state"]: r["n"]
                for r in await db.fetch("SELECT state, count(*) AS n FROM jobs GROUP BY state")
            }
            if states.get("quarantined"):
                raise BenchFailure(f"{name}: jobs by state {states}")
            if states.get("succeeded", 0) == n:
                break
            if time.monotonic() - started > 600:
                raise BenchFailure(f"{name}: not drained in 600 s: {states}")
            if name == "bound":
                rows = await db.fetch(
                    "SELECT turn_key, count(*) FILTER (WHERE state = 'running') AS running,"
                    " count(*) FILTER (WHERE state <> 'succeeded') AS left"
                    " FROM jobs GROUP BY turn_key"
                )
                busy = [r for r in rows if r["left"] > r["running"]]  # keys with work waiting
                most = max([most, *(int(r["running"]) for r in rows)])
                if busy:
                    shares.append(
                        sum(min(r["running"], BOUND_MAX) for r in busy) / (BOUND_MAX * len(busy))
                    )
            await asyncio.sleep(0.02)
        seconds = time.monotonic() - started
        await db.close()
        await engine.dispose()
        return n / seconds, most, (sum(shares) / len(shares) if shares else 0.0)
    finally:
        for proc in procs:
            await proc.stop()
        await sandbox.destroy()


async def amain(n: int) -> int:
    log_dir = REPO / "bench-results" / "logs" / f"limits-{int(time.time())}"
    none, _, _ = await cell("none", noop, n, log_dir)
    print(f"cell none:  {none:8.1f} jobs/s  (bench.noop, no limits)", flush=True)
    opened, _, _ = await cell("open", open_noop, n, log_dir)
    print(
        f"cell open:  {opened:8.1f} jobs/s  (ConcurrencyLimit(64) x 100 keys, never binds)",
        flush=True,
    )
    bound, most, use = await cell("bound", bound_noop, n, log_dir)
    print(
        f"cell bound: {bound:8.1f} jobs/s  (ConcurrencyLimit({BOUND_MAX}) x {BOUND_KEYS} keys,"
        f" binds): most running per key {most}, utilisation {use:.2f}",
        flush=True,
    )
    print(
        f"limits: none_jobs_s={none:.1f} open_jobs_s={opened:.1f} open_vs_none={opened / none:.2f}"
        f" bound_jobs_s={bound:.1f} bound_max_running={most} bound_utilisation={use:.2f}"
    )
    return 1 if most > BOUND_MAX else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--jobs", type=int, default=10_000, help="jobs per cell (default 10000)")
    args = parser.parse_args()
    return asyncio.run(amain(args.jobs))


if __name__ == "__main__":
    sys.exit(main())
