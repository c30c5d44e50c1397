"""Limits per key for operators (issue 36): the overview, overrides set and cleared (store,
``jobrelay limits`` and ``/v1/limits``), audited, taking effect at the relay's next admission
round; bad input is refused and writes nothing; ``job show`` says why a job is held.

On SQLite and PostgreSQL (``database_url``).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path

import httpx
import pytest
from sqlalchemy import func, select
from typer.testing import CliRunner

from jobrelay.admin.account_view import account_explain_document
from jobrelay.admin.explain import explain_document, next_step
from jobrelay.cli.main import app as cli_app
from jobrelay.domain.limits import LimitError, limit_id
from jobrelay.observe.metrics import Metrics
from jobrelay.runtime.wiring import Runtime
from jobrelay.storage.engine import create_engine
from jobrelay.storage.limit_overrides import (
    LimitEvent,
    clear_override,
    limit_history,
    limits_overview,
    set_override,
)
from jobrelay.storage.store import Store
from jobrelay.storage.tables import limit_events, limit_overrides
from tests.integration.api_fixtures import T0, api_client, bearer, build_runtime, make_token

from .test_limits import Clock, export, mail, submit

pytestmark = pytest.mark.timeout(90)
ACME = limit_id("lab.export", "acme")


@pytest.fixture
async def store(database_url: str) -> AsyncIterator[tuple[Store, Clock]]:
    engine = create_engine(database_url)
    clock = Clock()
    yield Store(engine, clock=clock), clock
    await engine.dispose()


async def written(s: Store) -> tuple[int, int]:
    """How many override rows and audit rows there are."""
    async with s.reading() as conn:
        rows = await conn.scalar(select(func.count()).select_from(limit_overrides))
        events = await conn.scalar(select(func.count()).select_from(limit_events))
    return int(rows or 0), int(events or 0)


async def test_an_override_raises_a_keys_limit_at_the_next_round_and_a_clear_restores_it(
    store: tuple[Store, Clock],
) -> None:
    """Old code: nothing wrote ``limit_overrides``; raising a limit took a deploy."""
    s, clock = store
    acme = [await submit(s, export, "acme", i) for i in range(6)]
    first = await s.admit_waiting(100)
    assert (first.admitted, first.throttled, first.waits) == (2, 4, (("lab.export", 0.0),) * 2)
    await set_override(s, ACME, max=4, actor="alice", reason="big customer", now=T0)
    clock.now = T0 + timedelta(seconds=30)
    second = await s.admit_waiting(100)  # 4 of 4 now
    assert (second.admitted, second.throttled) == (2, 0)
    assert second.waits == (("lab.export", 30.0),) * 2
    metrics = Metrics()
    metrics.admission(first.throttled, first.waits + second.waits)
    assert metrics.registry.get_sample_value("jobrelay_jobs_throttled_total") == 4
    count = "jobrelay_admission_wait_seconds_count"
    assert metrics.registry.get_sample_value(count, {"type": "lab.export"}) == 4
    [row] = [r for r in await limits_overview(s) if r.limit_id == ACME]
    assert (row.name, row.key, row.kind, row.running, row.waiting) == (
        "lab.export",
        "acme",
        "concurrency",
        4,
        2,
    )
    assert row.declared is not None and row.declared.max == 2
    assert row.current is not None and row.current.max == 4
    assert row.override is not None and row.override.changed_by == "alice"
    assert row.oldest_wait is not None
    # Cleared: the declared 2 holds again. One of the four ends: 3 slots, none admitted
    # (under the override's 4, one would be).
    removed = await clear_override(s, ACME, actor="bob", reason="done", now=T0)
    assert removed is not None and removed.max == 4
    assert await clear_override(s, ACME, actor="bob", reason="again", now=T0) is None
    claim = await s.claim_job(acme[0], "w1", clock.now, timedelta(seconds=30))
    assert claim is not None and (await s.complete(claim, None, {}, clock.now)).won
    assert (await s.admit_waiting(100)).admitted == 0
    history = await limit_history(s, ACME)
    assert [(e.kind, e.actor, e.reason) for e in history] == [
        ("cleared", "bob", "done"),
        ("set", "alice", "big customer"),
    ]
    assert history[1].detail == {
        "old": None,
        "new": {"max": 4, "perSecond": None, "burst": None},
    }
    assert history[0].detail == {"old": {"max": 4, "perSecond": None, "burst": None}}


async def test_a_whole_limits_rate_override_and_bad_values_write_nothing(
    store: tuple[Store, Clock],
) -> None:
    s, _ = store
    [await submit(s, mail, f"acct-{i}", i) for i in range(6)]
    for bad in ({"max": 0}, {}, {"max": 2, "per_second": 1.0}, {"max": 2, "burst": 3.0}):
        with pytest.raises(LimitError):
            await set_override(s, "smtp", actor="a", reason="r", now=T0, **bad)  # type: ignore[arg-type]
    assert await written(s) == (0, 0)
    await set_override(s, "smtp", per_second=5.0, burst=5.0, actor="a", reason="r", now=T0)
    assert (await s.admit_waiting(100)).admitted == 5
    [row] = await limits_overview(s)
    assert (row.limit_id, row.kind, row.running, row.waiting) == ("smtp", "rate", 5, 1)
    assert row.current is not None and (row.current.per_second, row.current.burst) == (5.0, 5.0)


async def test_job_show_says_a_held_job_waits_for_its_limit(store: tuple[Store, Clock]) -> None:
    s, clock = store
    acme = [await submit(s, export, "acme", i) for i in range(3)]
    await s.admit_waiting(100)
    job = await s.get_job(acme[2])
    assert job is not None and job.awaiting_admission
    line = next_step(job, clock.now + timedelta(minutes=2), None, await s.events(acme[2]))
    assert line.startswith("held: lab.export acme has 2 of 2 running (since 2 min ago)"), line
    assert "waiting for a worker" not in line and "is a relay running" not in line
    document = explain_document(job, await s.events(acme[2]), clock.now)
    assert document["limits"] == [{"id": ACME, "kind": "concurrency", "max": 2}]
    assert document["admittedAt"] is None and document["throttledAt"] == T0.isoformat()
    assert "limits" not in account_explain_document(job, [], clock.now)
    fresh = await submit(s, export, "acme", 9)
    job = await s.get_job(fresh)
    assert job is not None
    line = next_step(job, clock.now, None, await s.events(fresh))
    assert line.startswith("waiting for admission under its limits"), line


def test_limits_commands_set_list_clear_and_refuse_bad_input(
    database_url: str, tmp_path: Path
) -> None:
    env = {
        "JOBRELAY_DATABASE_URL": database_url,
        "JOBRELAY_RESULTS_URL": f"file://{tmp_path}/exports",
        "JOBRELAY_BROKER_URL": "local",
    }
    runner = CliRunner()

    def cli(*args: str) -> tuple[int, str, str]:
        result = runner.invoke(cli_app, ["limits", *args], env=env)
        return result.exit_code, result.stdout, result.stderr

    async def seed() -> list[str]:
        engine = create_engine(database_url)
        try:
            s = Store(engine)
            ids = [await submit(s, export, "acme", i) for i in range(3)]
            await s.admit_waiting(100)
            return ids
        finally:
            await engine.dispose()

    def history() -> list[LimitEvent]:
        async def go() -> list[LimitEvent]:
            engine = create_engine(database_url)
            try:
                return await limit_history(Store(engine), ACME)
            finally:
                await engine.dispose()

        return asyncio.run(go())

    held = asyncio.run(seed())[2]
    shown = runner.invoke(cli_app, ["job", "show", held], env=env)
    assert shown.exit_code == 0, shown.stdout
    assert "lab.export acme (concurrency 2)" in shown.stdout
    [next_line] = [x for x in shown.stdout.splitlines() if x.startswith("next: ")]
    assert next_line.startswith("next: held: lab.export acme has 2 of 2 running (since ")
    for args, message in [
        (("set", "lab.export", "--key", "acme", "--concurrency", "4"), "--reason is required"),
        (("set", "lab.export", "--concurrency", "4", "--reason", " "), "--reason is required"),
        (("set", "lab.export", "--reason", "x"), "exactly one of --concurrency and --rate"),
        (
            ("set", "lab.export", "--concurrency", "4", "--rate", "1/second", "--reason", "x"),
            "exactly one of --concurrency and --rate",
        ),
        (("set", "lab.export", "--rate", "fast", "--reason", "x"), "--rate: rate 'fast'"),
        (("set", "lab.export", "--concurrency", "0", "--reason", "x"), "--concurrency must"),
        (("set", "lab.export", "--concurrency", "2", "--burst", "3", "--reason", "x"), "--burst"),
        (("clear", "lab.export", "--key", "acme"), "--reason is required"),
    ]:
        code, _, err = cli(*args)
        assert code == 2 and err.startswith("jobrelay: error: ") and message in err, (args, err)
        assert len(err.strip().splitlines()) == 1
    assert history() == []

    code, out, _ = cli("list")
    assert code == 0, out
    [line] = [x for x in out.splitlines() if x.startswith("lab.export")]
    assert line.split()[:5] == ["lab.export", "acme", "concurrency", "2", "1"], line

    args = ("--key", "acme", "--concurrency", "4", "--reason", "sale", "--actor", "alice")
    code, out, err = cli("set", "lab.export", *args)
    assert code == 0 and "limit lab.export key acme: concurrency 4" in out, err
    code, out, _ = cli("list", "--json")
    [row] = json.loads(out)["limits"]
    assert (row["limit"], row["key"], row["running"], row["waiting"]) == (
        "lab.export",
        "acme",
        2,
        1,
    )
    assert row["declared"]["max"] == 2 and row["current"]["max"] == 4
    assert row["override"]["changedBy"] == "alice" and row["waitingSince"] is not None
    code, out, _ = cli("list")
    assert "4 (override; declared 2)" in out

    code, out, _ = cli("clear", "lab.export", "--key", "acme", "--reason", "over")
    assert code == 0 and "override cleared" in out
    code, _, err = cli("clear", "lab.export", "--key", "acme", "--reason", "again")
    assert code == 1 and "has no override" in err
    cleared, done = history()
    assert (done.kind, done.actor, done.reason) == ("set", "alice", "sale")
    assert cleared.kind == "cleared" and cleared.actor.startswith("cli:")


@pytest.fixture
async def runtime(database_url: str, tmp_path: Path) -> AsyncIterator[Runtime]:
    rt = build_runtime(database_url, tmp_path)
    yield rt
    await rt.engine.dispose()


@pytest.fixture
async def client(runtime: Runtime) -> AsyncIterator[httpx.AsyncClient]:
    async with api_client(runtime) as c:
        yield c


async def test_limits_over_http_set_list_clear_audited_and_bad_input_refused(
    client: httpx.AsyncClient, runtime: Runtime
) -> None:
    admin = bearer(await make_token(runtime, None, admin=True))
    s = runtime.store
    assert isinstance(s, Store)
    [await submit(s, export, "acme", i) for i in range(3)]
    await s.admit_waiting(100)

    for method, path, body, status in [
        ("PUT", "/v1/limits/lab.export", {"concurrency": 4}, 422),
        ("PUT", "/v1/limits/lab.export", {"concurrency": 4, "reason": " "}, 422),
        ("PUT", "/v1/limits/lab.export", {"reason": "x"}, 422),
        (
            "PUT",
            "/v1/limits/lab.export",
            {"concurrency": 4, "rate": "1/second", "reason": "x"},
            422,
        ),
        ("PUT", "/v1/limits/lab.export", {"rate": "fast", "reason": "x"}, 422),
        ("PUT", "/v1/limits/lab.export", {"concurrency": 0, "reason": "x"}, 422),
        ("PUT", "/v1/limits/lab.export", {"concurrency": 2**40, "reason": "x"}, 422),
        ("PUT", "/v1/limits/lab.export", {"concurrency": 2, "burst": 2, "reason": "x"}, 422),
        ("PUT", "/v1/limits/lab.export", {"key": "a\x1fb", "concurrency": 2, "reason": "x"}, 422),
        ("PUT", "/v1/limits/lab.export", {"concurrency": 2, "reason": "x", "other": 1}, 422),
        ("PUT", "/v1/limits/" + "x" * 65, {"concurrency": 2, "reason": "x"}, 422),
        ("PUT", "/v1/limits/a%1Fb", {"concurrency": 2, "reason": "x"}, 422),
        ("DELETE", "/v1/limits/lab.export?key=a%00b", {"reason": "x"}, 422),
        ("DELETE", "/v1/limits/lab.export?key=acme", {}, 422),
        ("DELETE", "/v1/limits/lab.export?key=acme", {"reason": "x"}, 404),
    ]:
        response = await client.request(method, path, json=body, headers=admin)
        assert response.status_code == status, (path, body, response.text)
        assert response.headers["content-type"] == "application/problem+json"
        if status == 422:
            assert response.json()["errors"], response.text
    assert await written(s) == (0, 0)

    body = {"key": "acme", "concurrency": 4, "reason": "sale"}
    put = await client.put("/v1/limits/lab.export", json=body, headers=admin)
    assert put.status_code == 200, put.text
    override = put.json()
    assert (override["limit"], override["key"], override["max"]) == ("lab.export", "acme", 4)
    assert override["changedBy"].startswith("token#") and override["reason"] == "sale"
    assert (await s.admit_waiting(100)).admitted == 1
    listed = await client.get("/v1/limits", headers=admin)
    assert listed.status_code == 200, listed.text
    [row] = listed.json()["limits"]
    assert (row["kind"], row["running"], row["waiting"], row["current"]["max"]) == (
        "concurrency",
        3,
        0,
        4,
    )
    rate = {"rate": "30/minute", "burst": 3, "reason": "smtp quota"}
    put = await client.put("/v1/limits/smtp", json=rate, headers=admin)
    assert put.status_code == 200 and put.json()["perSecond"] == 0.5
    gone = await client.request(
        "DELETE", "/v1/limits/lab.export", params={"key": "acme"}, json={"reason": "over"}
    )
    assert gone.status_code == 401
    gone = await client.request(
        "DELETE",
        "/v1/limits/lab.export",
        params={"key": "acme"},
        json={"reason": "over"},
        headers=admin,
    )
    assert gone.status_code == 200 and gone.json()["max"] == 4
    assert [(e.kind, e.reason) for e in await limit_history(s, ACME)] == [
        ("cleared", "over"),
        ("set", "sale"),
    ]
    acme = bearer(await make_token(runtime, "acme"))
    for method, path in [("GET", "/v1/limits"), ("PUT", "/v1/limits/smtp")]:
        response = await client.request(method, path, json=rate, headers=acme)
        assert response.status_code == 403
