"""How fast one large ``report.export`` runs, against what the database itself needs.

One sitting: a scratch PostgreSQL database gets one account-month of N generated rows
(``seed_month``, what ``jobrelay seed --account --period --rows`` runs), then, in turns,
``COPY (SELECT …) TO STDOUT WITH CSV`` of the same rows through asyncpg into a sink that
only counts the bytes (what the database needs), and the real ``report.export`` in this
process onto ``file://`` (staged, fsynced, published). Then the export once onto ``s3://``
(a moto server in its own process, multipart as in production), and the same month on
SQLite (the embedded default). Prints each run, and ends with

    bench-export: rows=N export_rows_s=X copy_rows_s=Y ratio=R peak_rss_mb=M

(medians of the turns; ``peak_rss_mb`` is the largest peak RSS, in MiB, of the processes
that ran an export: each phase runs in a fresh process of its own, as a worker would).
Asserts nothing about speed: it fails only if an export's row count or checksum is wrong.
``make bench`` runs it after the scaling table.

    .venv/bin/python bench/export_speed.py [--rows 1000000] [--turns 3] [--skip-s3]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import asyncpg

from jobrelay.domain.ids import job_id_for, request_hash
from jobrelay.exports.seed import seed_month
from jobrelay.exports.shipped import report_export
from jobrelay.library.operations import OperationContext
from jobrelay.observe.faults import Faults
from jobrelay.results.staging import StagingResults
from jobrelay.runtime.wiring import Runtime, open_runtime
from jobrelay.settings import Settings
from jobrelay.storage.engine import create_engine, upgrade_async
from jobrelay.storage.store import NewJob

ADMIN = os.environ.get(
    "JOBRELAY_BENCH_PG_ADMIN_URL", "postgresql://postgres@127.0.0.1:5432/postgres"
)
ACCOUNT, PERIOD = "acme", "2021-06"
# asyncpg sends it as COPY (this) TO STDOUT WITH (FORMAT csv)
COPY_SELECT = (
    "SELECT id, booked_on, description, counterparty, amount, currency"
    " FROM ledger_entries WHERE account_id = $1 AND period = $2 ORDER BY id"
)


def peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


async def copy_once(url: str) -> float:
    """Seconds for the database to send the month as CSV (nothing kept)."""
    conn = await asyncpg.connect(url)
    try:
        sent = 0

        async def sink(chunk: bytes) -> None:
            nonlocal sent
            sent += len(chunk)

        started = time.perf_counter()
        await conn.copy_from_query(COPY_SELECT, ACCOUNT, PERIOD, output=sink, format="csv")
        return time.perf_counter() - started
    finally:
        await conn.close()


async def export_once(rt: Runtime, rows: int) -> float:
    """Seconds for the real operation, from its start to the published result."""
    params = {"accountId": ACCOUNT, "period": PERIOD}
    secret = (await rt.store.id_keys(rt.clock())).current  # as the API keys it
    job_id = job_id_for(secret, ACCOUNT, "report.export", params, uuid.uuid4().hex)
    new = NewJob(
        job_id,
        "report.export",
        ACCOUNT,
        params,
        request_hash(ACCOUNT, "report.export", params),
        max_attempts=1,
    )
    await rt.store.submit(new, rt.clock())
    job = await rt.store.get_job(job_id)
    assert job is not None

    async def progress(done: int, total: int) -> None:
        return None

    staging = StagingResults(rt.results)
    started = time.perf_counter()
    result = await report_export.run(
        OperationContext(
            job=job,
            attempt=1,
            store=rt.store,
            results=staging,
            faults=Faults(),
            report_progress=progress,
            clock=rt.clock,
        )
    )
    await staging.publish()
    elapsed = time.perf_counter() - started
    assert result.result_key is not None and result.meta["rows"] == rows, result.meta
    # Where this attempt stored it: on S3 a key of the attempt's own (issue 34).
    key = staging.recorded_key(result.result_key)
    assert key is not None
    digest = hashlib.sha256()
    size = 0
    async for chunk in rt.results.read(key):
        digest.update(chunk)
        size += len(chunk)
    assert (size, digest.hexdigest()) == (result.meta["bytes"], result.meta["sha256"])
    await rt.results.delete(key)
    return elapsed


@contextlib.asynccontextmanager
async def scratch_pg() -> AsyncIterator[str]:
    name = f"jobrelay_export_{uuid.uuid4().hex[:8]}"
    admin = await asyncpg.connect(ADMIN)
    await admin.execute(f'CREATE DATABASE "{name}"')
    try:
        url = ADMIN.rsplit("/", 1)[0] + f"/{name}"
        await upgrade_async(url)
        yield url
    finally:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await admin.close()


@contextlib.contextmanager
def moto_server() -> Iterator[str]:
    """An S3-compatible server in its own process (its memory is not ours)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
                break
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError("moto server did not start")
            time.sleep(0.05)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(10)


