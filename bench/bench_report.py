"""The benchmark's figures, the final table and the JSON document."""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench_cpu import CpuUse
from bench_peers import PeerFigure

# Which peer is the floor under which phase (the end-to-end phase has none). The accept
# phase is compared with the bare Starlette endpoint; the raw ``db`` transaction is reported
# beside it (and is the accept phase's peer when Starlette was not run: ``--job export``).
PEER_OF = {"accept": "starlette", "relay": "publish", "worker drain": "raw_consume"}
FALLBACK_PEER_OF = {"accept": "db", "worker drain": "consume"}


def say(text: str = "") -> None:
    print(text, flush=True)


def percentiles(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    cuts = statistics.quantiles(ordered, n=100, method="inclusive") if len(ordered) > 1 else []
    return {
        "p50": statistics.median(ordered),
        "p95": cuts[94] if cuts else ordered[0],
        "p99": cuts[98] if cuts else ordered[0],
        "max": ordered[-1],
    }


def in_ms(values: dict[str, float]) -> dict[str, float]:
    return {key: round(value * 1000, 1) for key, value in values.items()}


@dataclass
class Figure:
    count: int
    seconds: float
    detail: dict[str, Any] = field(default_factory=dict)

    @property
    def rate(self) -> float:
        return self.count / self.seconds if self.seconds > 0 else float("inf")


@dataclass
class Results:
    stamp: str
    options: dict[str, Any]
    figures: dict[str, Figure] = field(default_factory=dict)
    peers: dict[str, PeerFigure] = field(default_factory=dict)
    checks: dict[str, Any] = field(default_factory=dict)
    findings: list[str] = field(default_factory=list)
    environment: dict[str, Any] = field(default_factory=dict)
    failure: str | None = None
    cleanup_problems: list[str] = field(default_factory=list)

    def rows(self) -> list[tuple[str, float, PeerFigure | None]]:
        return [
            (
                phase,
                figure.rate,
                self.peers.get(PEER_OF.get(phase, ""))
                or self.peers.get(FALLBACK_PEER_OF.get(phase, "")),
            )
            for phase, figure in self.figures.items()
        ]


def cpu_detail(cpu: CpuUse, jobs: int) -> dict[str, Any]:
    """A phase's CPU for its figure: cores used per group, and CPU µs per job."""
    return {"cpu_cores": cpu.cores, "cpu_us_per_job": cpu.per_job_us(jobs)}


def print_phase(phase: str, figure: Figure, note: str) -> None:
    counted = f"{figure.count} in {figure.seconds:.2f}s"
    say(f"phase {phase:>12}: {figure.rate:8.1f}/s  ({counted}; {note})")
    if cpu := figure.detail.get("cpu_cores"):
        shares = ", ".join(f"{group} {cores:.2f}" for group, cores in cpu.items() if cores >= 0.01)
        say(f"{'':>20}cores used: {shares}")
    if per_job := figure.detail.get("cpu_us_per_job"):
        spent = ", ".join(f"{group} {us} µs" for group, us in per_job.items())
        say(f"{'':>20}CPU per job: {spent}")


def print_table(results: Results) -> None:
    if not results.figures:
        return
    say()
    say(f"{'phase':<14}{'ours/s':>10}{'peer/s':>10}{'ours/peer':>11}  peer")
    for phase, ours, peer in results.rows():
        if peer is None:
            say(f"{phase:<14}{ours:>10.1f}{'-':>10}{'-':>11}  -")
        else:
            ratio = ours / peer.rate
            say(f"{phase:<14}{ours:>10.1f}{peer.rate:>10.1f}{ratio:>11.2f}  {peer.name}")
    if e2e := results.figures.get("end to end"):
        lat = e2e.detail["latency_ms"]
        say(
            f"end-to-end latency accept→succeeded: p50 {lat['p50']:.0f} ms, "
            f"p95 {lat['p95']:.0f} ms, max {lat['max']:.0f} ms"
        )
    if results.findings:
        say("\nfindings (not failures):")
        for finding in results.findings:
            say(f"  - {finding}")


def write_json(results: Results, path: Path, elapsed: float, logs: str) -> None:
    document = {
        "started_at": results.stamp,
        "elapsed_s": round(elapsed, 2),
        "ok": results.failure is None,
        "failure": results.failure,
        "options": results.options,
        "environment": results.environment,
        "phases": {
            phase: {
                "count": f.count,
                "seconds": round(f.seconds, 4),
                "rate": round(f.rate, 1),
                **f.detail,
            }
            for phase, f in results.figures.items()
        },
        "peers": {
            key: {
                "name": p.name,
                "count": p.count,
                "seconds": round(p.seconds, 4),
                "rate": round(p.rate, 1),
            }
            for key, p in results.peers.items()
        },
        "ratios": {
            phase: round(ours / peer.rate, 3)
            for phase, ours, peer in results.rows()
            if peer is not None
        },
        "checks": results.checks,
        "findings": results.findings,
        "logs": logs,
        "cleanup_problems": results.cleanup_problems,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=2, default=str) + "\n")


QUEUE_PEERS = ("dramatiq", "celery", "procrastinate")  # Dramatiq on a quorum queue


def bench_line(results: Results) -> str:
    """The one line ``make bench`` ends with: each ratio ours / peer from this same run.

    The latencies are the fixed-rate phase's (half the end-to-end maximum), as the target
    asks, falling back to the burn-down's if that phase did not run.

    ``n/a`` where this run did not measure it (a peer skipped, or not built yet).
    """
    accept = results.figures.get("accept")
    drain = results.figures.get("worker drain")
    relay = results.figures.get("relay")
    bare = results.figures.get("bare export")
    e2e = results.figures.get("fixed rate") or results.figures.get("end to end")

    def ratio(ours: Figure | None, key: str) -> str:
        peer = results.peers.get(key)
        return "n/a" if ours is None or peer is None else f"{ours.rate / peer.rate:.2f}"

    latency = e2e.detail["latency_ms"] if e2e is not None else {}
    fields = {
        **{f"drain_vs_{name}": ratio(drain, name) for name in QUEUE_PEERS},
        "drain_vs_dramatiq_classic": ratio(drain, "dramatiq_classic"),
        "drain_vs_raw_consume": ratio(drain, "raw_consume"),
        "relay_vs_raw": ratio(relay, "publish"),
        "accept_vs_starlette": ratio(accept, "starlette"),
        "e2e_p50_ms": f"{latency['p50']:.0f}" if latency else "n/a",
        "e2e_p99_ms": f"{latency['p99']:.0f}" if latency else "n/a",
        "embedded_jobs_s": str(results.checks.get("embedded_jobs_s", "n/a")),
        "embedded_cold_jobs_s": str(results.checks.get("embedded_cold_jobs_s", "n/a")),
        "commits_per_job": str(drain.detail.get("commits_per_job", "n/a")) if drain else "n/a",
        "export_vs_bare": (
            f"{drain.rate / bare.rate:.2f}" if drain is not None and bare is not None else "n/a"
        ),
    }
    return "bench: " + " ".join(f"{k}={v}" for k, v in fields.items())
