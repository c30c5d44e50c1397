"""`make demo` on a fresh copy of the repository, with no JOBRELAY_* settings at all.

This is the newcomer's first command: it must create its own venv, install, migrate, seed,
run the main job on the embedded default (SQLite + local transport) and exit 0.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from .procs import clean_env

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
ROOT = Path(__file__).resolve().parents[2]


def fresh_copy(dest: Path) -> Path:
    listed = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    for name in listed:
        source = ROOT / name
        if source.is_file():
            target = dest / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
    return dest


@pytest.mark.long
def test_make_demo_on_a_fresh_copy(tmp_path: Path) -> None:
    repo = fresh_copy(tmp_path / "jobrelay")
    assert not (repo / ".venv").exists() and not (repo / "var").exists()
    result = subprocess.run(
        ["make", "demo"],
        cwd=repo,
        env=clean_env(COLUMNS="160"),
        capture_output=True,
        text=True,
        timeout=840,
        check=False,
    )
    out = result.stdout
    assert result.returncode == 0, out[-4000:] + result.stderr[-4000:]
    assert "broker    local" in out and "sqlite:///./var/jobrelay.db" in out
    assert (repo / "var" / "jobrelay.db").is_file()
    assert "same jobId, nothing new created" in out
    assert re.search(r"POST with period 2020-13 -> 422 application/problem\+json", out)
    # Four exports succeed (one after a transient failure), one ends quarantined.
    finals = re.findall(r"^─+ [0-9a-f-]{36}  \w+ \d{4}-\d{2}  (\w+) ─+$", out, re.M)
    assert sorted(finals) == ["quarantined"] + ["succeeded"] * 4, finals
    assert "retry_scheduled" in out and "rejected" in out
    csvs = re.findall(r"CSV: (\S+\.csv)", out)
    assert len(csvs) == 4 and all(Path(c).is_file() for c in csvs)
    assert "curl -s -X POST localhost:8000/v1/exports" in out
    # The demo installed the runtime only: none of the test extra (a newcomer's first
    # command is as short as it can be).
    site = list((repo / ".venv" / "lib").glob("python*/site-packages"))
    assert site and not any((s / name).exists() for s in site for name in ("_pytest", "playwright"))
