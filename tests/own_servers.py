"""Servers a test owns: a throwaway PostgreSQL cluster, so a test that stops or restarts
PostgreSQL never touches the machine's.

The machine's PostgreSQL and RabbitMQ are shared with whatever else runs there (other
projects, other test runs); a test that kills them breaks those. So a test that needs an
outage starts its own server from the installed binaries: ``initdb`` into a temporary
directory, trust authentication on loopback, a free port, its own socket directory. PostgreSQL
refuses to run as root, so as root the cluster belongs to the ``postgres`` user (``runuser``).

Stopped and removed on every exit path: the fixture's finalizer, ``atexit`` for a run that
ends abruptly, and the postmaster runs in its own process group, which ``stop`` kills if a
fast shutdown does not answer. The RabbitMQ equivalent is ``jobrelay.chaos.rabbit_cluster``
(one node is a cluster of one).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

# The server binaries and whether a cluster can be made here: as the failover pair finds them.
from jobrelay.chaos.pg_pair import available
from jobrelay.chaos.pg_pair import server_bin as postgres_bin

_START_TIMEOUT = 60.0


class OwnPostgresError(Exception):
    """The throwaway cluster could not be made or started: not a verdict on jobrelay."""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class OwnPostgres:
    """One PostgreSQL cluster in a temporary directory; ``start``, ``stop``, ``restart``."""

    def __init__(self) -> None:
        bin_dir = postgres_bin()
        if (reason := available()) or bin_dir is None:
            raise OwnPostgresError(reason or "no PostgreSQL server binaries")
        self.bin: Path = bin_dir
        self.root = Path(tempfile.mkdtemp(prefix="jobrelay-pg-"))
        self.root.chmod(0o755)
        self.data = self.root / "data"
        self.sockets = self.root / "sockets"
        self.log = self.root / "server.log"
        self.port = _free_port()
        self._removed = False
        self.sockets.mkdir()
        if os.geteuid() == 0:
            subprocess.run(["chown", "-R", "postgres:postgres", str(self.root)], check=True)
        atexit.register(self.remove)
        self._as_owner(
            "initdb", "-D", str(self.data), "-U", "postgres", "--auth=trust",
            "--no-sync", "-E", "UTF8", "--locale=C.UTF-8",
        )  # fmt: skip

    @property
    def server_url(self) -> str:
        """The server without a database (``…/postgres`` is the admin database)."""
        return f"postgresql://postgres@127.0.0.1:{self.port}"

    @property
    def admin_url(self) -> str:
        return f"{self.server_url}/postgres"

    def pg_ctl(self, *args: str) -> list[str]:
        """The ``pg_ctl`` command line for this cluster, as its owner, in a session of its own
        (the postmaster it starts is its own process group), logging to the server's log (so
        no pipe of the caller's stays open)."""
        return [
            "setsid", "-w", *self._owner_prefix(), str(self.bin / "pg_ctl"),
            "-D", str(self.data), *args,
        ]  # fmt: skip

    def restart_command(self) -> list[str]:
        """What the soak runs to restart this server (``--postgres-restart``)."""
        return self.pg_ctl("restart", "-w", "-m", "fast", "-l", str(self.log))

    def start(self) -> None:
        options = (
            f"-p {self.port} -k {self.sockets} -c listen_addresses=127.0.0.1 "
            "-c fsync=off -c synchronous_commit=off -c full_page_writes=off "
            "-c max_connections=200"
        )
        self._run(self.pg_ctl("start", "-w", "-t", str(int(_START_TIMEOUT)), "-l", str(self.log),
                              "-o", options))  # fmt: skip

    def stop(self, mode: str = "fast") -> None:
        """Stop the server; if it does not stop, kill its process group."""
        pid = self.postmaster_pid()
        if pid is None:
            return
        try:
            self._run(self.pg_ctl("stop", "-w", "-m", mode, "-t", "30"))
        except OwnPostgresError:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                group = os.getpgid(pid)
                if group == os.getpgrp():  # started from this run's own group: not the group
                    os.kill(pid, signal.SIGKILL)
                else:
                    os.killpg(group, signal.SIGKILL)
            self._wait_gone(pid)

    def restart(self) -> None:
        self.stop()
        self.start()

    def postmaster_pid(self) -> int | None:
        try:
            return int((self.data / "postmaster.pid").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    def remove(self) -> None:
        """Stop the server and delete its directory; safe to call again (atexit does)."""
        if self._removed:
            return
        self._removed = True
        with contextlib.suppress(Exception):
            self.stop("immediate")
        shutil.rmtree(self.root, ignore_errors=True)
        with contextlib.suppress(Exception):
            atexit.unregister(self.remove)

    # --- internals ------------------------------------------------------------------------

    def _owner_prefix(self) -> list[str]:
        return ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []

    def _as_owner(self, tool: str, *args: str) -> None:
        self._run([*self._owner_prefix(), str(self.bin / tool), *args])

    def _run(self, argv: list[str]) -> None:
        # Its own session: the postmaster it forks is in a process group of its own, which
        # ``stop`` can kill whole, and a Ctrl-C of the test run does not reach it first.
        done = subprocess.run(
            argv,
            capture_output=True,
            text=True,
            timeout=_START_TIMEOUT + 30,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            cwd=self.root,
        )
        if done.returncode != 0:
            detail = (done.stderr or done.stdout).strip()[-1500:]
            raise OwnPostgresError(f"`{' '.join(argv)}` exited {done.returncode}: {detail}")

    @staticmethod
    def _wait_gone(pid: int) -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.05)


