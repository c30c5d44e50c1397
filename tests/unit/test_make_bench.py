"""``make bench`` runs what its help says, on a fresh checkout, with no variable set.

Its pipeline runs take ``--jobs $(BENCH_JOBS)``; with ``BENCH_JOBS`` never given a default
the command line read ``--jobs`` with no value, and ``make bench`` failed after the scaling
table and the export speed (about five minutes in). ``make -n`` prints the commands without
running them.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _bench_commands(only: str = "bench/pipeline_bench.py", **variables: str) -> list[str]:
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    env = {k: v for k, v in os.environ.items() if not k.startswith("BENCH_")}
    args = [f"{k}={v}" for k, v in variables.items()]
    result = subprocess.run(
        ["make", "-n", "bench", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return [line for line in result.stdout.splitlines() if only in line]


def test_make_bench_gives_every_pipeline_run_its_jobs_per_phase() -> None:
    commands = _bench_commands()
    assert len(commands) == 2, commands
    for command in commands:
        assert "--jobs 10000" in command.split("pipeline_bench.py", 1)[1], command


def test_bench_jobs_sets_the_jobs_per_phase() -> None:
    commands = _bench_commands(BENCH_JOBS="2000")
    assert commands and all("--jobs 2000" in command for command in commands), commands


def test_make_bench_measures_limits_per_key_with_its_jobs_per_phase() -> None:
    """Issue 36: the limits rows (no limit, one that never binds, one that binds) are part
    of ``make bench``, in the same sitting as the peers."""
    commands = _bench_commands(BENCH_JOBS="3000", only="bench/limits_bench.py")
    assert len(commands) == 1 and "--jobs 3000" in commands[0], commands
