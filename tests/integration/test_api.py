"""The HTTP contract (ARCHITECTURE.md "External contract"), on SQLite and PostgreSQL.

Requests go through the real ASGI app, a real Store and real result files; what the API
claims is checked against the database through the Store, not against the API itself.
"""

from __future__ import annotations

import contextlib
import logging
import uuid
from collections.abc import AsyncIterator, Callable
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, NoReturn

import httpx
import pytest
from fastapi import FastAPI

from jobrelay.api import create_app
from jobrelay.api.deps import get_runtime
from jobrelay.domain.disclosure import FAILED
from jobrelay.domain.states import JobState
from jobrelay.errors import TransportError
from jobrelay.observe.faults import Faults
from jobrelay.runtime.wiring import Runtime
from jobrelay.settings import Settings
from tests.id_keys import request_id
from tests.integration.api_fixtures import (
    LEASE,
    MAX_ATTEMPTS,
    T0,
    Clock,
    ProbeTransport,
    bearer,
    build_runtime,
    finish_job,
    make_token,
    settings_for,
)

BODY = {"accountId": "acme", "period": "2020-05"}
PROBLEM = "application/problem+json"
JOB_FIELDS = {
    "jobId", "type", "accountId", "params", "state", "published", "attempt", "maxAttempts",
    "resultKey", "result", "lastError", "nextAttemptAt", "runAt", "progress", "waitingFor",
    "createdAt",
    "updatedAt",
}  # fmt: skip


@pytest.fixture
async def runtime(database_url: str, tmp_path: Path) -> AsyncIterator[Runtime]:
    rt = build_runtime(database_url, tmp_path)
    yield rt
    await rt.engine.dispose()


def client_for(app: FastAPI) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://api.test")


@pytest.fixture
async def client(runtime: Runtime) -> AsyncIterator[httpx.AsyncClient]:
    async with client_for(create_app(runtime.settings, runtime=runtime)) as c:
        yield c


@pytest.fixture
async def acme(runtime: Runtime) -> dict[str, str]:
    return bearer(await make_token(runtime, "acme"))


@pytest.fixture
async def other(runtime: Runtime) -> dict[str, str]:
    return bearer(await make_token(runtime, "other"))


async def accept(client: httpx.AsyncClient, auth: dict[str, str], **headers: str) -> str:
    response = await client.post("/v1/exports", json=BODY, headers={**auth, **headers})
    assert response.status_code == 202, response.text
    return str(response.json()["jobId"])