class OwnAutoFailover:
    """A pg_auto_failover formation of the test's own (Debian's ``postgresql-N-auto-failover``):
    a monitor and two nodes on free loopback ports, in a temporary directory, driven by
    ``pg_autoctl`` as the cluster's owner. The monitor decides which node is primary;
    ``failover`` asks it to move the primary (``pg_autoctl perform failover``), as an
    operator or the monitor itself would after a node's loss. Removed on every exit path."""

    def __init__(self) -> None:
        bin_dir = postgres_bin()
        if (reason := available()) or bin_dir is None:
            raise OwnPostgresError(reason or "no PostgreSQL server binaries")
        if shutil.which("pg_autoctl") is None:
            raise OwnPostgresError(
                "pg_autoctl is missing (apt install postgresql-15-auto-failover)"
            )
        self.bin = bin_dir
        self.root = Path(tempfile.mkdtemp(prefix="jobrelay-paf-"))
        self.root.chmod(0o755)
        if os.geteuid() == 0:
            subprocess.run(["chown", "postgres:postgres", str(self.root)], check=True)
        self.ports = {name: _free_port() for name in ("monitor", "node1", "node2")}
        self._runs: list[subprocess.Popen[bytes]] = []
        self._logs: list[Any] = []
        self._removed = False
        atexit.register(self.remove)

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{self.ports[n]}" for n in ("node1", "node2"))
        return f"postgresql://postgres@{hosts}/jobrelay?target_session_attrs=read-write"

    def start(self) -> None:
        monitor = f"postgres://autoctl_node@127.0.0.1:{self.ports['monitor']}/pg_auto_failover"
        self._autoctl(
            "create", "monitor", "--pgdata", self._data("monitor"),
            "--pgport", str(self.ports["monitor"]), "--auth", "trust", "--no-ssl",
            "--hostname", "127.0.0.1",
        )  # fmt: skip
        self._run("monitor")
        for node in ("node1", "node2"):
            self._autoctl(
                "create", "postgres", "--pgdata", self._data(node),
                "--pgport", str(self.ports[node]), "--auth", "trust", "--no-ssl",
                "--hostname", "127.0.0.1", "--dbname", "jobrelay", "--monitor", monitor,
                "--name", node,
            )  # fmt: skip
            self._run(node)
            # Alone, the first node is "single"; it is "primary" once the second follows it.
            self._wait_for(node, {"single", "primary"} if node == "node1" else {"secondary"})
        self._wait_for("node1", {"primary"})

    def failover(self) -> float:
        """Move the primary to the other node; the seconds ``pg_autoctl`` took.

        The monitor's ``perform_failover`` can lose a deadlock to a keeper's report, which
        updates the same node row (seen in CI: "deadlock detected ... while updating tuple
        in relation node", exit 6). PostgreSQL rolled that call back whole, so it is asked
        again, as an operator would, at most twice more; any other failure is raised."""
        started = time.monotonic()
        for tries_left in (2, 1, 0):
            try:
                self._autoctl("perform", "failover", "--pgdata", self._data("monitor"), timeout=180)
                break
            except OwnPostgresError as exc:
                if tries_left == 0 or "deadlock detected" not in str(exc):
                    raise
        return time.monotonic() - started

    def remove(self) -> None:
        if self._removed:
            return
        self._removed = True
        for name in ("node2", "node1", "monitor"):
            with contextlib.suppress(Exception):
                self._autoctl("stop", "--pgdata", self._data(name), "--immediate", timeout=30)
        for run in self._runs:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(run.pid, signal.SIGKILL)
            with contextlib.suppress(Exception):
                run.wait(10)
        for log in self._logs:
            log.close()
        shutil.rmtree(self.root, ignore_errors=True)
        with contextlib.suppress(Exception):
            atexit.unregister(self.remove)

    def _data(self, name: str) -> str:
        return str(self.root / name)

    def _env(self) -> dict[str, str]:
        return {**os.environ, "PATH": f"{self.bin}:{os.environ.get('PATH', '')}"}

    def _owner(self) -> list[str]:
        return ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []

    def _autoctl(self, *args: str, timeout: float = _START_TIMEOUT + 30) -> str:
        argv = [*self._owner(), "env", f"PATH={self._env()['PATH']}", "pg_autoctl", *args]
        done = subprocess.run(
            argv, capture_output=True, text=True, timeout=timeout, cwd=self.root,
            stdin=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
        if done.returncode != 0:
            detail = (done.stderr or done.stdout).strip()[-1500:]
            raise OwnPostgresError(
                f"`pg_autoctl {' '.join(args[:2])}` exited {done.returncode}: {detail}"
            )
        return done.stdout

    def _run(self, name: str) -> None:
        log = (self.root / f"{name}.log").open("ab")
        self._logs.append(log)
        argv = [*self._owner(), "env", f"PATH={self._env()['PATH']}", "pg_autoctl", "run",
                "--pgdata", self._data(name)]  # fmt: skip
        self._runs.append(
            subprocess.Popen(argv, stdout=log, stderr=log, cwd=self.root, start_new_session=True)
        )

    def _wait_for(self, node: str, states: set[str]) -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            shown = self._autoctl("show", "state", "--pgdata", self._data("monitor"), "--json")
            with contextlib.suppress(ValueError):
                for row in json.loads(shown):
                    if row.get("nodename") == node and row.get("current_group_state") in states:
                        return
            time.sleep(0.5)
        raise OwnPostgresError(f"pg_auto_failover: {node} never became {' or '.join(states)}")
