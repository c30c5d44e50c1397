"""Job ids nobody outside the installation can compute (issue 25, item 5), on SQLite and
PostgreSQL: keyed with the installation's secret (migration 0011), different for every
installation, kept across a rotation's window, overridden by ``JOBRELAY_ID_SECRET``, and at
no cost to the accept path.

The names added for this item are imported inside the tests, so that this file also runs
against the code before it (each test then fails on its assertion, not on an import).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import uuid
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import BaseModel
from sqlalchemy import event, func, select, text, update
from typer.testing import CliRunner

import jobrelay
from jobrelay.cli.main import app as cli_app
from jobrelay.domain.ids import canonical_json, job_id_for, request_hash
from jobrelay.errors import IdempotencyConflict
from jobrelay.runtime.wiring import Runtime, open_runtime
from jobrelay.settings import Settings
from jobrelay.storage.engine import create_engine, upgrade
from jobrelay.storage.store import NewJob, Store
from jobrelay.storage.tables import jobs, outbox
from tests.conftest import PG_ADMIN_URL, _admin_exec, _with_db
from tests.id_keys import id_secret

from .api_fixtures import Clock, api_client, bearer, build_runtime, make_token

pytestmark = pytest.mark.timeout(120)

BODY = {"accountId": "acme", "period": "2020-03"}
OTHER_BODY = {"accountId": "acme", "period": "2020-04"}
# The namespace that was in the source, and the formula the docs gave for it.
SOURCE_NAMESPACE = uuid.UUID("5b0d3c1e-9f6a-4c55-b7a2-6a1f0e1d2c3b")
OVERRIDE = "5e" * 32  # a JOBRELAY_ID_SECRET
REFRESH = 61.0  # seconds: past storage.installation.REFRESH_SECONDS (60)
CONFLICT = "urn:jobrelay:problem:idempotency-conflict"


def documented_id(material: dict[str, Any]) -> str:
    return str(uuid.uuid5(SOURCE_NAMESPACE, canonical_json(material)))


@pytest.fixture
async def rt(database_url: str, tmp_path: Path) -> AsyncIterator[Runtime]:
    runtime = build_runtime(database_url, tmp_path)
    yield runtime
    await runtime.engine.dispose()


@contextlib.asynccontextmanager
async def as_acme(rt: Runtime) -> AsyncIterator[tuple[httpx.AsyncClient, dict[str, str]]]:
    """An API client on ``rt`` and an account token's headers for acme."""
    async with api_client(rt) as client:
        yield client, bearer(await make_token(rt, "acme"))


def clock_of(rt: Runtime) -> Clock:
    assert isinstance(rt.clock, Clock)
    return rt.clock


async def job_id(
    client: httpx.AsyncClient,
    auth: dict[str, str],
    body: dict[str, str] = BODY,
    key: str | None = None,
) -> str:
    headers = {**auth, **({"Idempotency-Key": key} if key else {})}
    response = await client.post("/v1/exports", json=body, headers=headers)
    assert response.status_code == 202, response.text
    return str(response.json()["jobId"])


async def plain_and_keyed(client: httpx.AsyncClient, auth: dict[str, str]) -> tuple[str, str]:
    """The jobIds of ``BODY`` without a key and with the key ``k-1``."""
    return await job_id(client, auth), await job_id(client, auth, key="k-1")


def aware(value: datetime | str) -> datetime:
    """A time read back with raw SQL (SQLite gives naive UTC text)."""
    value = value if isinstance(value, datetime) else datetime.fromisoformat(value)
    return value if value.tzinfo else value.replace(tzinfo=UTC)


async def counts(rt: Runtime) -> tuple[int, int]:
    """Rows in ``jobs`` and in ``outbox``."""
    async with rt.engine.connect() as conn:
        found = await conn.scalar(select(func.count()).select_from(jobs))
        sent = await conn.scalar(select(func.count()).select_from(outbox))
    return int(found or 0), int(sent or 0)


