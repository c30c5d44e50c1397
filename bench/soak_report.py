"""The soak's samples: what the database looks like each minute, the rows printed, the verdict.

A sample reads, from the soak's own database:

- per table (``TABLES``): ``n_live_tup`` and ``n_dead_tup`` from ``pg_stat_user_tables`` (the
  statistics PostgreSQL keeps, a second or so behind) and ``pg_total_relation_size`` (heap,
  indexes and TOAST, bytes);
- the outbox backlog: rows not yet published;
- relay lag p99: ``published_at - created_at`` of the outbox rows published since the last
  sample;
- end-to-end p99: the job row's ``created_at`` (accepted) to its first ``result_saved`` event,
  for the jobs first seen ``succeeded`` in this sample (the client keeps the ids it was given).

The verdict compares the first samples after a warm-up (retention plus two reconciler
periods: before that the tables fill up to the retention horizon) with the last ones: each
size, live row count, the backlog and both latencies must stay within ``(1 + tolerance) x first +
floor``, where the floor is the swing a healthy run has anyway (see ``floor_of``).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import asyncpg

TABLES = ("jobs", "job_events", "outbox", "effects_ledger", "local_messages")
MIB = 1024 * 1024


@dataclass
class Sample:
    at: float  # seconds since the soak started
    submitted: int  # this interval
    succeeded: int  # first seen succeeded in this interval
    tables: dict[str, dict[str, int]]  # table → live, dead, bytes
    backlog: int
    relay_p99_ms: float | None
    e2e_p99_ms: float | None
    cores: dict[str, float] = field(default_factory=dict)  # total, others
    extra: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def p99(values: list[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]


async def read_tables(db: asyncpg.Connection) -> dict[str, dict[str, int]]:
    rows = await db.fetch(
        "SELECT relname, n_live_tup, n_dead_tup, pg_total_relation_size(relid) AS bytes"
        " FROM pg_stat_user_tables WHERE relname = ANY($1::text[])",
        list(TABLES),
    )
    found = {
        r["relname"]: {
            "live": int(r["n_live_tup"]),
            "dead": int(r["n_dead_tup"]),
            "bytes": int(r["bytes"]),
        }
        for r in rows
    }
    return {name: found.get(name, {"live": 0, "dead": 0, "bytes": 0}) for name in TABLES}


async def relay_lags(db: asyncpg.Connection, since: Any, until: Any) -> list[float]:
    """Created → published, seconds, of the outbox rows published in (since, until]."""
    rows = await db.fetch(
        "SELECT EXTRACT(EPOCH FROM published_at - created_at)::float8 AS lag FROM outbox"
        " WHERE published_at > $1 AND published_at <= $2",
        since,
        until,
    )
    return [float(r["lag"]) for r in rows]


async def newly_succeeded(db: asyncpg.Connection, pending: list[str]) -> dict[str, float]:
    """Of ``pending``, the jobs now succeeded: id → accepted → result_saved, seconds."""
    rows = await db.fetch(
        "SELECT j.id, EXTRACT(EPOCH FROM (SELECT min(e.at) FROM job_events e"
        " WHERE e.job_id = j.id AND e.kind = 'result_saved') - j.created_at)::float8 AS e2e"
        " FROM jobs j WHERE j.state = 'succeeded' AND j.id = ANY($1::text[])",
        pending,
    )
    return {r["id"]: float(r["e2e"]) if r["e2e"] is not None else math.nan for r in rows}


SHORT = {"job_events": "events", "effects_ledger": "effects", "local_messages": "local_msgs"}
LEGEND = (
    "cores: the machine's busy cores over the interval, others: of processes not the soak's; "
    "per table: live rows / dead rows / MiB (table + indexes + TOAST)"
)
HEADER = (
    f"{'min':>5}{'sent':>7}{'done':>7}{'backlog':>8}{'relay p99':>10}{'e2e p99':>9}"
    f"{'cores':>6}{'others':>7}"
) + "".join(f"{SHORT.get(name, name):>22}" for name in TABLES)


def format_row(sample: Sample) -> str:
    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value:.0f}ms"

    cells = (f"{t['live']}/{t['dead']}/{t['bytes'] / MIB:.1f}" for t in sample.tables.values())
    tables = "".join(f"{cell:>22}" for cell in cells)
    return (
        f"{sample.at / 60:>5.1f}{sample.submitted:>7}{sample.succeeded:>7}"
        f"{sample.backlog:>8}{ms(sample.relay_p99_ms):>10}{ms(sample.e2e_p99_ms):>9}"
        f"{sample.cores.get('total', 0):>6.2f}{sample.cores.get('others', 0):>7.2f}{tables}"
    )


def metrics(sample: Sample) -> dict[str, float]:
    """What must stay flat, by name; a latency that was not measured counts as 0. Dead rows
    are shown, not judged: they saw-tooth with autovacuum, and bloat shows in the sizes."""
    values: dict[str, float] = {
        "outbox backlog": sample.backlog,
        "relay p99 ms": sample.relay_p99_ms or 0.0,
        "e2e p99 ms": sample.e2e_p99_ms or 0.0,
    }
    for name, t in sample.tables.items():
        values[f"{name} live rows"] = t["live"]
        values[f"{name} MiB"] = t["bytes"] / MIB
    return values


def floor_of(name: str, first: dict[str, float], rate: float, reconcile: float) -> float:
    """The slack on top of the tolerance: a row count or a size swings by what one reconciler
    period adds before the next prune (``rate x reconcile`` jobs, scaled by the table's rows
    or bytes per job); the backlog by two seconds of jobs; a latency by 50 ms."""
    if name == "outbox backlog":
        return rate * 2
    if name.endswith(" ms"):
        return 50.0
    per_job = first[name] / max(first["jobs live rows"], 1.0)
    return max(per_job * rate * reconcile, 0.5 if name.endswith(" MiB") else 100.0)


@dataclass
class Verdict:
    judged: bool
    flat: bool
    text: str
    grew: dict[str, tuple[float, float]] = field(default_factory=dict)


def verdict(
    samples: list[Sample],
    warm_up: float,
    tolerance: float,
    rate: float,
    reconcile: float,
    window: int = 2,
) -> Verdict:
    """First ``window`` samples after ``warm_up`` seconds against the last ``window``."""
    steady = [s for s in samples if s.at >= warm_up]
    if len(steady) < 2:
        return Verdict(
            False,
            False,
            f"not judged: {len(steady)} samples after the {warm_up:.0f}s warm-up (need 2)",
        )
    k = max(1, min(window, len(steady) // 2))
    first, last = steady[:k], steady[-k:]

    def mean(group: list[Sample], name: str) -> float:
        return sum(metrics(s)[name] for s in group) / len(group)

    names = list(metrics(first[0]))
    before = {name: mean(first, name) for name in names}
    grew: dict[str, tuple[float, float]] = {}
    for name in names:
        after = mean(last, name)
        if after > before[name] * (1 + tolerance) + floor_of(name, before, rate, reconcile):
            grew[name] = (before[name], after)
    span = (
        f"samples at {first[0].at:.0f}-{first[-1].at:.0f}s vs {last[0].at:.0f}-{last[-1].at:.0f}s"
    )
    if not grew:
        return Verdict(True, True, f"flat: {span}, every figure within +{tolerance:.0%} (+ floor)")
    detail = "; ".join(f"{name} {a:.1f} -> {b:.1f}" for name, (a, b) in grew.items())
    return Verdict(True, False, f"NOT flat: {span}: {detail}", grew)
