"""The peers of ``pipeline_bench.py``'s phases, measured in the same sitting.

Each is the floor under one phase, done with the raw library on the same services, or a
task queue a team would otherwise pick, with the same budget. Kept apart from the phases so
each module holds one concept: how jobrelay is driven there, how the peers are here.

- ``starlette`` (accept, ``--job noop`` only), ``db`` (a job + outbox transaction),
  ``publish`` (confirmed persistent publishes to a quorum queue, 500 in flight) and
  ``consume`` (consume + one ack per message, prefetch 200): medians of ``PEER_RUNS``.
- ``raw_consume``: the worker drain's broker floor as the issue defines it: the same
  consumers and prefetch as jobrelay's workers (one channel per worker process), acked
  with ``multiple=True`` per half prefetch; ``drain_vs_raw_consume``.
- ``dramatiq`` on a quorum queue (jobrelay's durability) and ``dramatiq_classic`` beside
  it; ``celery`` (quorum) and ``procrastinate``; each timed from its first claim to its last
  finish, from the rows' own timestamps, as jobrelay's drain is.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import bench_peers
import peer_queues
from bench_peers import PeerFigure
from bench_report import say
from embedded_bench import embedded_drain

if TYPE_CHECKING:
    from pipeline_bench import Bench

PEER_RUNS = 3
# name in the results -> (peer harness, queue type); Celery's default is already quorum.
QUEUE_PEER_RUNS = {
    "dramatiq": ("dramatiq", "quorum"),
    "dramatiq_classic": ("dramatiq", "classic"),
    "celery": ("celery", None),
    "procrastinate": ("procrastinate", None),
}


async def measure_peers(bench: Bench, prefetch: int, concurrency: int) -> None:
    sample = bench.peer_sample
    body: str = sample["body"]
    headers = {str(k): str(v) for k, v in json.loads(sample["headers"] or "{}").items()}
    headers |= {"x-jobrelay-job-id": sample["job_id"], "x-jobrelay-outbox-id": str(sample["id"])}
    options = bench.options
    n, dsn, amqp = options.jobs, bench.sandbox.database_url, bench.sandbox.peer_broker_url
    await bench_peers.create_peer_tables(dsn)
    starlette_runs = itertools.count(1)

    def starlette() -> Awaitable[PeerFigure]:
        prefix = f"peer-{bench.sandbox.run_id}-starlette-{next(starlette_runs)}"
        return bench_peers.starlette_accept(
            dsn, bench.token, n, options.concurrency, prefix, bench.env, bench.log_dir
        )

    async def raw_consume() -> PeerFigure:
        await bench_peers.broker_publish(amqp, n, body.encode(), headers)  # untimed fill
        return await bench_peers.broker_consume_batched(amqp, n, options.workers, prefetch)

    # The accept phase's peer takes the same requests, so only when we sent bench.noop.
    accept_peer = [("starlette", starlette)] if options.job == "noop" else []
    steps: list[tuple[str, Callable[[], Awaitable[PeerFigure]]]] = [
        *accept_peer,
        ("db", lambda: bench_peers.db_transactions(dsn, n, body)),
        ("publish", lambda: bench_peers.broker_publish(amqp, n, body.encode(), headers)),
        ("consume", lambda: bench_peers.broker_consume(amqp, n)),
        ("raw_consume", raw_consume),
    ]
    # A peer run lasts a few seconds at most: take the median of a few.
    runs: dict[str, list[PeerFigure]] = {key: [] for key, _ in steps}
    for _ in range(PEER_RUNS):
        for key, measure in steps:
            async with bench.bounded(f"peer {key}"):
                runs[key].append(await measure())
    if options.job == "noop":
        await measure_queue_peers(bench, concurrency)
        async with bench.bounded("embedded"):
            rate = await embedded_drain(
                options.jobs, bench.env, bench.log_dir, options.phase_timeout
            )
        bench.results.checks["embedded_jobs_s"] = round(rate, 1)
        say(f"embedded    jobrelay up: {rate:8.1f}/s  (bench.noop, SQLite + local transport, warm)")
        async with bench.bounded("embedded cold"):
            cold = await embedded_drain(
                options.jobs, bench.env, bench.log_dir, options.phase_timeout, cold=True
            )
        bench.results.checks["embedded_cold_jobs_s"] = round(cold, 1)
        say(
            f"embedded    jobrelay up: {cold:8.1f}/s  (the same, cold: the jobs committed "
            "first, timed from the spawn)"
        )
    for key, figures in runs.items():
        ordered = sorted(figures, key=lambda f: f.rate)
        peer = bench.results.peers[key] = ordered[len(ordered) // 2]
        rates = ", ".join(f"{f.rate:.0f}" for f in figures)
        bench.results.checks.setdefault("peer_runs", {})[key] = [round(f.rate, 1) for f in figures]
        say(f"peer  {key:>12}: {peer.rate:8.1f}/s  (median of {rates}; {peer.name})")


async def measure_queue_peers(bench: Bench, concurrency: int) -> None:
    """Dramatiq (quorum and classic), Celery and Procrastinate draining N no-op jobs with
    the same budget: our worker processes, each with our concurrency (JOBRELAY_CONCURRENCY)."""
    options = bench.options
    for key, (name, queue_type) in QUEUE_PEER_RUNS.items():
        async with bench.bounded(f"peer {key}"):
            figures = await peer_queues.measure(
                name, options.jobs, options.workers, concurrency, queue_type=queue_type
            )
        label = f"{name} {figures['version']}, {figures['queue_type']} queue"
        peer = PeerFigure(label, int(figures["jobs"]), float(figures["db_seconds"]))
        bench.results.peers[key] = peer
        bench.results.checks.setdefault("queue_peers", {})[key] = figures
        say(
            f"peer  {key:>16}: {peer.rate:8.1f}/s first claim to last finish ({label}, "
            f"{options.workers} processes x {concurrency}); warm {figures['jobs_per_s']:.0f}/s,"
            f" cold {figures['cold_jobs_per_s']:.0f}/s (start-up {figures['startup_s']:.2f}s)"
        )
