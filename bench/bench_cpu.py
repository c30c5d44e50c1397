"""Where the CPU went during a phase: cores used per process group, read from ``/proc``.

On a 2-core machine a phase is bounded either by one single-threaded Python process (about
1.0 core used by it) or by the machine (about 2.0 cores used in total). The groups:

- each jobrelay process, by role;
- ``postgres``: the backends connected to the benchmark database, and the server's writers;
- ``rabbitmq``: the Erlang VM of the broker on 5672 (not other nodes someone may run);
- ``bench``: this script (the HTTP client and the pollers);
- ``kernel threads``: journal and writeback work behind the fsyncs;
- ``other: NAME``: everything else, by command name, such as a test suite someone runs at
  the same time, which makes that run's figures suspect;
- ``unattributed``: interrupt time (loopback networking) and processes that ended within the
  phase (the short-lived processes of someone else's tests, typically).

Steal time (the hypervisor's) is not counted as busy.
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

_TICK = float(os.sysconf("SC_CLK_TCK"))

# Server processes that work for every database: counted as ours, which they mostly are.
_SHARED_BACKENDS = ("walwriter", "background writer", "checkpointer", "autovacuum launcher")


def process_stat(pid: int) -> tuple[int, float] | None:
    """(parent pid, user + system CPU seconds) of one process; None when it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / _TICK


def machine_busy() -> float:
    """CPU seconds spent not idle, over all cores, since boot."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq = values[:7]  # then steal, guest…
    return (user + nice + system + irq + softirq) / _TICK


def command_name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "?"


def all_pids() -> list[int]:
    return [int(entry.name) for entry in Path("/proc").iterdir() if entry.name.isdigit()]


@dataclass(frozen=True)
class Snapshot:
    at: float
    busy: float
    groups: dict[str, dict[int, float]]  # group → pid → CPU seconds


class Fetcher(Protocol):
    async def fetch(self, query: str, *args: Any) -> list[Any]: ...


async def postgres_pids(db: Fetcher, database: str) -> list[int]:
    """The backends serving ``database``, and the server's background writers."""
    rows = await db.fetch(
        "SELECT pid FROM pg_stat_activity WHERE datname = $1 OR backend_type = ANY($2::text[])",
        database,
        list(_SHARED_BACKENDS),
    )
    return [int(r["pid"]) for r in rows]


def snapshot(roles: dict[str, int], postgres: list[int], broker_pid: int | None) -> Snapshot:
    """CPU seconds so far of every process on the machine, by group."""
    named = {pid: name for name, pid in roles.items()}
    named |= dict.fromkeys(postgres, "postgres")
    if broker_pid is not None:
        named[broker_pid] = "rabbitmq"
    named[os.getpid()] = "bench"
    groups: dict[str, dict[int, float]] = {}
    for pid in all_pids():
        stat = process_stat(pid)
        if stat is None:
            continue
        ppid, cpu = stat
        if pid in named:
            group = named[pid]
        elif pid == 2 or ppid == 2:
            group = "kernel threads"
        else:
            group = f"other: {command_name(pid)}"
        groups.setdefault(group, {})[pid] = cpu
    return Snapshot(at=time.monotonic(), busy=machine_busy(), groups=groups)


def cores_used(before: Snapshot, after: Snapshot) -> dict[str, float]:
    """Average cores used per group between two snapshots, plus ``other`` and ``total``.

    A process that started in between counts from zero; one that ended is not counted.
    """
    wall = after.at - before.at
    if wall <= 0:
        return {}
    seconds = cpu_seconds(before, after)
    total = seconds.pop("total") / wall
    used = {group: spent / wall for group, spent in seconds.items()}
    # Interrupt handling (loopback networking) and processes that exited in between.
    used["unattributed"] = max(total - sum(used.values()), 0.0)
    used["total"] = total
    return {group: round(value, 2) for group, value in used.items() if value >= 0.005}


def cpu_seconds(before: Snapshot, after: Snapshot) -> dict[str, float]:
    """CPU seconds per group between two snapshots, and ``total`` (the whole machine's)."""
    used: dict[str, float] = {}
    for group, pids in after.groups.items():
        earlier = before.groups.get(group, {})
        used[group] = sum(cpu - earlier.get(pid, 0.0) for pid, cpu in pids.items())
    used["total"] = after.busy - before.busy
    return used


@dataclass
class CpuUse:
    """What a phase's processes used: cores on average, and CPU seconds in all."""

    cores: dict[str, float]
    seconds: dict[str, float]

    def per_job_us(self, jobs: int) -> dict[str, int]:
        """CPU microseconds per job of each group that did any work for the jobs: where the
        time per job goes, without a profiler (the bench's own client is left out)."""
        if not jobs:
            return {}
        theirs = ("bench", "other")
        ours = {g: s for g, s in self.seconds.items() if not g.startswith(theirs)}
        # The machine's busy time less the client's and the neighbours': what the jobs cost.
        ours["total"] = self.seconds.get("total", 0.0) - sum(
            s for g, s in self.seconds.items() if g.startswith(theirs)
        )
        return {g: round(s / jobs * 1e6) for g, s in ours.items() if s / jobs >= 1e-6}


async def machine_load(seconds: float = 1.0) -> float:
    """Cores busy on the whole machine over ``seconds``: the noise floor before a run."""
    before, started = machine_busy(), time.monotonic()
    await asyncio.sleep(seconds)
    return (machine_busy() - before) / (time.monotonic() - started)
