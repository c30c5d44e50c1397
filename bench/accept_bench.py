"""Only the pipeline benchmark's accept phase: jobs accepted per second by one ``jobrelay api``.

The same set-up, client and figure as ``pipeline_bench.py``'s phase 1 (a fresh PostgreSQL
database and RabbitMQ vhost, N ``POST /v1/exports`` with unique Idempotency-Keys at
concurrency C, every answer a 202), without the relay, drain and end-to-end phases: for
comparing a change to the API's HTTP layer (a server setting, a protocol, a middleware)
before and after, briefly. ``--rounds R`` repeats the phase on fresh api processes of the
same sandbox and prints each rate and the best. The per-token rate limit is lifted
(``bench_env.LIFTED``, said on stdout). No figures file; exit 1 on a functional failure.

    .venv/bin/python bench/accept_bench.py --jobs 3000 --concurrency 32 --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import time
from datetime import UTC, datetime

import pipeline_bench
from bench_client import api_client, wait_ready
from bench_env import BenchFailure, free_port
from bench_report import say


class AcceptOnly(pipeline_bench.Bench):
    rounds = 1

    async def run(self) -> None:
        await self.set_up()
        rates: list[float] = []
        for round_no in range(1, self.rounds + 1):
            await self.scalar("TRUNCATE jobs, outbox, job_events CASCADE")
            port = free_port()
            api = self.spawn(f"api-{round_no}", ["api", "--host", "127.0.0.1", "--port", str(port)])
            async with api_client(port, self.token, self.options.concurrency) as self.client:
                startup = await wait_ready(self.client, api, pipeline_bench.READY_TIMEOUT)
                say(f"bench: round {round_no}: api ready after {startup:.2f}s")
                await self.phase_accept()
            rates.append(self.results.figures["accept"].rate)
            await api.stop()
        say(
            "bench-accept: "
            + ", ".join(f"{rate:.0f}/s" for rate in rates)
            + f"; best {max(rates):.0f}/s ({self.options.jobs} jobs, "
            f"concurrency {self.options.concurrency})"
        )


async def amain(options: pipeline_bench.Options, rounds: int) -> int:
    task = asyncio.current_task()
    assert task is not None
    # SIGTERM (a `timeout` around the run) cancels, so the sandbox is still dropped.
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    bench = AcceptOnly(options, stamp)
    bench.rounds = rounds
    started = time.monotonic()
    try:
        await bench.run()
    except BenchFailure as exc:
        print(f"bench: FAILED: {exc}", file=sys.stderr)
        return 1
    finally:
        await bench.clean_up()
        say(f"bench: took {time.monotonic() - started:.1f}s")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--jobs", type=int, default=2000, help="POSTs per round (2000)")
    parser.add_argument("--concurrency", type=int, default=32, help="HTTP clients (32)")
    parser.add_argument("--rounds", type=int, default=3, help="api processes in turn (3)")
    args = parser.parse_args()
    if min(args.jobs, args.concurrency, args.rounds) < 1:
        parser.error("--jobs, --concurrency and --rounds must be at least 1")
    options = pipeline_bench.parse_args(
        ["--jobs", str(args.jobs), "--concurrency", str(args.concurrency), "--skip-peers"]
    )
    try:
        return asyncio.run(amain(options, args.rounds))
    except (KeyboardInterrupt, asyncio.CancelledError):
        print("bench: interrupted; cleaned up", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
