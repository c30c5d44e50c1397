"""Running least-privileged: ``jobrelay db grant ROLE`` and a vhost-limited RabbitMQ user.

The owner migrates (``db upgrade``) and grants; the runtime role then owns nothing, is not a
superuser, may read and write jobrelay's and the app's rows, and may not change the schema.
The pipeline works through both restricted identities, and the RabbitMQ user can reach its
own vhost's ``jobrelay.*`` names and nothing else.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import aio_pika
import asyncpg
import pytest
from aiormq.exceptions import ChannelAccessRefused
from sqlalchemy import text

from jobrelay.domain.states import JobState
from jobrelay.errors import TransportError
from jobrelay.storage.engine import create_engine
from jobrelay.storage.vacuum import may_vacuum
from jobrelay.transport.rabbit_nodes import connect_first
from tests.acceptance.procs import clean_env, run_cli
from tests.conftest import APP_ROLE, PG_ADMIN_URL, _admin_exec, _with_db

from .pipeline import pipeline, settings_for

pytestmark = pytest.mark.timeout(120)


def as_role(url: str, role: str) -> str:
    parts = urlsplit(url)
    return urlunsplit(parts._replace(netloc=f"{role}@{parts.hostname}:{parts.port}"))


@pytest.fixture
def fresh_db(pg_template: str) -> Iterator[tuple[str, str]]:
    """An empty database (no schema yet) and a new role with no grants in it."""
    name = f"jobrelay_lp_{uuid.uuid4().hex[:8]}"
    role = f"jobrelay_lp_{uuid.uuid4().hex[:8]}"
    _admin_exec(f'CREATE DATABASE "{name}"')
    _admin_exec(f'CREATE ROLE "{role}" LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE')
    try:
        yield _with_db(PG_ADMIN_URL, name), role
    finally:
        _admin_exec(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        _admin_exec(f'DROP ROLE IF EXISTS "{role}"')


async def refused(url: str, sql: str) -> str:
    conn = await asyncpg.connect(url.replace("postgresql+asyncpg", "postgresql"))
    try:
        await conn.execute(sql)
    except asyncpg.exceptions.InsufficientPrivilegeError as exc:
        return str(exc)
    finally:
        await conn.close()
    raise AssertionError(f"{sql!r} was allowed")


async def test_db_grant_gives_dml_and_nothing_else(fresh_db: tuple[str, str]) -> None:
    owner_url, role = fresh_db
    env = clean_env(JOBRELAY_DATABASE_URL=owner_url)
    before = run_cli("db", "grant", role, env=env)
    assert before.returncode == 2, before.stderr
    assert before.stderr.strip().endswith("missing: run `jobrelay db upgrade` first")
    assert run_cli("db", "upgrade", env=env).returncode == 0
    granted = run_cli("db", "grant", role, env=env)
    assert granted.returncode == 0, granted.stderr
    assert granted.stdout.startswith("granted SELECT, INSERT, UPDATE, DELETE on ")
    assert "ledger_entries" in granted.stdout  # the app's own table too

    role_url = as_role(owner_url, role)
    conn = await asyncpg.connect(role_url)
    try:
        assert (
            await conn.fetchval("SELECT rolsuper FROM pg_roles WHERE rolname = $1", role) is False
        )
        owned = await conn.fetchval(
            "SELECT count(*) FROM pg_class c JOIN pg_roles r ON r.oid = c.relowner"
            " WHERE r.rolname = $1",
            role,
        )
        assert owned == 0
        await conn.execute("SELECT count(*) FROM jobs")
        await conn.execute("DELETE FROM outbox WHERE false")
        await conn.execute("SELECT version_num FROM alembic_version")
    finally:
        await conn.close()
    assert "permission denied" in await refused(role_url, "CREATE TABLE x (id int)")
    assert "must be owner" in await refused(role_url, "DROP TABLE jobs")
    assert "must be owner" in await refused(role_url, "ALTER TABLE jobs ADD COLUMN y int")
    assert "permission denied" in await refused(
        role_url, "UPDATE alembic_version SET version_num = 'x'"
    )
    owner_engine, role_engine = create_engine(owner_url), create_engine(role_url)
    try:
        assert await may_vacuum(owner_engine) and not await may_vacuum(role_engine)
    finally:
        await owner_engine.dispose()
        await role_engine.dispose()


@pytest.mark.long
def test_db_grant_refuses_a_missing_role_and_sqlite_in_one_line(
    fresh_db: tuple[str, str], tmp_path: Path
) -> None:
    owner_url, _ = fresh_db
    env = clean_env(JOBRELAY_DATABASE_URL=owner_url)
    assert run_cli("db", "upgrade", env=env).returncode == 0
    for role, expected in [
        ("nobody_here", "jobrelay: error: ROLE: no PostgreSQL role 'nobody_here'"),
        ("bad;role", "jobrelay: error: ROLE: not a role name: 'bad;role'"),
    ]:
        result = run_cli("db", "grant", role, env=env)
        assert result.returncode == 2 and result.stderr.startswith(expected), result.stderr
        assert len(result.stderr.strip().splitlines()) == 1
    sqlite = clean_env(JOBRELAY_DATABASE_URL=f"sqlite:///{tmp_path}/jr.db")
    assert run_cli("db", "upgrade", env=sqlite).returncode == 0
    result = run_cli("db", "grant", "app", env=sqlite)
    assert result.returncode == 2
    assert "db grant is for PostgreSQL" in result.stderr and "Traceback" not in result.stderr


async def test_the_pipeline_runs_as_the_restricted_role_and_user(
    pg_app_url: str, amqp_app_url: str, tmp_path: Path
) -> None:
    settings = settings_for(pg_app_url, amqp_app_url, tmp_path / "exports")
    async with pipeline(settings) as p:
        async with p.rt.engine.connect() as conn:
            user = (await conn.execute(text("SELECT current_user"))).scalar_one()
        assert user == APP_ROLE
        assert not await may_vacuum(p.rt.engine)  # so self-vacuum is skipped, with a warning
        job_id = await p.submit()
        p.start_relay()
        await p.start_worker()
        job = await p.wait_for(job_id, lambda j: j.state is JobState.SUCCEEDED)
        assert job.result_key is not None


async def test_the_rabbitmq_user_reaches_only_its_vhost_and_jobrelay_names(
    amqp_app_url: str,
) -> None:
    parts = urlsplit(amqp_app_url)
    other_vhost = urlunsplit(parts._replace(path="/"))
    with pytest.raises(TransportError, match="refused the vhost") as refused_vhost:
        await connect_first([other_vhost])
    assert "may not use it" in str(refused_vhost.value)
    connection = await aio_pika.connect(amqp_app_url, timeout=10)
    try:
        channel = await connection.channel()
        await channel.declare_queue("jobrelay.allowed-by-the-pattern", durable=True)
        with pytest.raises(ChannelAccessRefused):
            await channel.declare_queue("someone-elses-queue", durable=True)
    finally:
        await connection.close()
