"""How long a worker and a relay take to be ready (issue 23, item 8), and where it goes.

A deploy or a crash-restart is a pause of exactly this length, so it is measured as the
operator sees it: from ``Popen`` of ``python -m jobrelay worker`` (or ``relay``) to its
``worker_started`` (``relay_started``) log line, which each logs only once its database pool
and broker channel are open. PostgreSQL and RabbitMQ on loopback, in a scratch database and
vhost (``bench_env.Sandbox``) dropped at the end; each process is stopped (SIGTERM) before
the next is spawned, so the runs do not compete with each other.

Then ``python -X importtime`` of what those two commands import before they are ready, the
ten largest cumulative entries: the import share of the figure above.

Python's bytecode cache decides a good part of the figure: without one, every module of
``src/`` is compiled from source at each start (a checkout run with
``PYTHONDONTWRITEBYTECODE=1``, as on the project's machine). By default the children write
and read a cache of their own (``PYTHONPYCACHEPREFIX`` in a temporary directory, filled by
one spawn of each role that is not counted), as an installed wheel has one; ``--no-bytecode-cache``
measures the other case.

Usage: ``python bench/startup_bench.py [--runs 7] [--no-bytecode-cache]``. Asserts nothing
about speed; it fails only when a process does not become ready.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench_env import BenchFailure, RoleProcess, Sandbox, run_command

READY_TIMEOUT = 30.0
ROLES = {"worker": "worker_started", "relay": "relay_started"}
# What `python -m jobrelay worker` / `relay` import before they log that they are ready.
IMPORTS = (
    "import jobrelay.cli.entry, jobrelay.processes.entry_points, jobrelay.worker.consumer, "
    + ("jobrelay.relay.publisher, jobrelay.maintenance.reconcile, jobrelay.maintenance.scheduler")
)


def child_env(sandbox: Sandbox, *, bytecode_cache: bool) -> dict[str, str]:
    env = sandbox.env({})
    env.pop("PYTHONPYCACHEPREFIX", None)
    if bytecode_cache:
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        env["PYTHONPYCACHEPREFIX"] = str(sandbox.root / "pycache")
    else:
        env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


async def spawn_to_ready(env: dict[str, str], sandbox: Sandbox, role: str, run: int) -> float:
    """Seconds from Popen to the role's ready line (its own timestamp)."""
    proc = RoleProcess.spawn(f"{role}-{run}", [role], env, sandbox.log_dir, profile=False)
    try:
        ready_at = await proc.wait_for_event(ROLES[role], READY_TIMEOUT)
    finally:
        await proc.stop()
    return ready_at - proc.spawned_at


def import_times(env: dict[str, str], top: int = 10) -> tuple[float, list[tuple[float, str]]]:
    """Total import seconds of ``IMPORTS`` and its ``top`` largest cumulative entries."""
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", IMPORTS],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    entries: list[tuple[float, str, bool]] = []
    for line in done.stderr.splitlines():
        if not line.startswith("import time:") or "cumulative" in line:
            continue
        _, cumulative, name = line[len("import time:") :].split("|")
        # One space before an outermost entry's name; a nested one is indented further.
        outermost = not name.startswith("  ")
        entries.append((int(cumulative) / 1e6, name.strip(), outermost))
    # Only the outermost entries add up: a nested one is already in its parent's figure.
    total = sum(seconds for seconds, _, outermost in entries if outermost)
    return total, sorted(((s, n) for s, n, _ in entries), reverse=True)[:top]


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=7, help="spawns per role")
    parser.add_argument(
        "--no-bytecode-cache", action="store_true", help="compile every module at each start"
    )
    args = parser.parse_args()
    cached = not args.no_bytecode_cache
    sandbox = Sandbox.new(Path(tempfile.mkdtemp(prefix="jobrelay-startup-")))
    await sandbox.create()
    try:
        env = child_env(sandbox, bytecode_cache=cached)
        await run_command([sys.executable, "-m", "jobrelay", "db", "upgrade"], env=env)
        if cached:  # fill the cache with everything the two roles import
            for role in ROLES:
                await spawn_to_ready(env, sandbox, role, -1)
        print(f"startup: bytecode cache {'on' if cached else 'off'}, {args.runs} runs per role")
        figures: dict[str, list[float]] = {role: [] for role in ROLES}
        for run in range(args.runs):
            for role in ROLES:
                figures[role].append(await spawn_to_ready(env, sandbox, role, run))
        total, top = import_times(env)
    except BenchFailure as exc:
        print(f"startup: FAILED: {exc}", file=sys.stderr)
        return 1
    finally:
        problems = await sandbox.destroy()
        for problem in problems:
            print(f"startup: cleanup: {problem}", file=sys.stderr)
    for role, seconds in figures.items():
        shown = " ".join(f"{s:.2f}" for s in seconds)
        print(f"startup: {role} spawn→ready median {statistics.median(seconds):.2f}s ({shown})")
    print(f"startup: imports {total:.2f}s in all; the ten largest (cumulative):")
    for cumulative, name in top:
        print(f"  {cumulative:6.3f}s  {name}")
    medians = " ".join(f"{r}_ready_s={statistics.median(s):.2f}" for r, s in figures.items())
    print(f"startup: {medians} imports_s={total:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))
