"""The task-queue peers' own virtualenv, ``bench/.peers-venv``, made on first use.

Why a venv apart: Dramatiq, Celery and Procrastinate bring pika, kombu, py-amqp, billiard and
their own psycopg; none of it may land in the project's venv, where jobrelay's tests would
then pass or fail against packages jobrelay does not declare. The pins live in
``requirements.txt`` beside this file so that a figure measured today compares with one
measured next month.

Idempotent: a stamp named after the requirements' hash says the venv holds exactly those
pins. A changed ``requirements.txt`` rebuilds the venv from scratch (pip would not remove a
package a pin no longer names). Two benches starting at once take a file lock, so one builds
and the other waits. Standard library only: the project's bench calls this from its own
interpreter, and ``python bench/peers/venv.py`` prints the peers' python.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

PEERS_DIR = Path(__file__).resolve().parent
REQUIREMENTS = PEERS_DIR / "requirements.txt"
VENV = PEERS_DIR.parent / ".peers-venv"
INSTALL_TIMEOUT = 600.0


class PeerVenvError(Exception):
    """The peers' venv could not be made (no python3, pip failed): a set-up problem."""


def requirements_digest() -> str:
    return hashlib.sha256(REQUIREMENTS.read_bytes()).hexdigest()[:16]


def venv_python() -> Path:
    return VENV / "bin" / "python"


def ensure_peer_venv() -> Path:
    """The peers' python, after creating and filling the venv if it is missing or stale."""
    stamp = VENV / f".installed-{requirements_digest()}"
    if stamp.exists() and venv_python().exists():
        return venv_python()
    with _build_lock():
        if not (stamp.exists() and venv_python().exists()):  # another bench may have built it
            _build(stamp)
    return venv_python()


@contextlib.contextmanager
def _build_lock() -> Iterator[None]:
    lock_path = VENV.parent / ".peers-venv.lock"
    with lock_path.open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _build(stamp: Path) -> None:
    base = shutil.which("python3") or sys.executable
    if VENV.exists():
        shutil.rmtree(VENV)
    _run([base, "-m", "venv", str(VENV)], "create the venv")
    pip = [str(venv_python()), "-m", "pip", "--disable-pip-version-check", "--quiet"]
    _run([*pip, "install", "--upgrade", "pip"], "upgrade pip")
    _run([*pip, "install", "-r", str(REQUIREMENTS)], "install bench/peers/requirements.txt")
    stamp.touch()


def _run(argv: list[str], what: str) -> None:
    try:
        done = subprocess.run(
            argv,
            capture_output=True,
            text=True,
            stdin=subprocess.DEVNULL,
            timeout=INSTALL_TIMEOUT,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise PeerVenvError(f"peers venv: could not {what}: {exc}") from None
    if done.returncode != 0:
        # pip's warnings come first and its error last: the last lines say what went wrong.
        tail = " | ".join((done.stderr or done.stdout).strip().splitlines()[-3:])
        raise PeerVenvError(f"peers venv: could not {what} (exit {done.returncode}): {tail}")


if __name__ == "__main__":
    try:
        print(ensure_peer_venv())
    except PeerVenvError as exc:
        print(exc, file=sys.stderr)
        sys.exit(1)
