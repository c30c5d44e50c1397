"""Plumbing for the pipeline benchmark: the scratch services and the jobrelay processes.

- ``Sandbox``: one fresh PostgreSQL database and two fresh RabbitMQ vhosts (one for jobrelay,
  one for the raw aio-pika peer), plus a temporary results directory, all named after one run
  id and all removed by ``destroy()``, which keeps going past individual failures.
- ``RoleProcess``: one ``python -m jobrelay <role>`` subprocess, configured only through
  ``JOBRELAY_*`` variables, logging to a file we can read back (its JSON lines tell us when it
  is ready, and what it complained about).

Everything is loopback. Names are generated here from hex digits, which is why they can be
spliced into ``CREATE DATABASE`` (a statement that takes no parameters).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import platform
import pstats
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime
from importlib import metadata
from pathlib import Path
from typing import Any

import asyncpg

from jobrelay.chaos.sandbox import ChaosSetupError, Scratch, Services

PG_SERVER = "postgresql://postgres@127.0.0.1:5432"
AMQP_SERVER = "amqp://guest:guest@127.0.0.1:5672"
BENCH_DIR = Path(__file__).resolve().parent
COMMAND_TIMEOUT = 120.0  # one-shot commands: db upgrade, seed, rabbitmqctl
STOP_TIMEOUT = 20.0  # SIGTERM → exit, before SIGKILL
_LOG_POLL_SECONDS = 0.05
# What a benchmark lifts from the defaults, and says so: one token submitting as fast as it
# can is what the per-token rate limit exists to stop.
LIFTED = {"JOBRELAY_RATE_LIMIT": "off"}


def say_lifted() -> None:
    lifted = ", ".join(f"{k}={v}" for k, v in LIFTED.items())
    print(f"bench: {lifted}: the per-token rate limit is lifted for this run", flush=True)


class BenchFailure(Exception):
    """A functional failure: jobrelay (or the set-up) did not do its job; exit code 1."""


async def run_command(
    argv: list[str],
    *,
    env: dict[str, str] | None = None,
    log: Path | None = None,
    timeout: float = COMMAND_TIMEOUT,
) -> str:
    """Run a one-shot command; its stdout on success, ``BenchFailure`` otherwise."""
    shown = " ".join(argv[2:] if argv[0] == sys.executable else argv)
    proc = await asyncio.create_subprocess_exec(
        *argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env
    )
    try:
        async with asyncio.timeout(timeout):
            out, err = await proc.communicate()
    except BaseException as exc:  # a timeout, or Ctrl-C: do not leave the command behind
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()
        if isinstance(exc, TimeoutError):
            raise BenchFailure(f"`{shown}` did not finish within {timeout:g}s") from None
        raise
    stdout, stderr = out.decode(errors="replace"), err.decode(errors="replace")
    if log is not None:
        with log.open("a") as f:
            f.write(f"$ {shown}\n{stdout}{stderr}[exit {proc.returncode}]\n\n")
    if proc.returncode != 0:
        raise BenchFailure(f"`{shown}` exited {proc.returncode}: {stderr.strip()[-2000:]}")
    return stdout


async def rabbitmqctl(*args: str) -> str:
    return await run_command(["rabbitmqctl", "-q", *args])


async def describe_environment(repo: Path) -> dict[str, Any]:
    """Versions and revision, so figures from different runs can be compared honestly."""

    def version(dist: str) -> str:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return "?"

    head = await run_command(["git", "-C", str(repo), "rev-parse", "HEAD"])
    dirty = await run_command(["git", "-C", str(repo), "status", "--porcelain", "src"])
    return {
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "rabbitmq": (await rabbitmqctl("version")).strip(),
        "packages": {d: version(d) for d in ("jobrelay", "aio-pika", "asyncpg", "httpx")},
        "git_head": head.strip(),
        "src_files_uncommitted": len(dirty.splitlines()),
    }


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class Sandbox:
    run_id: str
    log_dir: Path
    root: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="jobrelay-bench-")))

    def __post_init__(self) -> None:
        services = Services(pg_server=PG_SERVER, amqp_server=AMQP_SERVER)
        self._scratch = Scratch(services, self.database, (self.vhost, self.peer_vhost))

    @classmethod
    def new(cls, log_dir: Path) -> Sandbox:
        return cls(run_id=secrets.token_hex(4), log_dir=log_dir)

    @property
    def database(self) -> str:
        return f"jobrelay_bench_{self.run_id}"

    @property
    def vhost(self) -> str:
        return f"jobrelay_bench_{self.run_id}"

    @property
    def peer_vhost(self) -> str:
        return f"jobrelay_bench_{self.run_id}_peer"

    @property
    def database_url(self) -> str:
        return f"{PG_SERVER}/{self.database}"

    @property
    def broker_url(self) -> str:
        return f"{AMQP_SERVER}/{self.vhost}"

    @property
    def peer_broker_url(self) -> str:
        return f"{AMQP_SERVER}/{self.peer_vhost}"

    @property
    def results_dir(self) -> Path:
        return self.root / "results"

    def env(self, tuning: dict[str, str]) -> dict[str, str]:
        """The child environment: ours minus any inherited ``JOBRELAY_*``, plus the sandbox,
        with the limits a benchmark must lift (``LIFTED``, said on stdout) lifted."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("JOBRELAY_")}
        say_lifted()
        env |= {
            **LIFTED,
            "JOBRELAY_DATABASE_URL": self.database_url,
            "JOBRELAY_BROKER_URL": self.broker_url,
            "JOBRELAY_RESULTS_URL": f"file://{self.results_dir}",
            # The export app plus the no-op job the drain is compared with the peers on.
            "JOBRELAY_APP": "bench_app:app",
            "PYTHONPATH": os.pathsep.join(
                p for p in (str(BENCH_DIR), os.environ.get("PYTHONPATH", "")) if p
            ),
            **{f"JOBRELAY_{k.upper()}": v for k, v in tuning.items()},
        }
        return env

    async def create(self) -> None:
        try:
            await self._scratch.create()
        except ChaosSetupError as exc:
            raise BenchFailure(str(exc)) from None

    async def destroy(self) -> list[str]:
        """Drop everything this sandbox created; the problems met on the way (not raised)."""
        problems = await self._scratch.destroy()
        shutil.rmtree(self.root, ignore_errors=True)
        return problems

    async def database_activity(self, settle: float = 15.0) -> dict[str, int]:
        """Cumulative transaction and row counters of the sandbox database.

        Read from another database once no session is connected to ours any more: a backend
        reports its counters when it exits, so only then are they complete.
        """
        admin = await asyncpg.connect(f"{PG_SERVER}/postgres")
        try:
            for _ in range(int(settle / 0.1)):
                sessions = await admin.fetchval(
                    "SELECT count(*) FROM pg_stat_activity WHERE datname = $1", self.database
                )
                if not sessions:
                    break
                await asyncio.sleep(0.1)
            await asyncio.sleep(0.2)  # the exiting backends' last report
            row = await admin.fetchrow(
                "SELECT xact_commit, xact_rollback, tup_inserted, tup_updated, tup_deleted,"
                " tup_returned, tup_fetched FROM pg_stat_database WHERE datname = $1",
                self.database,
            )
        finally:
            await admin.close()
        return {key: int(value) for key, value in dict(row).items()}

    def describe(self) -> str:
        return (
            f"database {self.database}, vhosts {', '.join(self._scratch.created_vhosts) or '-'}, "
            f"results {self.results_dir}"
        )