def cli(database_url: str, *args: str, **env: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(
        cli_app, ["db", *args], env={"JOBRELAY_DATABASE_URL": database_url, **env}
    )
    return result.exit_code, result.stdout, result.stderr


async def rotate_elsewhere(rt: Runtime, database_url: str) -> None:
    """``jobrelay db rotate-id-secret`` as an operator runs it (another process), then time
    enough for ``rt``'s process to read the row again."""
    code, out, err = await asyncio.to_thread(cli, database_url, "rotate-id-secret")
    assert code == 0, out + err
    clock_of(rt).advance(REFRESH)


async def installation_row(database_url: str) -> Any:
    engine = create_engine(database_url)
    try:
        async with engine.connect() as conn:
            return (await conn.execute(text("SELECT * FROM installation"))).one()
    finally:
        await engine.dispose()


# --- keyed, per installation ----------------------------------------------------------------


@pytest.fixture(params=["sqlite", "postgres"])
def two_installations(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[list[str]]:
    """Two databases each migrated from nothing (not copies of one template, which would
    share its secret): two installations."""
    if request.param == "sqlite":
        urls = [f"sqlite:///{tmp_path}/{name}.db" for name in ("one", "two")]
        for url in urls:
            upgrade(url)
        yield urls
        return
    request.getfixturevalue("pg_template")  # PostgreSQL is there (else skipped)
    names = [f"jobrelay_ids_{uuid.uuid4().hex[:8]}" for _ in range(2)]
    try:
        for name in names:
            _admin_exec(f'CREATE DATABASE "{name}"')
            upgrade(_with_db(PG_ADMIN_URL, name))
        yield [_with_db(PG_ADMIN_URL, name) for name in names]
    finally:
        for name in names:
            _admin_exec(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


async def test_two_installations_give_the_same_request_different_ids_nobody_can_compute(
    two_installations: list[str], tmp_path: Path
) -> None:
    seen: list[tuple[str, str]] = []
    for n, url in enumerate(two_installations):
        runtime = build_runtime(url, tmp_path / str(n))
        try:
            async with as_acme(runtime) as (client, auth):
                seen.append(await plain_and_keyed(client, auth))
        finally:
            await runtime.engine.dispose()
    (plain_one, keyed_one), (plain_two, keyed_two) = seen
    assert plain_one != plain_two and keyed_one != keyed_two
    # The formula the docs gave, with the namespace in the source: a client cannot use it.
    for plain, keyed in seen:
        assert plain != documented_id({"account": "acme", "type": "report.export", "params": BODY})
        assert keyed != documented_id({"account": "acme", "idempotencyKey": "k-1"})
        assert uuid.UUID(plain).version == uuid.UUID(keyed).version == 8


async def test_the_id_is_the_installations_keyed_id_and_the_secret_is_stored_hex(
    rt: Runtime, database_url: str
) -> None:
    async with as_acme(rt) as (client, acme):
        plain, keyed = await plain_and_keyed(client, acme)
    row = await installation_row(database_url)
    secret = bytes.fromhex(row.id_secret)
    assert len(secret) == 32 and row.previous_id_secret is None  # the template had no jobs
    assert secret == await id_secret(rt.store)
    assert plain == job_id_for(secret, "acme", "report.export", BODY)
    assert keyed == job_id_for(secret, "acme", "report.export", BODY, "k-1")


# --- a rotation ---------------------------------------------------------------------------


async def test_a_retry_across_a_rotation_lands_on_its_job_until_the_window_ends(
    rt: Runtime, database_url: str
) -> None:
    async with as_acme(rt) as (client, acme):
        plain, keyed = await plain_and_keyed(client, acme)
        assert await counts(rt) == (2, 2)

        await rotate_elsewhere(rt, database_url)

        # Retries of requests accepted before: the same jobs, nothing written.
        assert await job_id(client, acme) == plain
        assert await job_id(client, acme, key="k-1") == keyed
        assert await counts(rt) == (2, 2)
        # A key accepted before and reused for another body: the same 422 as ever.
        reused = await client.post(
            "/v1/exports", json=OTHER_BODY, headers={**acme, "Idempotency-Key": "k-1"}
        )
        assert reused.status_code == 422 and reused.json()["type"] == CONFLICT, reused.text
        # A new request is keyed with the new secret.
        current = await id_secret(rt.store)
        fresh = await job_id(client, acme, OTHER_BODY)
        assert fresh == job_id_for(current, "acme", "report.export", OTHER_BODY)
        assert await counts(rt) == (3, 3)

        # Past previous_until only the current secret counts: the same request is a new job.
        from jobrelay.storage.tables import installation

        async with rt.engine.begin() as conn:
            past = rt.clock() - timedelta(seconds=1)
            await conn.execute(update(installation).values(previous_until=past))
        clock_of(rt).advance(REFRESH)
        again = await job_id(client, acme)
        assert again != plain
        assert again == job_id_for(current, "acme", "report.export", BODY)
        assert await counts(rt) == (4, 4)
        assert await job_id(client, acme) == again  # and from then on that one


class Touch(BaseModel):
    n: int


def touch_app(settings: Settings | None = None) -> tuple[jobrelay.App, Any]:
    """An application with one job type, as one process of it would define it."""
    lib = jobrelay.App(settings or Settings())

    @lib.job("ids.touch", params=Touch)
    async def touch(ctx: jobrelay.JobContext[Touch], params: Touch) -> None:
        return None

    return lib, touch


async def test_a_library_key_enqueued_before_a_rotation_is_the_same_job_after_it(
    rt: Runtime, database_url: str
) -> None:
    _, touch = touch_app()
    async with rt.engine.begin() as conn:
        first = await touch.enqueue(conn, Touch(n=1), key="img-1", account="acme")
    await rotate_elsewhere(rt, database_url)

    _, touch = touch_app()  # a process started after the rotation
    async with rt.engine.begin() as conn:
        assert await touch.enqueue(conn, Touch(n=1), key="img-1", account="acme") == first
    with pytest.raises(IdempotencyConflict):
        async with rt.engine.begin() as conn:
            await touch.enqueue(conn, Touch(n=2), key="img-1", account="acme")
    async with rt.engine.begin() as conn:
        other = await touch.enqueue(conn, Touch(n=3), key="img-3", account="acme")
    assert other != first
    assert await counts(rt) == (2, 2)


async def test_a_running_process_reads_a_rotated_secret_within_a_minute(
    rt: Runtime, database_url: str
) -> None:
    before = await rt.store.id_keys(rt.clock())
    code, out, err = await asyncio.to_thread(cli, database_url, "rotate-id-secret")
    assert code == 0, out + err
    # Within the minute the process keeps what it read.
    assert (await rt.store.id_keys(rt.clock())).current == before.current
    clock_of(rt).advance(REFRESH)
    after = await rt.store.id_keys(rt.clock())
    assert after.current != before.current and after.previous == before.current


def test_rotate_id_secret_exits_0_and_keeps_the_old_one_for_the_hours_given(
    database_url: str,
) -> None:
    old = asyncio.run(installation_row(database_url))
    started = datetime.now(UTC)
    code, out, err = cli(database_url, "rotate-id-secret", "--keep-previous", "2")
    assert code == 0, out + err
    assert len(out.strip().splitlines()) == 1 and "rotated" in out, out
    row = asyncio.run(installation_row(database_url))
    assert row.id_secret != old.id_secret and len(bytes.fromhex(row.id_secret)) == 32
    assert row.previous_id_secret == old.id_secret
    until = aware(row.previous_until)
    assert started + timedelta(hours=2) - timedelta(minutes=1) <= until
    assert until <= datetime.now(UTC) + timedelta(hours=2)
    assert row.rotated_by.startswith("cli:") and row.rotated_at is not None


def test_rotate_id_secret_refuses_with_jobrelay_id_secret_set(database_url: str) -> None:
    old = asyncio.run(installation_row(database_url))
    code, out, err = cli(database_url, "rotate-id-secret", JOBRELAY_ID_SECRET=OVERRIDE)
    assert code == 2, out + err
    assert len(err.strip().splitlines()) == 1 and "JOBRELAY_ID_SECRET" in err, err
    assert asyncio.run(installation_row(database_url)) == old  # nothing changed


# --- JOBRELAY_ID_SECRET ---------------------------------------------------------------------


async def test_jobrelay_id_secret_overrides_the_stored_secret(
    rt: Runtime, database_url: str, tmp_path: Path
) -> None:
    override = bytes.fromhex(OVERRIDE)
    stored = await id_secret(rt.store)
    settings = Settings(database_url=database_url, id_secret=OVERRIDE)
    async with open_runtime(settings, connect_transport=False) as wired:
        assert (await wired.store.id_keys(wired.clock())).current == override
    # The API with the variable set: ids under it, and the row is never read.
    store = Store(rt.engine, clock=rt.clock, id_secret=override)
    overridden = dataclasses.replace(rt, store=store)
    read: list[str] = []

    def record(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        read.append(statement)

    async with as_acme(overridden) as (client, auth):
        event.listen(rt.engine.sync_engine, "before_cursor_execute", record)
        try:
            plain = await job_id(client, auth)
        finally:
            event.remove(rt.engine.sync_engine, "before_cursor_execute", record)
    assert plain == job_id_for(override, "acme", "report.export", BODY)
    assert plain != job_id_for(stored, "acme", "report.export", BODY)
    assert not [s for s in read if "installation" in s]
    # The library too, from its app's settings.
    _, touch = touch_app(Settings(id_secret=OVERRIDE))
    async with rt.engine.begin() as conn:
        keyed = await touch.enqueue(conn, Touch(n=1), key="k", account="acme")
    from jobrelay.domain.ids import keyed_job_id

    assert keyed == keyed_job_id(override, "ids.touch", "acme", "k")


# --- the migration --------------------------------------------------------------------------


async def test_0011_on_a_database_with_jobs_keeps_the_legacy_ids_for_seven_days(
    database_url: str, tmp_path: Path
) -> None:
    from alembic import command

    from jobrelay.storage.engine import alembic_config

    await asyncio.to_thread(command.downgrade, alembic_config(database_url), "0010")
    # A job the code before 0011 accepted: its id is the UUIDv5 of the request.
    legacy = documented_id({"account": "acme", "type": "report.export", "params": BODY})
    engine = create_engine(database_url)
    try:
        params = dict(BODY)
        hashed = request_hash("acme", "report.export", params)
        job = NewJob(legacy, "report.export", "acme", params, hashed, 3)
        assert (await Store(engine).submit(job, datetime.now(UTC)))[1]
    finally:
        await engine.dispose()
    upgraded = datetime.now(UTC)
    await asyncio.to_thread(upgrade, database_url)

    row = await installation_row(database_url)
    assert row.previous_id_secret == "legacy-uuid5"
    until = aware(row.previous_until)
    assert upgraded + timedelta(days=7) <= until <= datetime.now(UTC) + timedelta(days=7)
    # A client retrying that request lands on its job.
    runtime = build_runtime(database_url, tmp_path, clock=Clock(datetime.now(UTC)))
    try:
        async with as_acme(runtime) as (client, auth):
            assert await job_id(client, auth) == legacy
            assert await counts(runtime) == (1, 1)
    finally:
        await runtime.engine.dispose()


# --- what the accept path costs -------------------------------------------------------------


async def test_the_accept_path_runs_the_statements_it_ran_before(rt: Runtime) -> None:
    """No previous secret: what ``POST /v1/exports`` ran before keyed ids (measured on the
    code before them). While a previous secret counts: one lookup more, and no more."""
    seen: list[str] = []
    recording = [False]

    def record(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if recording[0]:
            seen.append(" ".join(statement.split()))

    postgres = rt.store.engine.dialect.name == "postgresql"
    new = ["WITH nj_job AS"] if postgres else [
        "BEGIN IMMEDIATE", "INSERT INTO jobs", "INSERT INTO outbox", "INSERT INTO job_events",
    ]  # fmt: skip
    repeat = ["WITH nj_job AS"] if postgres else [
        "BEGIN IMMEDIATE", "INSERT INTO jobs", "SELECT jobs.request_hash",
    ]  # fmt: skip
    lookup = "SELECT jobs.request_hash"

    async def run(client: httpx.AsyncClient, auth: dict[str, str], **kw: Any) -> list[str]:
        seen.clear()
        await job_id(client, auth, **kw)
        return list(seen)

    def shape(statements: list[str], expected: list[str]) -> bool:
        return len(statements) == len(expected) and all(
            s.startswith(e) for s, e in zip(statements, expected, strict=True)
        )

    async with as_acme(rt) as (client, auth):
        await job_id(client, auth, {"accountId": "acme", "period": "2020-01"})  # warm
        event.listen(rt.engine.sync_engine, "before_cursor_execute", record)
        try:
            recording[0] = True
            for body, key in ((BODY, None), (BODY, "k-1")):
                assert shape(await run(client, auth, body=body, key=key), new), seen
                assert shape(await run(client, auth, body=body, key=key), repeat), seen
            # A rotation (its process keeps the new keys at once): a previous secret counts.
            recording[0] = False
            await rt.store.installation.rotate(rt.clock(), timedelta(hours=1), "test")
            recording[0] = True
            begin = [] if postgres else ["BEGIN IMMEDIATE"]
            with_lookup = [*begin, lookup, *new[len(begin) :]]
            assert shape(await run(client, auth, body=OTHER_BODY), with_lookup), seen
            assert shape(await run(client, auth), [*begin, lookup]), seen  # found there
        finally:
            event.remove(rt.engine.sync_engine, "before_cursor_execute", record)
