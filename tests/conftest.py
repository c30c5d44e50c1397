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
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import pytest

from jobrelay.storage.engine import upgrade

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


def _unavailable(service: str, reason: str) -> None:
    message = f"{service} unavailable: {reason}"
    if REQUIRE:
        pytest.fail(message + " (JOBRELAY_REQUIRE_SERVICES=1)", pytrace=False)
    pytest.skip(message)


def _admin_exec(sql: str) -> None:
    import asyncio

    import asyncpg

    async def run() -> None:
        conn = await asyncpg.connect(PG_ADMIN_URL)
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


def _grant_app_role(url: str) -> None:
    """What an operator does once, as the owner: ``jobrelay db upgrade`` (the schema and the
    export app's tables), then ``jobrelay db grant``."""
    import asyncio

    from jobrelay.roles.processes import grant_role, upgrade_database
    from jobrelay.settings import Settings

    settings = Settings(database_url=url)
    asyncio.run(upgrade_database(settings))
    asyncio.run(grant_role(settings, APP_ROLE))


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
    subprocess.run(["rabbitmqctl", "-q", *args], check=True, capture_output=True, timeout=60)


@pytest.fixture(scope="session")
def rabbitmq_available() -> None:
    if shutil.which("rabbitmqctl") is None:
        _unavailable("RabbitMQ", "rabbitmqctl not on PATH")
    try:
        _rabbitmqctl("status")
    except (subprocess.SubprocessError, OSError) as exc:
        _unavailable("RabbitMQ", f"{type(exc).__name__}: {exc}")


@pytest.fixture
def amqp_url(rabbitmq_available: None) -> Iterator[str]:
    """A fresh vhost per test, so no test ever sees another's queues."""
    vhost = f"jobrelay-test-{RUN_ID}-{uuid.uuid4().hex[:8]}"
    _rabbitmqctl("add_vhost", vhost)
    _rabbitmqctl("set_permissions", "-p", vhost, "guest", ".*", ".*", ".*")
    try:
        yield f"{AMQP_BASE}/{vhost}"
    finally:
        _rabbitmqctl("delete_vhost", vhost)


@pytest.fixture(scope="session")
def amqp_app_user(rabbitmq_available: None) -> Iterator[str]:
    _rabbitmqctl("add_user", AMQP_APP_USER, AMQP_APP_PASSWORD)
    try:
        yield AMQP_APP_USER
    finally:
        _rabbitmqctl("delete_user", AMQP_APP_USER)


@pytest.fixture
def amqp_app_url(amqp_app_user: str) -> Iterator[str]:
    """A fresh vhost that only the vhost-limited user may use, and only for jobrelay.*."""
    vhost = f"jobrelay-app-{RUN_ID}-{uuid.uuid4().hex[:8]}"
    _rabbitmqctl("add_vhost", vhost)
    permission = AMQP_APP_PERMISSION
    _rabbitmqctl("set_permissions", "-p", vhost, amqp_app_user, permission, permission, permission)
    host = urlsplit(AMQP_BASE).netloc.rpartition("@")[2]
    try:
        yield f"amqp://{amqp_app_user}:{AMQP_APP_PASSWORD}@{host}/{vhost}"
    finally:
        _rabbitmqctl("delete_vhost", vhost)
