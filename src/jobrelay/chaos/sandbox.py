"""The soak's scratch space, and the commands that stop and start the real services.

Everything the soak creates (a database, a vhost, a bucket, a directory of process logs) is
named after one run id and removed at the end, unless the run failed: then it is kept so the
failure can be read, and the names are printed. Names are made of hex digits here, which is
why they can be spliced into ``CREATE DATABASE`` (a statement that takes no parameters).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import shlex
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

import asyncpg

if TYPE_CHECKING:
    from jobrelay.chaos.pg_pair import PostgresPair
    from jobrelay.chaos.rabbit_cluster import RabbitCluster


class ChaosSetupError(Exception):
    """The soak could not be set up or could not inject a fault: not a verdict on jobrelay."""


async def run_command(argv: list[str], *, timeout: float = 120.0, log: Path | None = None) -> str:
    """Run a one-shot command; its stdout, or ``ChaosSetupError`` saying what failed."""
    shown = shlex.join(argv)
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL
        )
    except OSError as exc:
        raise ChaosSetupError(f"`{shown}` could not start: {exc}") from None
    try:
        async with asyncio.timeout(timeout):
            out, err = await proc.communicate()
    except BaseException:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()
        raise
    stdout, stderr = out.decode(errors="replace"), err.decode(errors="replace")
    if log is not None:
        with log.open("a") as f:
            f.write(f"$ {shown}\n{stdout}{stderr}[exit {proc.returncode}]\n")
    if proc.returncode != 0:
        raise ChaosSetupError(f"`{shown}` exited {proc.returncode}: {stderr.strip()[-1500:]}")
    return stdout


def default_postgres_restart() -> list[str]:
    """Debian's cluster wrapper for the one cluster on this machine (as the machine starts it)."""
    versions = sorted(os.listdir("/etc/postgresql")) if os.path.isdir("/etc/postgresql") else []
    version = versions[-1] if versions else "15"
    return ["pg_ctlcluster", "--skip-systemctl-redirect", version, "main", "restart"]


@dataclass
class Services:
    """Where PostgreSQL and RabbitMQ are, and how to bounce them."""

    pg_server: str = "postgresql://postgres@127.0.0.1:5432"
    amqp_server: str = "amqp://guest:guest@127.0.0.1:5672"
    postgres_restart: list[str] = field(default_factory=default_postgres_restart)
    rabbitmq_down_seconds: float = 3.0
    # The node ``rabbitmqctl`` speaks to (``-n``) when the broker is not the machine's default
    # node: the tests' own node, so a soak in the tests restarts that one and no other.
    rabbitmq_node: str | None = None
    # The soak's own RabbitMQ cluster (``--cluster N``), instead of the machine's broker.
    cluster: RabbitCluster | None = None
    # The soak's own PostgreSQL primary and standby (``--failover``): a PostgreSQL fault is
    # then a failover (and the next one a failback), not a restart.
    pair: PostgresPair | None = None

    def pg_dsn(self, database: str) -> str:
        """``database`` on the PostgreSQL server(s), for asyncpg: with several hosts, only
        the one that takes writes (as the processes' URL gets by default)."""
        dsn = f"{self.pg_server}/{database}"
        return f"{dsn}?target_session_attrs=read-write" if "," in self.pg_server else dsn

    @property
    def amqp_servers(self) -> list[str]:
        if self.cluster is None:
            return [self.amqp_server]
        return [url.rstrip("/") for url in self.cluster.urls]

    async def rabbitmqctl(self, *args: str, log: Path | None = None) -> str:
        if self.cluster is None:
            node_option = ["-n", self.rabbitmq_node] if self.rabbitmq_node else []
            return await run_command(["rabbitmqctl", "-q", *node_option, *args], log=log)
        node = self.cluster.live_node().name
        return await run_command(["rabbitmqctl", "-q", "-n", node, *args], log=log)

    async def restart_rabbitmq(self, log: Path | None = None) -> None:
        """Stop the broker application, keep it down a moment, start it and wait until up."""
        await self.rabbitmqctl("stop_app", log=log)
        await asyncio.sleep(self.rabbitmq_down_seconds)  # the outage itself, not a wait
        await self.rabbitmqctl("start_app", log=log)
        await self.rabbitmqctl("await_startup", log=log)

    async def restart_postgres(self, log: Path | None = None) -> None:
        await run_command(self.postgres_restart, log=log)

    async def fail_over_postgres(self, database: str) -> str:
        """Stop the primary at once, promote the standby; then make the old primary a
        standby of the new one, so the next failover fails back. What happened, and how long
        until the first job succeeded on the new primary (the recovery)."""
        if self.pair is None:
            raise ChaosSetupError("a failover needs --failover (the soak's own pair)")
        pair = self.pair
        took = await asyncio.to_thread(pair.failover)
        promoted = asyncio.get_running_loop().time()
        admin = await asyncpg.connect(self.pg_dsn(database))
        try:
            since = await admin.fetchval("SELECT now()")
            recovery = None
            while recovery is None and asyncio.get_running_loop().time() - promoted < 120:
                found = await admin.fetchval(
                    "SELECT 1 FROM job_events WHERE kind = 'result_saved' AND at > $1 LIMIT 1",
                    since,
                )
                if found:
                    recovery = asyncio.get_running_loop().time() - promoted
                else:
                    await asyncio.sleep(0.05)  # polling the database for the first success
        finally:
            await admin.close()
        await asyncio.to_thread(pair.rejoin)
        first = "never" if recovery is None else f"{recovery:.2f}s"
        return (
            f"promoted {pair.primary.address} in {took:.2f}s; first job succeeded after"
            f" {first}; old primary now its standby"
        )


