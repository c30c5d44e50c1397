"""A throwaway RabbitMQ cluster of N nodes on loopback, for the soak, the tests and the bench.

It follows the recipe verified on these machines (../shared/BROKER-FACTS.md): each node has
its own node name, AMQP port, distribution port, data and log directories and plugins file,
in directories owned by the ``rabbitmq`` user (the Debian wrapper drops to that user and
shares its Erlang cookie with ``rabbitmqctl``). Nodes 2..N join node 1. Each node also runs
the management plugin on its own port: the leader and members of a quorum queue are read
from its HTTP API, as ``jobrelay broker declare`` reads them.

Node names carry a random tag, so a cluster left behind by a killed run never collides with
the next one; ``stop()`` stops every node it started and removes its directories, and is
idempotent, so every exit path (a context manager, ``finally``, ``atexit``) can call it.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import random
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any
from urllib.parse import quote

import httpx

_START_TIMEOUT = 90.0  # a node boots in about 5 s here; a loaded machine may take far longer
_CTL_TIMEOUT = 120.0


# How long a quorum queue's at-least-once dead-letter worker waits for the target queue's
# confirm before it sends again (RabbitMQ's default: 180 s). A retry tier's expired message
# that was on its way to the work queue when that queue's leader stopped waits this long;
# see docs/how-to/scale-out.md.
DLX_CONFIRM_TIMEOUT_MS = 5000


class ClusterError(Exception):
    """The cluster could not be started or changed: not a verdict on jobrelay."""


@dataclass(frozen=True)
class Node:
    index: int  # 1-based
    name: str  # e.g. jr3f2a1@localhost
    port: int
    dist_port: int
    management_port: int
    home: Path

    @property
    def url(self) -> str:
        return f"amqp://guest:guest@127.0.0.1:{self.port}/"

    @property
    def management_url(self) -> str:
        return f"http://guest:guest@127.0.0.1:{self.management_port}"


def _free_base(count: int) -> int:
    """A base port whose AMQP, management (+10000) and distribution (+20000) ports are free."""
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(5700, 9000)
        ports = [base + i + offset for i in range(count) for offset in (0, 10000, 20000)]
        if all(_port_free(port) for port in ports):
            return base
    raise ClusterError("no free ports for a cluster")


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def available() -> str | None:
    """None when a cluster can be started here, else why not (for a clear skip or failure)."""
    if shutil.which("rabbitmq-server") is None or shutil.which("rabbitmqctl") is None:
        return "rabbitmq-server / rabbitmqctl are not installed"
    if os.geteuid() != 0:
        return "starting RabbitMQ nodes needs root (the server drops to the rabbitmq user)"
    return None


class RabbitCluster:
    def __init__(
        self,
        nodes: int = 3,
        *,
        base_port: int = 5681,
        workdir: Path | None = None,
        logs_to: Path | None = None,
    ) -> None:
        """``base_port`` 0 picks free ports. ``workdir`` must be reachable by the ``rabbitmq``
        user (not under a 0700 directory); by default a fresh one in the system's temp
        directory. ``logs_to`` receives a copy of each node's log when the cluster stops."""
        if nodes < 1:
            raise ValueError("a cluster needs at least one node")
        self._tag = secrets.token_hex(3)
        self._workdir = workdir
        self._owned_workdir = workdir is None
        self._base = Path(workdir) if workdir else None
        self._count = nodes
        self._base_port = base_port
        self._logs_to = logs_to
        self._nodes: list[Node] = []
        self._started: set[int] = set()

    # --- lifecycle ------------------------------------------------------------------------

    def start(self) -> None:
        """Start every node, join them to node 1 and wait until each one is running."""
        if reason := available():
            raise ClusterError(reason)
        if self._base is None:
            self._base = Path(tempfile.mkdtemp(prefix="jobrelay-rmq-"))
        self._base.mkdir(parents=True, exist_ok=True)
        self._base.chmod(0o755)
        atexit.register(self.stop)
        if self._base_port == 0:
            self._base_port = _free_base(self._count)
        self._nodes = [self._layout(i) for i in range(1, self._count + 1)]
        try:
            for node in self._nodes:
                self._spawn(node)
            for node in self._nodes:
                self._await(node)
            for node in self._nodes[1:]:
                self._ctl(node, "stop_app")
                self._ctl(node, "join_cluster", self._nodes[0].name)
                self._ctl(node, "start_app")
            running = self.running_nodes()
            if len(running) != self._count:
                raise ClusterError(f"only {running} of {self._count} nodes joined the cluster")
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """Stop every node this cluster started and remove its files; safe to call again."""
        for node in self._nodes:
            if node.index in self._started:
                self._halt(node)
        self._started.clear()
        if self._logs_to is not None:
            for node in self._nodes:
                with contextlib.suppress(OSError):
                    shutil.copytree(
                        node.home / "log", self._logs_to / node.name, dirs_exist_ok=True
                    )
        for node in self._nodes:
            shutil.rmtree(node.home / "mnesia", ignore_errors=True)
        if self._base is not None and self._owned_workdir:
            shutil.rmtree(self._base, ignore_errors=True)
            self._base = None
        with contextlib.suppress(Exception):
            atexit.unregister(self.stop)

    def __enter__(self) -> RabbitCluster:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # --- what callers use -----------------------------------------------------------------

    @property
    def nodes(self) -> list[Node]:
        return list(self._nodes)

    @property
    def urls(self) -> list[str]:
        return [node.url for node in self._nodes]

    def broker_url(self) -> str:
        """The comma-separated ``JOBRELAY_BROKER_URL`` naming every node."""
        return ",".join(self.urls)

    def management_urls(self) -> list[str]:
        return [node.management_url for node in self._nodes]

    def is_up(self, index: int) -> bool:
        return index in self._started

    def stop_node(self, index: int) -> None:
        """Stop one node (its process exits; it stays a cluster member and can come back)."""
        node = self._node(index)
        self._halt(node)
        self._started.discard(index)

    def start_node(self, index: int) -> None:
        """Start a stopped node again; it rejoins the cluster it belonged to."""
        node = self._node(index)
        if index in self._started:
            return
        self._spawn(node)
        self._await(node)

    def running_nodes(self) -> list[str]:
        """The cluster's running nodes, as a live node sees them."""
        for node in self._nodes:
            if node.index not in self._started:
                continue
            with contextlib.suppress(httpx.HTTPError, ValueError):
                answer = self._api(node, "/api/nodes")
                return sorted(n["name"] for n in answer if n.get("running"))
        return []

    def leader_of(self, queue: str, vhost: str = "/") -> int:
        """The index of the node leading a quorum queue (from a live node's management API)."""
        path = f"/api/queues/{quote(vhost, safe='')}/{quote(queue, safe='')}"
        last: Exception | None = None
        for node in self._nodes:
            if node.index not in self._started:
                continue
            try:
                leader = self._api(node, path).get("leader")
            except (httpx.HTTPError, ValueError) as exc:
                last = exc
                continue
            for candidate in self._nodes:
                if candidate.name == leader:
                    return candidate.index
        raise ClusterError(f"no live node knows the leader of {queue!r}: {last}")

    def live_node(self) -> Node:
        """A node this cluster has running (for ``rabbitmqctl -n``)."""
        return self._live()

    def add_vhost(self, vhost: str) -> None:
        node = self._live()
        self._ctl(node, "add_vhost", vhost)
        self._ctl(node, "set_permissions", "-p", vhost, "guest", ".*", ".*", ".*")

    # --- internals ------------------------------------------------------------------------

    def _layout(self, index: int) -> Node:
        assert self._base is not None
        port = self._base_port + index - 1
        home = self._base / f"node{index}"
        node = Node(
            index=index,
            name=f"jr{self._tag}n{index}@localhost",
            port=port,
            dist_port=port + 20000,
            management_port=port + 10000,
            home=home,
        )
        for sub in ("mnesia", "log"):
            (home / sub).mkdir(parents=True, exist_ok=True)
        (home / "enabled_plugins").write_text("[rabbitmq_management].\n")
        setting = f"{{dead_letter_worker_publisher_confirm_timeout, {DLX_CONFIRM_TIMEOUT_MS}}}"
        (home / "advanced.config").write_text(f"[{{rabbit, [{setting}]}}].\n")
        (home / "rabbitmq.conf").write_text(
            f"listeners.tcp.default = 127.0.0.1:{node.port}\n"
            f"management.tcp.ip = 127.0.0.1\n"
            f"management.tcp.port = {node.management_port}\n"
        )
        subprocess.run(["chown", "-R", "rabbitmq:rabbitmq", str(home)], check=True)
        return node

    def _env(self, node: Node) -> dict[str, str]:
        return {
            **os.environ,
            "RABBITMQ_NODENAME": node.name,
            "RABBITMQ_NODE_PORT": str(node.port),
            "RABBITMQ_DIST_PORT": str(node.dist_port),
            "RABBITMQ_MNESIA_BASE": str(node.home / "mnesia"),
            "RABBITMQ_LOG_BASE": str(node.home / "log"),
            "RABBITMQ_ENABLED_PLUGINS_FILE": str(node.home / "enabled_plugins"),
            "RABBITMQ_CONFIG_FILE": str(node.home / "rabbitmq.conf"),
            "RABBITMQ_ADVANCED_CONFIG_FILE": str(node.home / "advanced.config"),
            "RABBITMQ_PID_FILE": str(node.home / "pid"),
        }

    def _spawn(self, node: Node) -> None:
        self._run(["rabbitmq-server", "-detached"], env=self._env(node), timeout=30)
        self._started.add(node.index)

    def _halt(self, node: Node) -> None:
        try:
            self._ctl(node, "stop", timeout=60)
        except ClusterError:
            pid_file = node.home / "pid"
            with contextlib.suppress(OSError, ValueError):
                os.kill(int(pid_file.read_text().strip()), signal.SIGKILL)

    def _await(self, node: Node) -> None:
        """Wait until the node has booted; ``await_startup`` fails at once until the node has
        registered with epmd, so it is retried until the deadline."""
        deadline = time.monotonic() + _START_TIMEOUT
        while True:
            try:
                self._ctl(node, "await_startup", "--timeout", "30", timeout=35)
                return
            except ClusterError:
                if time.monotonic() > deadline:
                    log = node.home / "log" / f"{node.name}.log"
                    raise ClusterError(f"node {node.name} did not start; see {log}") from None
                time.sleep(0.5)

    def _ctl(self, node: Node, *args: str, timeout: float = _CTL_TIMEOUT) -> str:
        return self._run(["rabbitmqctl", "-q", "-n", node.name, *args], timeout=timeout)

    def _run(self, argv: list[str], *, env: dict[str, str] | None = None, timeout: float) -> str:
        try:
            done = subprocess.run(
                argv,
                env=env,
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                timeout=timeout,
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise ClusterError(f"`{' '.join(argv)}` failed: {exc}") from None
        if done.returncode != 0:
            detail = (done.stderr or done.stdout).strip()[-800:]
            raise ClusterError(f"`{' '.join(argv)}` exited {done.returncode}: {detail}")
        return done.stdout

    def _api(self, node: Node, path: str) -> Any:
        """The JSON a node's management API answers (raises on an error status)."""
        url = f"http://127.0.0.1:{node.management_port}{path}"
        answer = httpx.get(url, auth=("guest", "guest"), timeout=5.0)
        answer.raise_for_status()
        return answer.json()

    def _live(self) -> Node:
        for node in self._nodes:
            if node.index in self._started:
                return node
        raise ClusterError("no node of the cluster is running")

    def _node(self, index: int) -> Node:
        if not 1 <= index <= len(self._nodes):
            raise ValueError(f"no node {index} in a cluster of {len(self._nodes)}")
        return self._nodes[index - 1]

    def wait_running(self, count: int, timeout: float = 60.0) -> None:
        """Poll until ``count`` nodes report running (after a restart)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if len(self.running_nodes()) >= count:
                return
            time.sleep(0.5)
        raise ClusterError(f"fewer than {count} nodes running after {timeout:g}s")
