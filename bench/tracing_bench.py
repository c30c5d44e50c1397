"""What tracing costs a worker: the drain with OpenTelemetry off, on at 100 % and on at 1 %.

The same pipeline as ``pipeline_bench.py`` (PostgreSQL + RabbitMQ, separate processes, N jobs
of ``--job``), three rounds in one sitting. Each round: the API (traced, so every job
carries a trace context, as it would behind a traced caller) accepts N jobs, a relay (traced)
publishes them, then W workers drain them with

- ``off``: no exporter named: no tracer provider is installed, so the worker runs the path
  it runs without the ``otel`` extra (``observe.tracing.active()`` is false; the SDK is never
  imported);
- ``on 100%``: ``OTEL_TRACES_EXPORTER=otlp`` to a local OTLP/HTTP receiver started here,
  every run sampled (``always_on``): a ``run`` span with ``claim``, ``commit`` and ``ack``
  children and the timeline's events, per job, exported in batches;
- ``on 1%``: the same at ``OTEL_TRACES_SAMPLER=traceidratio``, ``_ARG=0.01`` (a ``run`` is a
  root span linked to its enqueue, so the worker's own sampler decides).

Printed per round: the drain's rate and the workers' CPU per job (their cores over the
drain's wall time, divided by its rate); then the ``tracing:`` line with each cost beside
``off``. The receiver's span count checks the 100 % round really exported a run per job.
Nothing is asserted about speed.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from bench_client import api_client
from bench_env import BenchFailure, free_port
from bench_report import say
from pipeline_bench import Bench, Options, amain_with

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from tests.otlp_receiver import otlp_receiver  # noqa: E402 (after the path)

ROUNDS = (
    ("off", {}),
    ("on 100%", {"OTEL_TRACES_SAMPLER": "always_on"}),
    ("on 1%", {"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.01"}),
)


class TracingBench(Bench):
    async def run(self) -> None:
        await self.set_up()
        base = dict(self.env)
        logs = self.log_dir
        rows: list[tuple[str, float, float]] = []
        with otlp_receiver() as receiver:
            traced = {
                "OTEL_TRACES_EXPORTER": "otlp",
                "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url,
            }
            for label, sampler in ROUNDS:
                say(f"\ntracing: round {label!r}")
                # Its own log files: a phase waits for its processes' first lines.
                self.log_dir = logs / f"round-{len(rows) + 1}"
                self.log_dir.mkdir(parents=True, exist_ok=True)
                await self._empty()
                self.env = base | traced  # the API and the relay: every job carries a trace
                self.port = free_port()
                async with api_client(self.port, self.token, self.options.concurrency) as client:
                    self.client = client
                    await self.start_api("api")
                    await self.phase_accept()
                    await self.phase_relay()
                self.env = base | (traced | sampler if sampler else {})
                before = len([s for s in receiver.snapshot() if s.name.startswith("run ")])
                await self.phase_drain()
                figure = self.results.figures["worker drain"]
                cores = figure.detail["cpu_cores"]
                workers = sum(v for k, v in cores.items() if k.startswith("worker"))
                rate = float(figure.detail["warm_rate"])
                rows.append((label, rate, workers / rate * 1e6))
                self.results.figures[f"worker drain, tracing {label}"] = figure
                if label == "on 100%":
                    runs = await self._runs_received(receiver, before)
                    if runs < self.options.jobs:
                        raise BenchFailure(f"tracing on 100%: {runs} run spans received")
        self.log_dir = logs
        off_rate, off_cpu = rows[0][1], rows[0][2]
        parts = [f"off {off_rate:.0f}/s {off_cpu:.0f} µs CPU/job"]
        for label, rate, cpu in rows[1:]:
            parts.append(
                f"{label} {rate:.0f}/s ({rate / off_rate:.2f}x) {cpu:.0f} µs CPU/job "
                f"({cpu - off_cpu:+.0f} µs per job)"
            )
        say("tracing: " + "; ".join(parts))

    async def _empty(self) -> None:
        """Each round starts from empty tables (its jobs are counted from zero)."""
        await self.scalar("TRUNCATE jobs, outbox, job_events CASCADE")

    async def _runs_received(self, receiver: object, before: int) -> int:
        from tests.otlp_receiver import Receiver

        assert isinstance(receiver, Receiver)
        for _ in range(100):  # the workers sent theirs at exit; the last batch may trail
            runs = len([s for s in receiver.snapshot() if s.name.startswith("run ")]) - before
            if runs >= self.options.jobs:
                return runs
            await asyncio.sleep(0.1)
        return runs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=10_000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--job", choices=("export", "noop"), default="noop")
    parser.add_argument("--keep", action="store_true")
    parser.add_argument(
        "--profile", default="", help="roles under cProfile (diagnosis: not comparable figures)"
    )
    args = parser.parse_args(argv)
    options = Options(
        jobs=args.jobs,
        concurrency=32,
        workers=args.workers,
        keep=args.keep,
        skip_peers=True,
        phase_timeout=300.0,
        tuning={},
        profile=frozenset(r for r in args.profile.split(",") if r),
        job=args.job,
    )
    return amain_with(TracingBench, options, "tracing")


if __name__ == "__main__":
    sys.exit(main())
