"""Bulk enqueue: ``enqueue_many`` against ``enqueue`` one job at a time (the `enqueue:` line).

N ``bench.noop`` jobs written the way an application writes them, inside ONE transaction of
its own: once with N ``noop.enqueue`` calls (one round trip each on PostgreSQL, four
statements each on SQLite), once with one ``noop.enqueue_many`` (statements of 500 rows).
Timed from the transaction's start to its commit, on a fresh PostgreSQL database
(``bench_env.Sandbox``) and on a fresh SQLite file. Nothing is asserted about speed: it fails
only if a job is missing afterwards.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

from bench_app import Noop, noop
from bench_env import BenchFailure, Sandbox, run_command
from sqlalchemy import func, select

import jobrelay
from jobrelay.storage.tables import jobs


async def _rates(url: str, n: int) -> tuple[float, float]:
    """(one by one, many) jobs/s of ``n`` jobs each, on the database at ``url``."""
    engine = jobrelay.create_engine(url)
    try:
        params = [Noop(n=i) for i in range(n)]
        started = time.perf_counter()
        async with engine.begin() as conn:
            for p in params:
                await noop.enqueue(conn, p)
        one = n / (time.perf_counter() - started)
        started = time.perf_counter()
        async with engine.begin() as conn:
            await noop.enqueue_many(conn, params)
        many = n / (time.perf_counter() - started)
        async with engine.connect() as conn:
            written = await conn.scalar(select(func.count()).select_from(jobs))
        if written != 2 * n:
            raise BenchFailure(f"{written} jobs written, {2 * n} enqueued")
        return one, many
    finally:
        await engine.dispose()


async def amain(n: int) -> int:
    log = Path(tempfile.mkdtemp(prefix="jobrelay-enqueue-bench-"))
    sandbox = Sandbox.new(log)
    env = sandbox.env({})
    await sandbox.create()
    try:
        await run_command(
            [sys.executable, "-m", "jobrelay", "db", "upgrade"], env=env, log=log / "setup.log"
        )
        pg_one, pg_many = await _rates(sandbox.database_url, n)
    finally:
        await sandbox.destroy()
    with tempfile.TemporaryDirectory(prefix="jobrelay-enqueue-sqlite-") as scratch:
        url = f"sqlite:///{scratch}/jobrelay.db"
        await run_command(
            [sys.executable, "-m", "jobrelay", "db", "upgrade"],
            env={**env, "JOBRELAY_DATABASE_URL": url},
            log=log / "setup-sqlite.log",
        )
        lite_one, lite_many = await _rates(url, n)
    for name, one, many in (("postgres", pg_one, pg_many), ("sqlite", lite_one, lite_many)):
        print(
            f"enqueue {name:8s} one_by_one={one:8.0f}/s  many={many:8.0f}/s  "
            f"ratio={many / one:5.1f}x  (N={n}, one transaction each)",
            flush=True,
        )
    print(
        f"enqueue: postgres many/one={pg_many / pg_one:.1f}x ({pg_many:.0f} jobs/s) "
        f"sqlite many/one={lite_many / lite_one:.1f}x ({lite_many:.0f} jobs/s)",
        flush=True,
    )
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--jobs", type=int, default=10_000, help="jobs per way (default 10000)")
    args = parser.parse_args()
    try:
        return asyncio.run(amain(args.jobs))
    except BenchFailure as exc:
        print(f"enqueue bench failed: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
