"""Shared fixtures: real PostgreSQL and RabbitMQ, isolated per test.

PostgreSQL: one migrated template database per session, cloned per test
(``CREATE DATABASE … TEMPLATE``). RabbitMQ: a fresh vhost per test. SQLite: a migrated
file copied per test.

Least privilege: ``pg_app_url`` is the same cloned database reached as a role that is not a
superuser and owns nothing, holding only the grants of ``jobrelay db grant`` (given once, in
the template); ``amqp_app_url`` is a fresh vhost reached as a RabbitMQ user with no tags and
permissions on that vhost alone, for ``jobrelay.*`` names only. The PostgreSQL + RabbitMQ
pipeline tests run their processes through these two, as production should.

With ``JOBRELAY_REQUIRE_SERVICES=1`` (CI) an unreachable service fails the run; otherwise
tests that need it are skipped with the reason.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit, urlunsplit

import pytest

from jobrelay.storage.engine import upgrade

from .own_servers import OwnPostgres

if TYPE_CHECKING:
    from jobrelay.chaos.rabbit_cluster import Node, RabbitCluster

PG_ADMIN_URL = os.environ.get(
    "JOBRELAY_TEST_PG_ADMIN_URL", "postgresql://postgres@127.0.0.1:5432/postgres"
)
AMQP_BASE = os.environ.get("JOBRELAY_TEST_AMQP", "amqp://guest:guest@127.0.0.1:5672")
REQUIRE = os.environ.get("JOBRELAY_REQUIRE_SERVICES") == "1"
RUN_ID = uuid.uuid4().hex[:8]
APP_ROLE = f"jobrelay_app_{RUN_ID}"  # the least-privileged PostgreSQL role
AMQP_APP_USER = f"jobrelay-app-{RUN_ID}"  # the vhost-limited RabbitMQ user
AMQP_APP_PASSWORD = uuid.uuid4().hex
AMQP_APP_PERMISSION = r"^jobrelay(\..*)?$"  # configure, write and read: jobrelay's names only


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Order the run for ``pytest -n`` (``make test``: ``--dist loadscope
    --no-loadscope-reorder``).

    A module is one unit of work: its module-scoped servers (a RabbitMQ cluster or node of
    its own, a throwaway PostgreSQL, a browser, a served API) start once, on one worker.
    (``--dist loadgroup`` would balance finer, but xdist 3.8 marks its groups in a node id
    attribute that pytest 9 no longer reads.) Modules holding a test marked ``long`` go
    first, in the order of their longest tests, so the run does not end with one worker on
    the model-based test while the others are idle. An ordering only: every test runs.
    """
    first_long: dict[str, int] = {}
    for index, item in enumerate(items):
        if item.get_closest_marker("long") is not None:
            first_long.setdefault(item.nodeid.split("::")[0], index)
    items.sort(
        key=lambda item: (
            first_long.get(item.nodeid.split("::")[0], len(items)),
            item.get_closest_marker("long") is None,
        )
    )


def _unavailable(service: str, reason: str) -> None:
    message = f"{service} unavailable: {reason}"
    if REQUIRE:
        pytest.fail(message + " (JOBRELAY_REQUIRE_SERVICES=1)", pytrace=False)
    pytest.skip(message)


def _admin_exec(sql: str, admin_url: str = PG_ADMIN_URL) -> None:
    import asyncio

    import asyncpg

    async def run() -> None:
        conn = await asyncpg.connect(admin_url)
        try:
            await conn.execute(sql)
        finally:
            await conn.close()

    asyncio.run(run())


def _with_db(url: str, name: str) -> str:
    base, _, _ = url.rpartition("/")
    return f"{base}/{name}"