def assert_problem(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == PROBLEM
    body: dict[str, Any] = response.json()
    assert body["status"] == status
    assert {"type", "title", "status"} <= set(body)
    return body


async def assert_no_jobs(runtime: Runtime) -> None:
    assert await runtime.store.list_jobs() == []
    assert await runtime.store.outbox_backlog() == 0


# --- accept -------------------------------------------------------------------------------


async def test_accept_is_202_and_a_repeat_returns_the_same_job(
    client: httpx.AsyncClient, runtime: Runtime, acme: dict[str, str]
) -> None:
    first = await client.post("/v1/exports", json=BODY, headers=acme)
    again = await client.post("/v1/exports", json=BODY, headers=acme)

    assert first.status_code == again.status_code == 202
    job_id = first.json()["jobId"]
    assert (
        first.json()
        == again.json()
        == {
            "accepted": True,
            "jobId": job_id,
            "statusUrl": f"/v1/jobs/{job_id}",
        }
    )
    assert first.headers["location"] == f"/v1/jobs/{job_id}"
    jobs = await runtime.store.list_jobs()
    assert [j.id for j in jobs] == [job_id]
    job = jobs[0]
    assert (job.type, job.account_id, job.params) == ("report.export", "acme", BODY)
    assert (job.state, job.max_attempts, job.idempotency_key) == (
        JobState.QUEUED,
        MAX_ATTEMPTS,
        None,
    )
    assert await runtime.store.outbox_backlog() == 1
    assert [e.kind for e in await runtime.store.events(job_id)] == ["accepted"]


async def test_idempotency_key_keys_the_job_and_rejects_another_body(
    client: httpx.AsyncClient, runtime: Runtime, acme: dict[str, str]
) -> None:
    plain = await accept(client, acme)
    keyed = await accept(client, acme, **{"Idempotency-Key": "order-42"})
    assert keyed == await request_id(runtime.store, "acme", BODY, "order-42") != plain
    assert await accept(client, acme, **{"Idempotency-Key": "order-42"}) == keyed

    reused = await client.post(
        "/v1/exports",
        json={"accountId": "acme", "period": "2020-06"},
        headers={**acme, "Idempotency-Key": "order-42"},
    )

    body = assert_problem(reused, 422)
    assert body["errors"][0]["field"] == "Idempotency-Key"
    assert len(await runtime.store.list_jobs()) == 2
    assert await runtime.store.outbox_backlog() == 2
    assert [e.kind for e in await runtime.store.events(keyed)] == ["accepted"]


@pytest.mark.parametrize("key", [b"", b"has space", b"x" * 256, "caf\u00e9".encode()])
async def test_malformed_idempotency_key_is_422(
    client: httpx.AsyncClient, runtime: Runtime, acme: dict[str, str], key: bytes
) -> None:
    response = await client.post(
        "/v1/exports",
        json=BODY,
        headers=[*((k.encode(), v.encode()) for k, v in acme.items()), (b"Idempotency-Key", key)],
    )
    body = assert_problem(response, 422)
    assert [e["field"] for e in body["errors"]] == ["Idempotency-Key"]
    await assert_no_jobs(runtime)


@pytest.mark.parametrize(
    ("content", "field"),
    [
        (b'{"accountId": "acme"}', "period"),
        (b'{"accountId": "acme", "period": "2020-05", "format": "xlsx"}', "format"),
        (b'{"account_id": "acme", "period": "2020-05"}', "account_id"),
        (b'{"accountId": "acme", "period": "2020-13"}', "period"),
        (b'{"accountId": "acme", "period": "2020-00"}', "period"),
        (b'{"accountId": "acme", "period": "1899-12"}', "period"),
        (b'{"accountId": "acme", "period": "3000-01"}', "period"),
        (b'{"accountId": "acme", "period": "2020-5"}', "period"),
        (b'{"accountId": "Acme", "period": "2020-05"}', "accountId"),
        (b'{"accountId": "-acme", "period": "2020-05"}', "accountId"),
        (b'{"accountId": "' + b"a" * 65 + b'", "period": "2020-05"}', "accountId"),
        (b'{"accountId": 42, "period": "2020-05"}', "accountId"),
        (b"accountId=acme&period=2020-05", "body"),
        (b"", "body"),
        (b'["acme", "2020-05"]', "body"),
    ],
)
async def test_invalid_body_is_422_and_creates_nothing(
    client: httpx.AsyncClient, runtime: Runtime, acme: dict[str, str], content: bytes, field: str
) -> None:
    response = await client.post(
        "/v1/exports", content=content, headers={**acme, "Content-Type": "application/json"}
    )
    body = assert_problem(response, 422)
    assert field in [e["field"] for e in body["errors"]]
    assert all(set(e) == {"field", "message"} for e in body["errors"])
    await assert_no_jobs(runtime)


async def test_oversized_body_is_413(
    client: httpx.AsyncClient, runtime: Runtime, acme: dict[str, str]
) -> None:
    padded = {**BODY, "pad": "x" * 20_000}
    assert_problem(await client.post("/v1/exports", json=padded, headers=acme), 413)
    await assert_no_jobs(runtime)


@pytest.mark.parametrize(
    "headers",
    [{}, {"Authorization": "Bearer jr_not-a-real-token"}, {"Authorization": "Basic YTpi"}],
)
async def test_without_a_valid_token_is_401_even_with_a_bad_body(
    client: httpx.AsyncClient, runtime: Runtime, headers: dict[str, str]
) -> None:
    for content in (b'{"accountId": "acme", "period": "2020-05"}', b"not json"):
        response = await client.post("/v1/exports", content=content, headers=headers)
        assert_problem(response, 401)
        assert response.headers["www-authenticate"].startswith("Bearer")
    missing = await client.get(f"/v1/jobs/{uuid.uuid4()}", headers=headers)
    assert_problem(missing, 401)
    await assert_no_jobs(runtime)


async def test_token_of_another_account_is_403_and_creates_nothing(
    client: httpx.AsyncClient, runtime: Runtime, other: dict[str, str]
) -> None:
    assert_problem(await client.post("/v1/exports", json=BODY, headers=other), 403)
    await assert_no_jobs(runtime)


async def test_admin_token_acts_for_any_account(
    client: httpx.AsyncClient, runtime: Runtime
) -> None:
    admin = bearer(await make_token(runtime, None, admin=True))
    job_id = await accept(client, admin)
    assert (await client.get(f"/v1/jobs/{job_id}", headers=admin)).json()["accountId"] == "acme"
    assert (await client.get(f"/v1/jobs/{job_id}/events", headers=admin)).status_code == 200


async def test_valid_traceparent_reaches_the_outbox_and_an_invalid_one_is_dropped(
    client: httpx.AsyncClient, runtime: Runtime, acme: dict[str, str]
) -> None:
    good = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    await accept(client, acme, traceparent=good)
    await accept(client, acme, **{"traceparent": "00-zz-bad", "Idempotency-Key": "k2"})

    await runtime.store.admit_waiting(10)  # the relay admits before it claims
    rows = await runtime.store.claim_outbox("relay-test", 10, LEASE)

    assert [r.headers for r in rows] == [{"traceparent": good}, {}]


async def test_fault_after_commit_loses_nothing_and_the_retry_gets_the_same_job(
    database_url: str, tmp_path: Path
) -> None:
    class Crash(Exception):
        pass

    def crash(point: str) -> NoReturn:
        raise Crash(point)

    rt = build_runtime(database_url, tmp_path, faults=Faults("api.before_response:crash:1", crash))
    try:
        acme = bearer(await make_token(rt, "acme"))
        async with client_for(create_app(rt.settings, runtime=rt)) as client:
            crashed = await client.post("/v1/exports", json=BODY, headers=acme)
            assert_problem(crashed, 500)
            [job] = await rt.store.list_jobs()  # committed before the fault point
            assert await accept(client, acme) == job.id
        assert await rt.store.outbox_backlog() == 1
    finally:
        await rt.engine.dispose()


# --- read ---------------------------------------------------------------------------------


async def test_job_has_exactly_the_contract_fields(
    client: httpx.AsyncClient, runtime: Runtime, acme: dict[str, str]
) -> None:
    job_id = await accept(client, acme)

    response = await client.get(f"/v1/jobs/{job_id}", headers=acme)

    assert response.status_code == 200
    assert response.headers["content-type"] == "application/json"
    body = response.json()
    assert set(body) == JOB_FIELDS
    assert {k: v for k, v in body.items() if k not in ("createdAt", "updatedAt")} == {
        "jobId": job_id,
        "type": "report.export",
        "accountId": "acme",
        "params": BODY,
        "state": "queued",
        "published": False,
        "attempt": 0,
        "maxAttempts": MAX_ATTEMPTS,
        "resultKey": None,
        "result": None,
        "lastError": None,
        "nextAttemptAt": None,
        "runAt": None,
        "progress": None,
        "waitingFor": None,
    }
    for name in ("createdAt", "updatedAt"):
        assert body[name].endswith(("Z", "+00:00"))
        assert datetime.fromisoformat(body[name]) == T0


async def test_job_shows_publication_progress_and_retry(
    client: httpx.AsyncClient, runtime: Runtime, acme: dict[str, str]
) -> None:
    job_id = await accept(client, acme)
    store = runtime.store
    await store.admit_waiting(10)  # the relay admits before it claims
    await store.mark_published("r", await store.claim_outbox("r", 10, LEASE))
    claim = await store.claim_job(job_id, "w", T0, LEASE)
    assert claim is not None
    assert await store.report_progress(claim, 5, 10, T0)

    running = (await client.get(f"/v1/jobs/{job_id}", headers=acme)).json()
    assert (running["state"], running["published"], running["attempt"]) == ("running", True, 1)
    assert running["progress"] == {"done": 5, "total": 10}

    assert (await store.schedule_retry(claim, "report.export", "ledger timeout", 5, T0)).won
    waiting = (await client.get(f"/v1/jobs/{job_id}", headers=acme)).json()
    # The raw error is the operators': an account reads the public fallback (no public error
    # was given to this retry).
    assert (waiting["state"], waiting["lastError"]) == ("retry_wait", FAILED)
    assert datetime.fromisoformat(waiting["nextAttemptAt"]) == T0 + timedelta(seconds=5)
    # The retry message is not yet published: the fact is visible, not folded into the state.
    assert waiting["published"] is False


async def test_events_are_listed_in_order(
    client: httpx.AsyncClient, runtime: Runtime, acme: dict[str, str]
) -> None:
    clock = runtime.clock
    assert isinstance(clock, Clock)
    job_id = await accept(client, acme)
    store = runtime.store
    clock.advance(1)  # the relay takes the row a second later: that is the publish's time
    await store.admit_waiting(10)  # the relay admits before it claims
    await store.mark_published("r", await store.claim_outbox("r", 10, LEASE))
    clock.advance(1)
    await finish_job(runtime, job_id, b"a,b\n")

    response = await client.get(f"/v1/jobs/{job_id}/events", headers=acme)

    assert response.status_code == 200
    events = response.json()["events"]
    assert [e["kind"] for e in events] == ["accepted", "published", "claimed", "result_saved"]
    assert all(set(e) == {"at", "kind", "detail"} for e in events)
    times = [datetime.fromisoformat(e["at"]) for e in events]
    assert times == sorted(times) and times[0] == T0 and times[-1] == T0 + timedelta(seconds=2)
    assert events[3]["detail"]["resultKey"] == f"exports/acme/{job_id}.csv"


async def test_result_is_409_until_succeeded_then_the_csv(
    client: httpx.AsyncClient, runtime: Runtime, acme: dict[str, str]
) -> None:
    job_id = await accept(client, acme)

    early = assert_problem(await client.get(f"/v1/jobs/{job_id}/result", headers=acme), 409)
    assert "queued" in early["detail"] and early["state"] == "queued"

    csv = b"entry_id,amount\n1,10.00\n2,-3.50\n" * 5000  # several read chunks
    await finish_job(runtime, job_id, csv)
    response = await client.get(f"/v1/jobs/{job_id}/result", headers=acme)

    assert response.status_code == 200
    assert response.content == csv
    assert response.headers["content-type"] == "text/csv; charset=utf-8"
    assert response.headers["content-disposition"] == (
        'attachment; filename="export-acme-2020-05.csv"'
    )


async def test_result_file_missing_for_a_succeeded_job_is_410(
    client: httpx.AsyncClient, runtime: Runtime, acme: dict[str, str], tmp_path: Path
) -> None:
    job_id = await accept(client, acme)
    key = await finish_job(runtime, job_id, b"a\n")
    (tmp_path / "exports" / key).unlink()

    gone = assert_problem(await client.get(f"/v1/jobs/{job_id}/result", headers=acme), 410)
    assert job_id not in gone["detail"] and "jobId" in gone["detail"]


async def test_another_accounts_job_is_indistinguishable_from_a_missing_one(
    client: httpx.AsyncClient, runtime: Runtime, acme: dict[str, str], other: dict[str, str]
) -> None:
    job_id = await accept(client, acme)
    await finish_job(runtime, job_id, b"a\n")
    missing = str(uuid.uuid4())

    for suffix in ("", "/events", "/result"):
        hidden = await client.get(f"/v1/jobs/{job_id}{suffix}", headers=other)
        absent = await client.get(f"/v1/jobs/{missing}{suffix}", headers=other)
        body = assert_problem(hidden, 404)
        assert body.pop("instance") == f"/v1/jobs/{job_id}{suffix}"
        expected = assert_problem(absent, 404)
        expected.pop("instance")
        assert body == expected
        assert hidden.headers == absent.headers


NOT_CANONICAL: dict[str, Callable[[str], str]] = {
    "words": lambda _: "not-a-uuid",
    "number": lambda _: "12345",
    "braces": lambda job_id: "{" + job_id + "}",
    "bare-hex": lambda job_id: job_id.replace("-", ""),
    "urn": lambda job_id: f"urn:uuid:{job_id}",
}


@pytest.mark.parametrize("spelling", list(NOT_CANONICAL))
async def test_job_id_that_is_not_a_uuid_is_404_like_a_missing_job(
    client: httpx.AsyncClient, acme: dict[str, str], spelling: str
) -> None:
    job_id = await accept(client, acme)
    path = NOT_CANONICAL[spelling](job_id)
    missing = assert_problem(await client.get(f"/v1/jobs/{uuid.uuid4()}", headers=acme), 404)

    for suffix in ("", "/events", "/result"):
        body = assert_problem(await client.get(f"/v1/jobs/{path}{suffix}", headers=acme), 404)
        assert {**body, "instance": None} == {**missing, "instance": None}


async def test_job_id_in_upper_case_is_the_same_job(
    client: httpx.AsyncClient, acme: dict[str, str]
) -> None:
    job_id = await accept(client, acme)
    response = await client.get(f"/v1/jobs/{job_id.upper()}", headers=acme)
    assert response.status_code == 200 and response.json()["jobId"] == job_id


# --- probes, errors, OpenAPI --------------------------------------------------------------


async def test_healthz_answers_without_io(database_url: str, tmp_path: Path) -> None:
    app = create_app(settings_for(database_url, tmp_path))  # lifespan not run: no runtime
    async with client_for(app) as client:
        response = await client.get("/healthz")
        not_started = await client.get("/readyz")
    assert (response.status_code, response.json()) == (200, {"status": "ok"})
    assert "starting" in assert_problem(not_started, 503)["detail"]


async def test_readyz_is_200_when_database_and_broker_answer(
    database_url: str, tmp_path: Path
) -> None:
    rt = build_runtime(database_url, tmp_path, local_transport=True)
    try:
        async with client_for(create_app(rt.settings, runtime=rt)) as client:
            response = await client.get("/readyz")
    finally:
        await rt.transport.close()
        await rt.engine.dispose()
    assert response.status_code == 200
    assert response.json() == {"status": "ready", "database": "ok", "broker": "ok"}


@pytest.mark.parametrize(
    "failure", [TransportError("connection refused"), RuntimeError("bug in ping")]
)
async def test_readyz_is_503_naming_the_broker(
    database_url: str, tmp_path: Path, failure: Exception
) -> None:
    rt = build_runtime(database_url, tmp_path, transport=ProbeTransport(failure))
    try:
        async with client_for(create_app(rt.settings, runtime=rt)) as client:
            response = await client.get("/readyz")
    finally:
        await rt.engine.dispose()
    body = assert_problem(response, 503)
    assert (body["database"], body["broker"]) == ("ok", "unavailable")
    assert "broker" in body["detail"] and str(failure) not in response.text


def broken_database(database_url: str, tmp_path: Path) -> str:
    if database_url.startswith("sqlite"):
        # Not a directory or a missing path: aiosqlite leaves a thread behind when the open
        # itself fails. A file that is not a database fails on the first statement instead.
        garbage = tmp_path / "garbage.db"
        garbage.write_bytes(b"this is not a database\n" * 200)
        return f"sqlite:///{garbage}"
    return "postgresql://postgres@127.0.0.1:1/nothing"  # nothing listens on port 1


async def test_readyz_is_503_naming_the_database_and_requests_are_503(
    database_url: str, tmp_path: Path
) -> None:
    # The local transport lives in the same database, so both are down, for real.
    rt = build_runtime(broken_database(database_url, tmp_path), tmp_path, local_transport=True)
    try:
        async with client_for(create_app(rt.settings, runtime=rt)) as client:
            ready = await client.get("/readyz")
            accept_ = await client.post("/v1/exports", json=BODY, headers=bearer("jr_x"))
    finally:
        await rt.transport.close()
        await rt.engine.dispose()
    body = assert_problem(ready, 503)
    assert (body["database"], body["broker"]) == ("unavailable", "unavailable")
    assert "database and broker" in body["detail"]
    assert "database" in assert_problem(accept_, 503)["detail"]
    assert "127.0.0.1" not in accept_.text and str(tmp_path) not in accept_.text


async def test_unexpected_error_is_a_bare_500_problem_and_is_logged(
    client: httpx.AsyncClient,
    runtime: Runtime,
    acme: dict[str, str],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def explode(job_id: str) -> None:
        raise RuntimeError("secret internals")

    monkeypatch.setattr(runtime.store, "get_job", explode)
    with caplog.at_level(logging.ERROR, logger="jobrelay.api"):
        response = await client.get(f"/v1/jobs/{uuid.uuid4()}", headers=acme)

    assert_problem(response, 500)
    assert "secret" not in response.text and "Traceback" not in response.text
    assert any("secret internals" in (r.exc_text or "") for r in caplog.records)


async def test_unknown_route_and_wrong_method_are_problems(client: httpx.AsyncClient) -> None:
    assert_problem(await client.get("/v2/nothing"), 404)
    assert_problem(await client.delete("/v1/exports"), 405)


async def test_openapi_lists_the_routes_with_their_models(client: httpx.AsyncClient) -> None:
    schema = (await client.get("/openapi.json")).json()
    paths = schema["paths"]
    assert {"/v1/exports", "/v1/jobs/{jobId}", "/v1/jobs/{jobId}/events",
            "/v1/jobs/{jobId}/result", "/healthz", "/readyz"} <= set(paths)  # fmt: skip
    export = paths["/v1/exports"]["post"]
    assert export["responses"]["202"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/Accepted"
    }
    request = export["requestBody"]["content"]["application/json"]["schema"]
    assert set(request["properties"]) == {"accountId", "period", "notifyEmail"}
    assert request["additionalProperties"] is False
    assert set(export["responses"]["422"]["content"]) == {PROBLEM}
    job = paths["/v1/jobs/{jobId}"]["get"]["responses"]
    assert job["200"]["content"]["application/json"]["schema"]["$ref"].endswith("/JobOut")
    assert set(job) == {"200", "401", "404", "410", "422", "429", "503"}  # 422: ?wait=
    job_schema = schema["components"]["schemas"]["JobOut"]
    assert set(job_schema["properties"]) == JOB_FIELDS


async def test_own_runtime_is_opened_by_the_lifespan_and_closed_after(
    database_url: str, tmp_path: Path
) -> None:
    app = create_app(settings_for(database_url, tmp_path))
    async with app.router.lifespan_context(app), client_for(app) as client:
        assert (await client.get("/readyz")).status_code == 200
        token = await make_token(get_runtime(app), "acme")
        # PostgreSQL: the API holds its own connections for its accepts (the intake).
        driver = get_runtime(app).store.driver
        intake = driver.intake if database_url.startswith("postgresql") else None
        assert (
            await client.post("/v1/exports", json=BODY, headers=bearer(token))
        ).status_code == 202
        if intake is not None:
            assert intake.active and intake.sent == 1  # the new job's one statement
    with pytest.raises(RuntimeError):
        get_runtime(app)
    assert intake is None or not intake.active  # closed with the runtime


async def test_lifespan_closes_only_the_runtime_it_opened(
    database_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    opened: list[Runtime] = []
    closed: list[Runtime] = []

    @contextlib.asynccontextmanager
    async def fake_open_runtime(settings: Settings) -> AsyncIterator[Runtime]:
        rt = build_runtime(settings.database_url, tmp_path)
        opened.append(rt)
        try:
            yield rt
        finally:
            closed.append(rt)
            await rt.engine.dispose()

    monkeypatch.setattr("jobrelay.api.factory.open_runtime", fake_open_runtime)
    app = create_app(settings_for(database_url, tmp_path))
    async with app.router.lifespan_context(app), client_for(app) as client:
        assert (await client.get("/readyz")).status_code == 200
        assert opened and not closed
    assert closed == opened
    with pytest.raises(RuntimeError):
        get_runtime(app)

    given = build_runtime(database_url, tmp_path)
    try:
        app = create_app(given.settings, runtime=given)
        async with app.router.lifespan_context(app), client_for(app) as client:
            assert (await client.get("/readyz")).status_code == 200
        assert get_runtime(app) is given  # still usable by its owner (`jobrelay up`)
        assert len(opened) == 1
    finally:
        await given.engine.dispose()
