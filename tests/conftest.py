"""Shared fixtures: real PostgreSQL and RabbitMQ, isolated per test.

PostgreSQL: one migrated template database per session, cloned per test
(``CREATE DATABASE … TEMPLATE``). RabbitMQ: a fresh vhost per test. SQLite: a migrated
file copied per test.

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

import pytest

from jobrelay.storage.engine import upgrade

PG_ADMIN_URL = os.environ.get(
    "JOBRELAY_TEST_PG_ADMIN_URL", "postgresql://postgres@127.0.0.1:5432/postgres"
)
AMQP_BASE = os.environ.get("JOBRELAY_TEST_AMQP", "amqp://guest:guest@127.0.0.1:5672")
REQUIRE = os.environ.get("JOBRELAY_REQUIRE_SERVICES") == "1"
RUN_ID = uuid.uuid4().hex[:8]


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
        upgrade(_with_db(PG_ADMIN_URL, name))
        yield name
    finally:
        _admin_exec(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def pg_url(pg_template: str) -> Iterator[str]:
    name = f"jobrelay_t_{RUN_ID}_{uuid.uuid4().hex[:8]}"
    _admin_exec(f'CREATE DATABASE "{name}" TEMPLATE "{pg_template}"')
    try:
        yield _with_db(PG_ADMIN_URL, name)
    finally:
        _admin_exec(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


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