@dataclass
class Scratch:
    """A scratch database and vhosts on the given servers, created and dropped together.

    The soak and the pipeline benchmark (``bench/bench_env.py``) both stand on one.
    """

    services: Services
    database: str
    vhosts: tuple[str, ...]
    _db_created: bool = False
    created_vhosts: list[str] = field(default_factory=list)

    async def create(self) -> None:
        try:
            admin = await asyncpg.connect(self.services.pg_dsn("postgres"))
        except (OSError, asyncpg.PostgresError) as exc:
            raise ChaosSetupError(f"PostgreSQL at {self.services.pg_server}: {exc}") from None
        try:
            await admin.execute(f'CREATE DATABASE "{self.database}"')
            self._db_created = True
        except asyncpg.PostgresError as exc:
            raise ChaosSetupError(f"cannot create database {self.database}: {exc}") from None
        finally:
            await admin.close()
        user = urlsplit(self.services.amqp_server).username or "guest"
        for vhost in self.vhosts:
            await self.services.rabbitmqctl("add_vhost", vhost)
            self.created_vhosts.append(vhost)
            await self.services.rabbitmqctl("set_permissions", "-p", vhost, user, ".*", ".*", ".*")

    async def destroy(self) -> list[str]:
        """Drop what was created; the problems met on the way (not raised)."""
        problems: list[str] = []
        if self._db_created:
            try:
                admin = await asyncpg.connect(self.services.pg_dsn("postgres"))
                try:
                    await admin.execute(f'DROP DATABASE IF EXISTS "{self.database}" WITH (FORCE)')
                    self._db_created = False
                finally:
                    await admin.close()
            except (OSError, asyncpg.PostgresError) as exc:
                problems.append(f"database {self.database} not dropped: {exc}")
        for vhost in list(self.created_vhosts):
            try:
                await self.services.rabbitmqctl("delete_vhost", vhost)
                self.created_vhosts.remove(vhost)
            except ChaosSetupError as exc:
                problems.append(f"vhost {vhost} not deleted: {exc}")
        return problems


@dataclass
class Sandbox:
    services: Services
    root: Path
    run_id: str = field(default_factory=lambda: secrets.token_hex(4))

    def __post_init__(self) -> None:
        self.scratch = Scratch(self.services, self.database, (self.vhost,))

    @property
    def database(self) -> str:
        return f"jobrelay_chaos_{self.run_id}"

    @property
    def vhost(self) -> str:
        return f"jobrelay_chaos_{self.run_id}"

    @property
    def bucket(self) -> str:
        return f"jobrelay-chaos-{self.run_id}"

    @property
    def database_url(self) -> str:
        return f"{self.services.pg_server}/{self.database}"

    @property
    def broker_url(self) -> str:
        """The scratch vhost on the broker, or on every node of the soak's cluster."""
        return ",".join(f"{server}/{self.vhost}" for server in self.services.amqp_servers)

    @property
    def log_dir(self) -> Path:
        return self.root / "logs"

    async def create(self) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        await self.scratch.create()

    async def destroy(self) -> list[str]:
        return await self.scratch.destroy()

    async def queue_counts(self) -> dict[str, tuple[int, int]]:
        """Per queue: (deliverable, dead-lettering) messages, as the broker reports them.

        Deliverable is ready + unacknowledged: what a consumer can still get. Dead-lettering is
        the rest of a quorum queue's ``messages``: copies its at-least-once dead-letter worker
        holds until the target queue confirms them (``messages_dlx``).
        """
        out = await self.services.rabbitmqctl(
            "list_queues", "-p", self.vhost, "--no-table-headers",
            "name", "messages", "messages_ready", "messages_unacknowledged",
        )  # fmt: skip
        counts: dict[str, tuple[int, int]] = {}
        for line in out.splitlines():
            parts = line.split()
            if len(parts) == 4 and all(p.isdigit() for p in parts[1:]):
                total, ready, unacked = (int(p) for p in parts[1:])
                counts[parts[0]] = (ready + unacked, max(0, total - ready - unacked))
        return counts

    async def queue_depths(self) -> dict[str, int]:
        """Deliverable messages per queue (ready + unacknowledged)."""
        return {name: n for name, (n, _) in (await self.queue_counts()).items()}
