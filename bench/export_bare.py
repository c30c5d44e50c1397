"""``report.export``'s body with no queue at all: the floor of ``export_vs_bare``.

One process of ``pipeline_bench.py --job export``'s bare phase: it runs N exports of the
seeded months (the drain's months, in the drain's order) at a given concurrency in one
asyncio loop, each what the job does between its claim and its completion: one snapshot,
the count, ``COPY`` of the month through the same chunk handling into a staged ``file://``
result (written and fsynced), and the result published (renamed). No job rows, no broker,
no claim, no completion, no events: what is left of the drain's time is jobrelay's.

    python bench/export_bare.py DATABASE_URL RESULTS_DIR FIRST COUNT CONCURRENCY START_AT RELEASE

Waits until ``START_AT`` (epoch seconds, so several processes start together), then prints
one line of JSON: ``{"started": …, "finished": …, "exports": COUNT}``, and exits once the
file ``RELEASE`` exists (at most a minute later): its PostgreSQL backend is alive until
then, so the bench reads the CPU of both, as it does for the drain's workers.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time

from bench_client import export_body

from jobrelay.exports import csv_format, ledger, report_export
from jobrelay.exports.report_export import ExportParams
from jobrelay.results.staging import StagingResults
from jobrelay.runtime.wiring import Runtime, open_runtime
from jobrelay.settings import Settings
from jobrelay.storage.engine import snapshot


class _NoProgress:
    async def __call__(self, rows: int) -> None:
        return None


async def _export(rt: Runtime, i: int) -> None:
    params = ExportParams.model_validate(export_body(i))
    staging = StagingResults(rt.results, attempt=1)
    session = staging.writer(f"bare/{i}.csv")
    async with snapshot(rt.engine) as conn:
        await ledger.count(conn, params.account_id, params.period)
        async with session as writer:
            await writer.write(csv_format.HEADER)
            await report_export._copy_rows(conn, params, writer, _NoProgress())
    await staging.publish()


def _wait_for_file(path: str, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.05)


async def main(
    url: str, results: str, first: int, count: int, concurrency: int, at: float, release: str
) -> None:
    settings = Settings(database_url=url, results_url=f"file://{results}")
    async with open_runtime(settings, connect_transport=False) as rt:
        await ledger.ensure_table(rt.engine)
        numbers = iter(range(first, first + count))

        async def lane() -> None:
            for i in numbers:
                await _export(rt, i)

        await asyncio.sleep(max(at - time.time(), 0))
        started = time.time()
        await asyncio.gather(*(lane() for _ in range(concurrency)))
        print(json.dumps({"started": started, "finished": time.time(), "exports": count}))
        sys.stdout.flush()
        await asyncio.to_thread(_wait_for_file, release, 60.0)


if __name__ == "__main__":
    url, results, first, count, concurrency, at, release = sys.argv[1:8]
    asyncio.run(main(url, results, int(first), int(count), int(concurrency), float(at), release))
