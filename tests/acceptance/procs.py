"""Run real ``jobrelay`` processes for acceptance and fault tests, and wait on them by polling."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import TypeVar

import httpx

T = TypeVar("T")
JOBRELAY = [sys.executable, "-m", "jobrelay"]
FAST_ENV = {
    "JOBRELAY_RETRY_DELAYS": "1",
    "JOBRELAY_LEASE_SECONDS": "2",
    "JOBRELAY_VISIBILITY_SECONDS": "2",
    "JOBRELAY_RELAY_POLL_SECONDS": "0.1",
    "JOBRELAY_RELAY_CLAIM_SECONDS": "3",
    "JOBRELAY_QUEUE_PAUSE_POLL_SECONDS": "0.2",  # the default 2 s is only waiting here
}


def clean_env(**settings: str) -> dict[str, str]:
    """The test process's environment without any JOBRELAY_* or OTEL_* setting (a machine
    that exports its own traces must not get the tests'), plus ``settings``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JOBRELAY_", "OTEL_"))}
    env.update(settings)
    return env


def run_cli(
    *args: str, env: dict[str, str], cwd: Path | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*JOBRELAY, *args],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def poll(check: Callable[[], T | None], timeout: float = 30, what: str = "condition") -> T:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def supervise_workers(
    start: Callable[..., Proc],
    workers: list[Proc],
    env: dict[str, str],
    done: Callable[[], bool],
    timeout: float,
    what: str,
) -> int:
    """As a supervisor would: restart every worker that died by SIGKILL (exit 137, a fault
    point's crash), until ``done``; returns how many were restarted."""
    restarts = 0

    def settled() -> bool:
        nonlocal restarts
        for i, worker in enumerate(workers):
            if worker.popen.poll() is not None:
                assert worker.popen.returncode == 137, worker.log()[-2000:]
                restarts += 1
                workers[i] = start("worker", "worker", env=env)
        return done()

    poll(settled, timeout, what)
    return restarts


class Proc:
    def __init__(
        self,
        name: str,
        args: list[str],
        env: dict[str, str],
        log_dir: Path,
        cwd: Path | None = None,
    ) -> None:
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        self._log = self.log_path.open("ab")
        self.popen = subprocess.Popen(
            [*JOBRELAY, *args],
            env=env,
            cwd=cwd,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    @property
    def pid(self) -> int:
        return self.popen.pid

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def events(self) -> list[str]:
        """The ``event`` of each JSON line logged so far, in order (a line cut short by a
        write still under way, or a line that is not JSON, is skipped)."""
        found: list[str] = []
        for line in self.log().splitlines():
            if line.startswith("{"):
                with suppress(ValueError):
                    event = json.loads(line).get("event")
                    if isinstance(event, str):
                        found.append(event)
        return found

    def wait_exit(self, timeout: float = 30) -> int:
        return self.popen.wait(timeout)

    def kill9(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()  # SIGKILL
            self.popen.wait(10)

    def stop(self) -> int | None:
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(20)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(5)
        self._log.close()
        return self.popen.returncode


@contextmanager
def processes(log_dir: Path) -> Iterator[Callable[..., Proc]]:
    started: list[Proc] = []

    def start(name: str, *args: str, env: dict[str, str], cwd: Path | None = None) -> Proc:
        proc = Proc(f"{name}-{len(started)}", list(args), env, log_dir, cwd)
        started.append(proc)
        return proc

    try:
        yield start
    finally:
        for proc in started:
            proc.stop()


def wait_http(base: str, proc: Proc, timeout: float = 30) -> None:
    def ready() -> bool:
        if proc.popen.poll() is not None:
            raise AssertionError(f"{proc.name} exited early:\n{proc.log()[-3000:]}")
        try:
            return httpx.get(f"{base}/healthz", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    poll(ready, timeout, f"{base}/healthz")