def rate(rows: int, seconds: float) -> str:
    return f"{rows / seconds:,.0f} rows/s ({seconds:.2f} s)"


async def phase_postgres(url: str, rows: int, turns: int) -> dict[str, Any]:
    """COPY and the export onto file://, in turns, on the seeded month."""
    with tempfile.TemporaryDirectory() as tmp:
        settings = Settings(database_url=url, results_url=f"file://{tmp}/exports")
        async with open_runtime(settings, connect_transport=False) as rt:
            before = peak_mib()
            copies, exports = [], []
            for turn in range(1, turns + 1):
                copies.append(await copy_once(url))
                exports.append(await export_once(rt, rows))
                print(
                    f"  turn {turn}: COPY {rate(rows, copies[-1])}; "
                    f"export file:// {rate(rows, exports[-1])}; peak RSS {peak_mib():.0f} MiB",
                    flush=True,
                )
    return {
        "copy_s": statistics.median(copies),
        "export_s": statistics.median(exports),
        "before_mib": before,
        "peak_mib": peak_mib(),
    }


async def phase_s3(url: str, rows: int) -> dict[str, Any]:
    """The export onto s3:// (moto, in its own process), multipart as in production."""
    from jobrelay.results.s3 import S3Results  # only this phase's process pays for botocore

    os.environ.update(
        AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1"
    )
    with moto_server() as endpoint:
        settings = Settings(
            database_url=url, results_url="s3://bench-exports/results", s3_endpoint_url=endpoint
        )
        async with open_runtime(settings, connect_transport=False) as rt:
            assert isinstance(rt.results, S3Results)
            await (await rt.results.client()).create_bucket(Bucket="bench-exports")
            before = peak_mib()
            seconds = await export_once(rt, rows)
    return {"s3_s": seconds, "before_mib": before, "peak_mib": peak_mib()}


async def phase_sqlite(rows: int, turns: int) -> dict[str, Any]:
    """The embedded default: the same month seeded into SQLite and exported onto file://."""
    with tempfile.TemporaryDirectory() as tmp:
        url = f"sqlite:///{tmp}/bench.db"
        await upgrade_async(url)
        settings = Settings(database_url=url, results_url=f"file://{tmp}/exports")
        async with open_runtime(settings, connect_transport=False) as rt:
            started = time.perf_counter()
            await seed_month(rt.engine, ACCOUNT, PERIOD, rows)
            seeded = time.perf_counter() - started
            before = peak_mib()
            runs = [await export_once(rt, rows) for _ in range(turns)]
    return {
        "sqlite_s": statistics.median(runs),
        "seed_s": seeded,
        "before_mib": before,
        "peak_mib": peak_mib(),
    }