@pytest.fixture(scope="session")
def pg_template() -> Iterator[str]:
    name = f"jobrelay_tmpl_{RUN_ID}"
    try:
        _admin_exec(f'CREATE DATABASE "{name}"')
    except Exception as exc:  # unreachable, refused, auth
        _unavailable("PostgreSQL", f"{type(exc).__name__}: {exc}")
    try:
        _admin_exec(f'CREATE ROLE "{APP_ROLE}" LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE')
        _grant_app_role(_with_db(PG_ADMIN_URL, name))
        yield name
    finally:
        _admin_exec(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        _admin_exec(f'DROP ROLE IF EXISTS "{APP_ROLE}"')


def _grant_app_role(url: str, role: str = APP_ROLE) -> None:
    """What an operator does once, as the owner: ``jobrelay db upgrade`` (the schema and the
    export app's tables), then ``jobrelay db grant``."""
    import asyncio

    from jobrelay.processes.entry_points import grant_role, upgrade_database
    from jobrelay.settings import Settings

    settings = Settings(database_url=url)
    asyncio.run(upgrade_database(settings))
    asyncio.run(grant_role(settings, role))


@pytest.fixture
def pg_url(pg_template: str) -> Iterator[str]:
    name = f"jobrelay_t_{RUN_ID}_{uuid.uuid4().hex[:8]}"
    _admin_exec(f'CREATE DATABASE "{name}" TEMPLATE "{pg_template}"')
    try:
        yield _with_db(PG_ADMIN_URL, name)
    finally:
        _admin_exec(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def pg_app_url(pg_url: str) -> str:
    """``pg_url``'s database as the least-privileged role (DML grants only, owns nothing)."""
    parts = urlsplit(pg_url)
    return urlunsplit(parts._replace(netloc=f"{APP_ROLE}@{parts.hostname}:{parts.port}"))


@pytest.fixture(scope="session")
def sqlite_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("sqlite-template") / "template.db"
    upgrade(f"sqlite:///{path}")
    return path


@pytest.fixture
def sqlite_url(sqlite_template: Path, tmp_path: Path) -> str:
    path = tmp_path / "jobrelay.db"
    shutil.copy(sqlite_template, path)
    return f"sqlite:///{path}"


@pytest.fixture(params=["sqlite", "postgres"])
def database_url(request: pytest.FixtureRequest) -> str:
    """Runs the test once on SQLite and once on PostgreSQL."""
    fixture = "sqlite_url" if request.param == "sqlite" else "pg_url"
    return str(request.getfixturevalue(fixture))


def _rabbitmqctl(*args: str) -> None:
    subprocess.run(["rabbitmqctl", "-q", *args], check=True, capture_output=True, timeout=120)


def _erl_binaries(names: list[str]) -> str:
    return "[" + ", ".join(f'<<"{name}">>' for name in names) + "]"


class VhostPool:
    """Fresh vhosts for the tests, made and deleted in batches.

    Every ``rabbitmqctl`` call boots an Erlang VM: about 1 s on a quiet machine, 6-9 s on a
    loaded one, and a vhost per test took three calls (add, permissions, delete). Here one
    ``rabbitmqctl eval`` makes a batch (each vhost with its one user's permissions) and one
    deletes the used ones, so a test pays a fraction of a call. A vhost is handed out once;
    a used one is deleted with the next batch, and whatever is left when the session ends.
    """

    BATCH = 8

    def __init__(self, prefix: str, user: str, permission: str) -> None:
        self._prefix, self._user, self._permission = prefix, user, permission
        self._fresh: list[str] = []
        self._used: list[str] = []

    def take(self) -> str:
        if not self._fresh:
            self._delete_used()
            names = [f"{self._prefix}-{uuid.uuid4().hex[:8]}" for _ in range(self.BATCH)]
            escaped = self._permission.replace("\\", "\\\\")  # Erlang strings unescape
            perm = f'<<"{escaped}">>'
            _rabbitmqctl(
                "eval",
                '[begin ok = rabbit_vhost:add(V, <<"jobrelay-tests">>), '
                f'ok = rabbit_auth_backend_internal:set_permissions(<<"{self._user}">>, V, '
                f'{perm}, {perm}, {perm}, <<"jobrelay-tests">>) end '
                f"|| V <- {_erl_binaries(names)}], ok.",
            )
            self._fresh = names
        return self._fresh.pop()

    def give_back(self, vhost: str) -> None:
        self._used.append(vhost)
        if len(self._used) >= self.BATCH:
            self._delete_used()

    def close(self) -> None:
        self._used += self._fresh
        self._fresh = []
        self._delete_used()

    def _delete_used(self) -> None:
        if self._used:
            names, self._used = self._used, []
            _rabbitmqctl(
                "eval",
                f'[rabbit_vhost:delete(V, <<"jobrelay-tests">>) || V <- {_erl_binaries(names)}],'
                " ok.",
            )


@pytest.fixture(scope="session")
def rabbitmq_available() -> None:
    if shutil.which("rabbitmqctl") is None:
        _unavailable("RabbitMQ", "rabbitmqctl not on PATH")
    try:
        _rabbitmqctl("status")
    except (subprocess.SubprocessError, OSError) as exc:
        _unavailable("RabbitMQ", f"{type(exc).__name__}: {exc}")


@pytest.fixture(scope="session")
def _guest_vhosts(rabbitmq_available: None) -> Iterator[VhostPool]:
    pool = VhostPool(f"jobrelay-test-{RUN_ID}", "guest", ".*")
    try:
        yield pool
    finally:
        pool.close()


@pytest.fixture
def amqp_url(_guest_vhosts: VhostPool) -> Iterator[str]:
    """A fresh vhost per test, so no test ever sees another's queues."""
    vhost = _guest_vhosts.take()
    try:
        yield f"{AMQP_BASE}/{vhost}"
    finally:
        _guest_vhosts.give_back(vhost)


@pytest.fixture(scope="session")
def amqp_app_user(rabbitmq_available: None) -> Iterator[str]:
    _rabbitmqctl("add_user", AMQP_APP_USER, AMQP_APP_PASSWORD)
    try:
        yield AMQP_APP_USER
    finally:
        _rabbitmqctl("delete_user", AMQP_APP_USER)


@pytest.fixture(scope="session")
def _app_vhosts(amqp_app_user: str) -> Iterator[VhostPool]:
    pool = VhostPool(f"jobrelay-app-{RUN_ID}", amqp_app_user, AMQP_APP_PERMISSION)
    try:
        yield pool
    finally:
        pool.close()


@pytest.fixture
def amqp_app_url(amqp_app_user: str, _app_vhosts: VhostPool) -> Iterator[str]:
    """A fresh vhost that only the vhost-limited user may use, and only for jobrelay.*."""
    vhost = _app_vhosts.take()
    host = urlsplit(AMQP_BASE).netloc.rpartition("@")[2]
    try:
        yield f"amqp://{amqp_app_user}:{AMQP_APP_PASSWORD}@{host}/{vhost}"
    finally:
        _app_vhosts.give_back(vhost)


# --- servers a test owns (tests/own_servers.py): for the tests that stop or restart one ---


@dataclass(frozen=True)
class OwnDatabase:
    """A migrated database on a throwaway cluster, as the owner and as the app role."""

    server: OwnPostgres
    url: str
    app_url: str


@pytest.fixture(scope="module")
def own_postgres() -> Iterator[OwnPostgres]:
    """A throwaway PostgreSQL cluster for the module: the test may stop and restart it; the
    machine's server is never touched. Removed on every exit path (finalizer and atexit)."""
    from .own_servers import OwnPostgresError, available

    if reason := available():
        _unavailable("a throwaway PostgreSQL", reason)
    try:
        server = OwnPostgres()
    except OwnPostgresError as exc:
        _unavailable("a throwaway PostgreSQL", str(exc))
    try:
        server.start()
        yield server
    finally:
        server.remove()


@pytest.fixture
def own_pg(own_postgres: OwnPostgres) -> Iterator[OwnDatabase]:
    """A fresh database on ``own_postgres``, migrated, with the least-privileged role's grants
    (the same shape as ``pg_url`` / ``pg_app_url``)."""
    if own_postgres.postmaster_pid() is None:  # a test before stopped it and failed
        own_postgres.start()
    admin = own_postgres.admin_url
    name = f"jobrelay_own_{uuid.uuid4().hex[:8]}"
    role = f"jobrelay_app_{RUN_ID}"
    _admin_exec(f'CREATE DATABASE "{name}"', admin)
    _admin_exec(
        f'DO $$ BEGIN CREATE ROLE "{role}" LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE; '
        "EXCEPTION WHEN duplicate_object THEN NULL; END $$",
        admin,
    )
    url = _with_db(admin, name)
    _grant_app_role(url, role)
    parts = urlsplit(url)
    app_url = urlunsplit(parts._replace(netloc=f"{role}@{parts.hostname}:{parts.port}"))
    try:
        yield OwnDatabase(own_postgres, url, app_url)
    finally:
        if own_postgres.postmaster_pid() is not None:
            _admin_exec(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)', admin)


@pytest.fixture(scope="module")
def own_rabbitmq_cluster() -> Iterator[RabbitCluster]:
    """A RabbitMQ cluster of one node of the test's own, on free ports: the test may stop and
    start the node, or its application; the machine's broker is never touched."""
    from jobrelay.chaos.rabbit_cluster import ClusterError, RabbitCluster, available

    if reason := available():
        _unavailable("a RabbitMQ node of the tests' own", reason)
    cluster = RabbitCluster(1, base_port=0)
    try:
        cluster.start()
    except ClusterError as exc:
        _unavailable("a RabbitMQ node of the tests' own", str(exc))
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="module")
def own_rabbitmq(own_rabbitmq_cluster: RabbitCluster) -> Node:
    """``own_rabbitmq_cluster``'s node."""
    return own_rabbitmq_cluster.nodes[0]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    """Lone surrogates in a test's captured output, escaped before the report leaves the
    process. Tests feed jobs text with lone surrogates on purpose (the store must escape
    them), and the worker logs such a job's exception; pytest-xdist sends reports as UTF-8
    and a surrogate in one crashed the whole xdist worker (INTERNALERROR)."""
    outcome = yield
    report = outcome.get_result()
    report.sections = [
        (title, text.encode("utf-8", "backslashreplace").decode("utf-8"))
        for title, text in report.sections
    ]