class CountedConnection:
    """The benchmark's own connection to the sandbox database, counting its statements.

    Each one is a transaction of its own in ``pg_stat_database``; ``database_activity``
    figures subtract them so what remains is jobrelay's work.
    """

    def __init__(self, conn: asyncpg.Connection) -> None:
        self._conn = conn
        self.statements = 0

    @classmethod
    async def open(cls, dsn: str) -> CountedConnection:
        return cls(await asyncpg.connect(dsn))

    async def fetch(self, query: str, *args: Any) -> list[Any]:
        self.statements += 1
        return list(await self._conn.fetch(query, *args))

    async def fetchrow(self, query: str, *args: Any) -> Any:
        self.statements += 1
        return await self._conn.fetchrow(query, *args)

    async def fetchval(self, query: str, *args: Any) -> Any:
        self.statements += 1
        return await self._conn.fetchval(query, *args)

    async def close(self) -> None:
        await self._conn.close()


@dataclass
class RoleProcess:
    """One long-running ``jobrelay`` process (api, relay or worker) and its log file."""

    name: str
    popen: subprocess.Popen[bytes]
    log_path: Path
    spawned_at: float  # time.time()
    exit_code: int | None = None
    _read_offset: int = 0
    _pending: str = ""

    @classmethod
    def spawn(
        cls, name: str, args: list[str], env: dict[str, str], log_dir: Path, *, profile: bool
    ) -> RoleProcess:
        """Start ``python -m jobrelay ARGS``; under cProfile (to ``NAME.prof``) if asked."""
        profiler = ["-m", "cProfile", "-o", str(log_dir / f"{name}.prof")] if profile else []
        return cls.spawn_command(name, [*profiler, "-m", "jobrelay", *args], env, log_dir)

    @classmethod
    def spawn_command(
        cls, name: str, args: list[str], env: dict[str, str], log_dir: Path
    ) -> RoleProcess:
        """Start ``python ARGS`` (a peer's server, say), logging to ``NAME.log``."""
        log_path = log_dir / f"{name}.log"
        with log_path.open("ab") as log:
            popen = subprocess.Popen(
                [sys.executable, *args],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                # Our own session: a Ctrl-C on the terminal reaches only the benchmark, which
                # then stops its children in order.
                start_new_session=True,
            )
        return cls(name=name, popen=popen, log_path=log_path, spawned_at=time.time())

    def check_alive(self) -> None:
        code = self.popen.poll()
        if code is not None:
            raise BenchFailure(
                f"{self.name} exited unexpectedly with code {code}; last log lines "
                f"({self.log_path}):\n{self.tail()}"
            )

    def tail(self, lines: int = 15) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def _new_entries(self) -> list[dict[str, Any]]:
        with self.log_path.open("r", errors="replace") as f:
            f.seek(self._read_offset)
            chunk = f.read()
            self._read_offset = f.tell()
        *complete, self._pending = (self._pending + chunk).split("\n")
        return [entry for line in complete if (entry := _json_line(line)) is not None]

    async def wait_for_event(self, event: str, timeout: float) -> float:
        """Wait for the first log line with ``"event": event``; its timestamp (epoch)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for entry in self._new_entries():
                if entry.get("event") == event:
                    return datetime.fromisoformat(str(entry["ts"])).timestamp()
            self.check_alive()
            await asyncio.sleep(_LOG_POLL_SECONDS)
        raise BenchFailure(
            f"{self.name} did not log {event!r} within {timeout:g}s; last log lines:\n{self.tail()}"
        )

    async def stop(self) -> int:
        """SIGTERM (graceful drain), SIGKILL after ``STOP_TIMEOUT``; the exit code."""
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.popen.send_signal(signal.SIGTERM)
            try:
                await asyncio.to_thread(self.popen.wait, STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    self.popen.kill()
                await asyncio.to_thread(self.popen.wait)
        self.exit_code = self.popen.returncode
        return self.exit_code

    def log_summary(self) -> dict[str, Any]:
        """Warnings and errors in the whole log, counted by their ``event`` (or message)."""
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        levels: Counter[str] = Counter()
        complaints: Counter[str] = Counter()
        samples: dict[str, str] = {}
        unparsed = 0
        stopped: dict[str, Any] = {}
        for line in text.splitlines():
            entry = _json_line(line)
            if entry is None:
                unparsed += bool(line.strip())
                continue
            if entry.get("event") == "worker_stopped":  # a worker's own counts, at its stop
                stopped = {k: v for k, v in entry.items() if k.startswith("claims")}
            level = str(entry.get("level", "?"))
            levels[level] += 1
            if level in ("warning", "error", "critical"):
                key = f"{level}:{entry.get('event') or entry.get('msg')}"
                complaints[key] += 1
                samples.setdefault(key, str(entry.get("msg", ""))[:300])
        return {
            "lines": sum(levels.values()),
            "levels": dict(levels),
            "complaints": dict(complaints),
            "samples": samples,
            "non_json_lines": unparsed,
            "exit_code": self.exit_code,
            "stopped": stopped,
        }


def peak_rss_mib(pid: int) -> float | None:
    """The process's peak resident set (``VmHWM``), from ``/proc``; None once it is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    for line in status.splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return None


def _json_line(line: str) -> dict[str, Any] | None:
    if not line.startswith("{"):
        return None
    try:
        value = json.loads(line)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def summarise_profile(path: Path, lines: int = 35) -> Path:
    """Write the top of a cProfile dump, by own time and by cumulative time, as text."""
    out = path.with_suffix(".prof.txt")
    with out.open("w") as f:
        for order in ("tottime", "cumulative"):
            stats = pstats.Stats(str(path), stream=f)
            stats.strip_dirs().sort_stats(order).print_stats(lines)
    return out