def run_phase(phase: str, url: str, rows: int, turns: int) -> dict[str, Any]:
    """A phase in a fresh process of its own, so its peak RSS is that phase's alone."""
    done = subprocess.run(
        [
            sys.executable,
            __file__,
            "--phase",
            phase,
            "--url",
            url,
            "--rows",
            str(rows),
            "--turns",
            str(turns),
        ],
        stdout=subprocess.PIPE,
        text=True,
        check=True,
    )
    *lines, last = done.stdout.rstrip().splitlines()
    for line in lines:
        print(line)
    result: dict[str, Any] = json.loads(last)
    return result


@contextlib.asynccontextmanager
async def seeded_postgres(rows: int) -> AsyncIterator[str]:
    async with scratch_pg() as url:
        engine = create_engine(url)
        try:
            started = time.perf_counter()
            await seed_month(engine, ACCOUNT, PERIOD, rows)
            print(f"seed postgresql: {rows:,} rows in {time.perf_counter() - started:.1f} s")
        finally:
            await engine.dispose()
        yield url


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--turns", type=int, default=3, help="COPY/export pairs on PostgreSQL")
    parser.add_argument("--skip-s3", action="store_true")
    parser.add_argument("--skip-sqlite", action="store_true")
    parser.add_argument("--phase", choices=["postgres", "s3", "sqlite"], help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    args = parser.parse_args()
    rows, turns = args.rows, args.turns
    if args.phase is not None:  # a child: one phase, its figures as the last line
        phases = {
            "postgres": lambda: phase_postgres(args.url, rows, turns),
            "s3": lambda: phase_s3(args.url, rows),
            "sqlite": lambda: phase_sqlite(rows, 1),
        }
        print(json.dumps(asyncio.run(phases[args.phase]())))
        return
    started = time.perf_counter()
    out: dict[str, Any] = {}

    async def on_postgres() -> None:
        async with seeded_postgres(rows) as url:
            await asyncio.to_thread(lambda: out.update(pg=run_phase("postgres", url, rows, turns)))
            if not args.skip_s3:
                await asyncio.to_thread(lambda: out.update(s3=run_phase("s3", url, rows, turns)))

    asyncio.run(on_postgres())
    if not args.skip_sqlite:
        out["sqlite"] = run_phase("sqlite", "", rows, turns)
    pg = out["pg"]
    export_rate, copy_rate = rows / pg["export_s"], rows / pg["copy_s"]
    peaks = [pg["peak_mib"]]
    print(
        f"postgresql file://: export {rate(rows, pg['export_s'])} (median of {turns}); "
        f"COPY {rate(rows, pg['copy_s'])}; ratio {export_rate / copy_rate:.2f}; "
        f"peak RSS {pg['peak_mib']:.0f} MiB ({pg['before_mib']:.0f} before the first export)"
    )
    details = []
    if "s3" in out:
        s3 = out["s3"]
        peaks.append(s3["peak_mib"])
        details.append(f"s3_rows_s={rows / s3['s3_s']:.0f} s3_peak_rss_mb={s3['peak_mib']:.0f}")
        print(
            f"postgresql s3:// (moto, multipart): export {rate(rows, s3['s3_s'])}; "
            f"peak RSS {s3['peak_mib']:.0f} MiB ({s3['before_mib']:.0f} before the export)"
        )
    if "sqlite" in out:
        sq = out["sqlite"]
        details.append(f"sqlite_rows_s={rows / sq['sqlite_s']:.0f}")
        print(
            f"sqlite file://: export {rate(rows, sq['sqlite_s'])}; seed {sq['seed_s']:.1f} s; "
            f"peak RSS {sq['peak_mib']:.0f} MiB"
        )
    details.append(f"elapsed_s={time.perf_counter() - started:.0f}")
    print("bench-export-detail: " + " ".join(details))
    print(
        f"bench-export: rows={rows} export_rows_s={export_rate:.0f} copy_rows_s={copy_rate:.0f}"
        f" ratio={export_rate / copy_rate:.2f} peak_rss_mb={max(peaks):.0f}"
    )


if __name__ == "__main__":
    main()
