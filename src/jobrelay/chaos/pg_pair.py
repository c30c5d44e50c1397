"""A PostgreSQL primary and a streaming standby of jobrelay's own, to fail over for real.

Made from the installed server binaries (``initdb``, ``pg_basebackup -R``, ``pg_ctl``) in a
temporary directory, on free loopback ports, never the machine's PostgreSQL: ``failover``
stops the primary at once (``-m immediate``, as a crash or a lost host) and promotes the
standby; ``rejoin`` makes the old primary a standby of the new one (a fresh base backup), so
the next ``failover`` fails back. Synchronous by default (``synchronous_standby_names='*'``:
a commit returns once the standby has it), or asynchronous, to measure what the last commits
before a failover become. Stopped and removed on every exit path (``remove``, ``atexit``).

PostgreSQL refuses to run as root: as root the clusters belong to the ``postgres`` user
(``runuser``).
"""

from __future__ import annotations

import atexit
import contextlib
import glob
import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

_TIMEOUT = 60.0


class PairError(Exception):
    """The pair could not be made, started or failed over: not a verdict on jobrelay."""


def server_bin() -> Path | None:
    """The newest installed PostgreSQL's bin directory (Debian's layout), or None."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=_major)
    return Path(found[-1]).parent if found else None


def _major(path: str) -> float:
    try:
        return float(Path(path).parent.parent.name)
    except ValueError:
        return 0.0


def available() -> str | None:
    """None when a pair can be made here, else why not."""
    if server_bin() is None:
        return "no PostgreSQL server binaries (/usr/lib/postgresql/*/bin/initdb)"
    if os.geteuid() == 0 and shutil.which("runuser") is None:
        return "running as root and runuser is missing (initdb refuses root)"
    return None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Node:
    """One cluster of the pair: its data directory, port and log."""

    def __init__(self, root: Path, name: str) -> None:
        self.name = name
        self.data = root / name
        self.log = root / f"{name}.log"
        self.port = _free_port()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


class PostgresPair:
    """A primary and a standby; ``url`` names both (libpq's several hosts)."""

    def __init__(self, *, synchronous: bool = True) -> None:
        bin_dir = server_bin()
        if (reason := available()) or bin_dir is None:
            raise PairError(reason or "no PostgreSQL server binaries")
        self.bin = bin_dir
        self.synchronous = synchronous
        self.root = Path(tempfile.mkdtemp(prefix="jobrelay-pg-pair-"))
        self.root.chmod(0o755)
        if os.geteuid() == 0:
            subprocess.run(["chown", "postgres:postgres", str(self.root)], check=True)
        self._removed = False
        atexit.register(self.remove)
        self.primary = Node(self.root, "a")
        self.standby = Node(self.root, "b")
        self.nodes = (self.primary, self.standby)
        self._run(
            self._owner(
                "initdb", "-D", str(self.primary.data), "-U", "postgres", "--auth=trust",
                "--no-sync", "-E", "UTF8", "--locale=C.UTF-8",
            )
        )  # fmt: skip
        self._configure(self.primary)
        self._start(self.primary)
        self._follow(self.standby, self.primary)

    # --- what a test or the chaos run asks ---------------------------------------------------

    def url(self, database: str) -> str:
        """Both hosts, in a fixed order (the first primary first): a client that finds the
        first one read-only or gone goes on to the next."""
        hosts = ",".join(node.address for node in self.nodes)
        return f"postgresql://postgres@{hosts}/{database}?target_session_attrs=read-write"

    @property
    def server_url(self) -> str:
        """Both hosts without a database (``…/postgres`` is the admin database)."""
        return "postgresql://postgres@" + ",".join(node.address for node in self.nodes)

    def admin_url(self, node: Node | None = None) -> str:
        return f"postgresql://postgres@{(node or self.primary).address}/postgres"

    def failover(self) -> float:
        """Stop the primary at once and promote the standby; the seconds it took. The new
        primary waits for no standby until one follows it again (``rejoin``)."""
        started = time.monotonic()
        old, new = self.primary, self.standby
        self._pg_ctl(old, "stop", "-w", "-m", "immediate", "-t", "30")
        self._pg_ctl(new, "promote", "-w", "-t", "30")
        self._sql(new, "ALTER SYSTEM SET synchronous_standby_names = ''")
        self._sql(new, "SELECT pg_reload_conf()")
        self.primary, self.standby = new, old
        return time.monotonic() - started

    def rejoin(self) -> None:
        """The old primary, stopped, becomes a standby of the new one: a fresh base backup
        (its own last commits, if any were not replicated, are gone with its old data)."""
        shutil.rmtree(self.standby.data, ignore_errors=True)
        self._follow(self.standby, self.primary)

    def streaming(self) -> str | None:
        """The standby's replication state as the primary sees it (``streaming/sync``)."""
        out = self._sql(
            self.primary,
            "SELECT state || '/' || sync_state FROM pg_stat_replication LIMIT 1",
        )
        return out or None

    def remove(self) -> None:
        """Stop both and delete their directory; safe to call again (``atexit`` does)."""
        if self._removed:
            return
        self._removed = True
        for node in self.nodes:
            with contextlib.suppress(Exception):
                self._pg_ctl(node, "stop", "-w", "-m", "immediate", "-t", "30")
        shutil.rmtree(self.root, ignore_errors=True)
        with contextlib.suppress(Exception):
            atexit.unregister(self.remove)

    # --- internals ---------------------------------------------------------------------------

    def _configure(self, node: Node) -> None:
        names = "'*'" if self.synchronous else "''"
        settings = (
            f"listen_addresses = '127.0.0.1'\nport = {node.port}\n"
            f"unix_socket_directories = '{self.root}'\n"
            "wal_level = replica\nmax_wal_senders = 10\nhot_standby = on\n"
            f"synchronous_commit = on\nsynchronous_standby_names = {names}\n"
            "max_connections = 200\nwal_keep_size = '256MB'\n"
        )
        self._append(node.data / "postgresql.auto.conf", settings)

    def _follow(self, node: Node, primary: Node) -> None:
        """``node`` as a standby of ``primary``, started, and streaming (synchronous when the
        pair is): the next commit on ``primary`` is on ``node`` too."""
        self._run(
            self._owner(
                "pg_basebackup", "-h", "127.0.0.1", "-p", str(primary.port), "-U", "postgres",
                "-D", str(node.data), "-R", "--wal-method=stream", "--no-sync", "--checkpoint=fast",
            )
        )  # fmt: skip
        self._append(
            node.data / "postgresql.auto.conf",
            f"port = {node.port}\n"
            f"primary_conninfo = 'host=127.0.0.1 port={primary.port} user=postgres "
            f"application_name={node.name}'\n",
        )
        self._start(node)
        if self.synchronous:
            self._sql(primary, "ALTER SYSTEM SET synchronous_standby_names = '*'")
            self._sql(primary, "SELECT pg_reload_conf()")
        deadline = time.monotonic() + _TIMEOUT
        wanted = "streaming/sync" if self.synchronous else "streaming/async"
        while self.streaming() != wanted:
            if time.monotonic() > deadline:
                raise PairError(f"the standby is not {wanted}: {self.streaming()}")
            time.sleep(0.1)

    def _start(self, node: Node) -> None:
        self._pg_ctl(node, "start", "-w", "-t", str(int(_TIMEOUT)), "-l", str(node.log))

    def _pg_ctl(self, node: Node, *args: str) -> None:
        # setsid: the postmaster is a process group of its own, out of the caller's.
        self._run(["setsid", "-w", *self._owner("pg_ctl", "-D", str(node.data), *args)])

    def _sql(self, node: Node, sql: str) -> str:
        argv = self._owner(
            "psql", "-h", "127.0.0.1", "-p", str(node.port), "-U", "postgres", "-d", "postgres",
            "-Atqc", sql,
        )  # fmt: skip
        return self._run(argv).strip()

    def _append(self, path: Path, text: str) -> None:
        self._run([*self._as_owner(), "sh", "-c", f"cat >> '{path}'"], stdin=text)

    def _owner(self, tool: str, *args: str) -> list[str]:
        return [*self._as_owner(), str(self.bin / tool), *args]

    def _as_owner(self) -> list[str]:
        return ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []

    def _run(self, argv: list[str], stdin: str | None = None) -> str:
        done = subprocess.run(
            argv,
            input=stdin,
            capture_output=True,
            text=True,
            timeout=_TIMEOUT + 30,
            start_new_session=True,
            cwd=self.root,
        )
        if done.returncode != 0:
            detail = (done.stderr or done.stdout).strip()[-1500:]
            raise PairError(f"`{' '.join(argv[-6:])}` exited {done.returncode}: {detail}")
        return done.stdout


__all__ = ["PairError", "PostgresPair", "available"]
