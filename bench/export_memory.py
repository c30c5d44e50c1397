"""Peak memory of one ``report.export`` as the month grows: the export must stream.

Creates a scratch PostgreSQL database, fills one account-month with N generated ledger rows
(``generate_series``), runs the real operation in this process and prints the rows, the CSV
size, the time and the process's peak RSS before and after. Run it once per size (a fresh
process each, so the peaks are comparable):

    .venv/bin/python bench/export_memory.py --rows 20000
    .venv/bin/python bench/export_memory.py --rows 1000000
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import tempfile
import time
import uuid

import asyncpg
from sqlalchemy import text

from jobrelay.domain.ids import job_id_for, request_hash
from jobrelay.exports.shipped import report_export
from jobrelay.library.operations import OperationContext
from jobrelay.observe.faults import Faults
from jobrelay.runtime.wiring import open_runtime
from jobrelay.settings import Settings
from jobrelay.storage.engine import upgrade_async
from jobrelay.storage.store import NewJob

ADMIN = "postgresql://postgres@127.0.0.1:5432/postgres"


def peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


async def measure(rows: int) -> None:
    name = f"jobrelay_mem_{uuid.uuid4().hex[:8]}"
    admin = await asyncpg.connect(ADMIN)
    await admin.execute(f'CREATE DATABASE "{name}"')
    url = ADMIN.rsplit("/", 1)[0] + f"/{name}"
    try:
        await upgrade_async(url)
        with tempfile.TemporaryDirectory() as results:
            settings = Settings(database_url=url, results_url=f"file://{results}")
            async with open_runtime(settings, connect_transport=False) as rt:
                async with rt.engine.begin() as conn:
                    await conn.execute(
                        text(
                            "INSERT INTO ledger_entries (account_id, booked_on, period,"
                            " description, counterparty, amount, currency)"
                            " SELECT 'acme', DATE '2021-06-15', '2021-06', 'row ' || g,"
                            " 'Contoso', g % 1000, 'EUR' FROM generate_series(1, :n) g"
                        ),
                        {"n": rows},
                    )
                params = {"accountId": "acme", "period": "2021-06"}
                secret = (await rt.store.id_keys(rt.clock())).current  # as the API keys it
                job_id = job_id_for(secret, "acme", "report.export", params)
                new = NewJob(
                    job_id,
                    "report.export",
                    "acme",
                    params,
                    request_hash("acme", "report.export", params),
                    max_attempts=1,
                )
                await rt.store.submit(new, rt.clock())
                job = await rt.store.get_job(job_id)
                assert job is not None

                async def progress(done: int, total: int) -> None:
                    return None

                before = peak_mib()
                started = time.perf_counter()
                context = OperationContext(
                    job=job,
                    attempt=1,
                    store=rt.store,
                    results=rt.results,
                    faults=Faults(),
                    report_progress=progress,
                    clock=rt.clock,
                )
                result = await report_export.run(context)
                elapsed = time.perf_counter() - started
                print(
                    f"rows={result.meta['rows']} csv_bytes={result.meta['bytes']} "
                    f"seconds={elapsed:.2f} rows_per_s={rows / elapsed:,.0f} "
                    f"peak_rss_before={before:.1f}MiB peak_rss_after={peak_mib():.1f}MiB"
                )
    finally:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await admin.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=200_000)
    asyncio.run(measure(parser.parse_args().rows))


if __name__ == "__main__":
    main()
