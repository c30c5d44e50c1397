"""What an account may learn of its jobs' failures (issue 25, items 1, 2 and 5).

Jobs fail in the real worker with each leak the pattern-based redaction let through (a host
of two labels, a server path, unbracketed IPv6, an upper-case host, urllib3's
``HTTPConnectionPool(host='minio'…)``, S3's ``AccessDenied`` with an ARN, an account id and a
bucket). The account's ``GET /v1/jobs/{id}``, ``/events``, ``/explain`` and ``GET /v1/jobs``
must show none of it, and the admin's must show all of it (so the plant is real). The
``reason`` filter must not answer questions about text the account cannot read, and the
404 for another account's job must run the very statements of the 404 for no job.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import BaseModel
from sqlalchemy import event

import jobrelay
from jobrelay.domain.states import JobState
from jobrelay.errors import PermanentError, StoreError, TransientError
from jobrelay.runtime.wiring import Runtime
from jobrelay.transport.base import Delivery
from jobrelay.worker.consumer import Worker
from tests.integration.api_fixtures import Clock, api_client, bearer, build_runtime, make_token

pytestmark = pytest.mark.timeout(90)

ARN = "arn:aws:iam::123456789012:user/exporter"
FAILURES: dict[str, BaseException] = {
    "two-labels": OSError("connecting to mailhub.internal:25 failed"),
    "path": FileExistsError(17, "File exists", "/srv/jr/var/exports/exports/initech"),
    "ipv6": TransientError("connect to 2001:db8::7 port 5432 failed"),
    "upper": StoreError("could not connect to DB-PRIMARY.CORP"),
    "pool": TransientError(
        "S3 put failed: ConnectionError: HTTPConnectionPool(host='minio', port=9000): "
        "Max retries exceeded"
    ),
    "s3": PermanentError(
        "An error occurred (AccessDenied) when calling the PutObject operation: User: "
        f"{ARN} is not authorized to perform: s3:PutObject on resource: "
        "arn:aws:s3:::acme-private-exports/x.csv"
    ),
    "loopback": OSError("connecting to 127.0.0.1"),
}
PRIVATE = (
    "mailhub",
    "/srv/jr",
    "initech",
    "2001:db8",
    "DB-PRIMARY",
    "minio",
    "AccessDenied",
    "123456789012",
    "acme-private-exports",
    "127.0.0.1",
    "relay is down",  # the cause of the job's own Retry: the operators' only
)


class Case(BaseModel):
    case: str


app = jobrelay.App()


@app.job("leaky.job", params=Case, max_attempts=2, retry_delays=(5,))
async def leaky(ctx: jobrelay.JobContext[Case], params: Case) -> jobrelay.Result | None:
    if params.case == "own-words":
        try:
            raise OSError("relay is down at mailhub.internal")
        except OSError as exc:
            raise jobrelay.Retry("the mail server is busy, trying again soon") from exc
    if params.case == "refused":
        raise jobrelay.Permanent("period 2020-13 does not exist")
    raise FAILURES[params.case]


class _Delivery:
    def __init__(self, body: bytes) -> None:
        self.body = body
        self.headers: dict[str, str] = {}
        self.redelivered = False
        self.delivery_count = 1

    async def ack(self) -> bool:
        return True

    async def reject(self) -> bool:
        return True

    def outcome_committed(self) -> None:
        return None  # no prefetch window of its own to free

    async def release(self) -> None:
        return None


@pytest.fixture
async def rt(database_url: str, tmp_path: Path) -> AsyncIterator[Runtime]:
    runtime = dataclasses.replace(build_runtime(database_url, tmp_path, clock=Clock()), app=app)
    yield runtime
    await runtime.engine.dispose()


async def run(rt: Runtime, job_id: str) -> None:
    body = json.dumps({"jobId": job_id, "type": "leaky.job", "version": 1}).encode()
    delivery: Delivery = _Delivery(body)
    await Worker(rt).handle(delivery)


async def failed_jobs(rt: Runtime) -> dict[str, str]:
    """One job per case, failed by the worker: retry_wait, quarantined, or exhausted."""
    ids: dict[str, str] = {}
    async with rt.engine.begin() as conn:
        for case in [*FAILURES, "own-words", "refused"]:
            ids[case] = await leaky.enqueue(conn, Case(case=case), account="acme")
    for job_id in ids.values():
        await run(rt, job_id)
    assert isinstance(rt.clock, Clock)
    rt.clock.advance(10)  # the retries are due: the second and last attempt quarantines
    for case in ("two-labels", "upper"):
        await run(rt, ids[case])
    return ids


async def views(client: httpx.AsyncClient, token: dict[str, str], ids: dict[str, str]) -> str:
    texts = []
    for job_id in ids.values():
        for path in ("", "/events", "/explain"):
            response = await client.get(f"/v1/jobs/{job_id}{path}", headers=token)
            assert response.status_code == 200, response.text
            texts.append(response.text)
    listed = await client.get("/v1/jobs", params={"limit": 100}, headers=token)
    assert listed.status_code == 200 and len(listed.json()["jobs"]) == len(ids)
    return "\n".join([*texts, listed.text])


async def test_no_raw_error_text_reaches_an_account(rt: Runtime) -> None:
    ids = await failed_jobs(rt)
    states = {case: (await rt.store.get_job(i)).state for case, i in ids.items()}  # type: ignore[union-attr]
    assert states["two-labels"] is states["upper"] is states["s3"] is JobState.QUARANTINED
    assert states["ipv6"] is states["own-words"] is JobState.RETRY_WAIT
    async with api_client(rt) as client:
        account = await views(client, bearer(await make_token(rt, "acme")), ids)
        admin = await views(client, bearer(await make_token(rt, None, admin=True)), ids)
        own = (
            await client.get(
                f"/v1/jobs/{ids['own-words']}", headers=bearer(await make_token(rt, "acme"))
            )
        ).json()
        exhausted = (
            await client.get(
                f"/v1/jobs/{ids['upper']}/explain", headers=bearer(await make_token(rt, "acme"))
            )
        ).json()
    for private in PRIVATE:
        assert private in admin, f"the plant {private!r} is not in the admin's view"
        assert private not in account, private
    # What the account reads instead: a code and a message written for it.
    assert own["lastError"] == "retry: the mail server is busy, trying again soon"
    assert "refused: period 2020-13 does not exist" in account
    assert exhausted["quarantineReason"].startswith(
        "attempts_exhausted: 2 of 2 attempts failed; the last: temporary_failure: "
    )
    assert [a["error"].split(":")[0] for a in exhausted["attempts"]] == [
        "temporary_failure",
        "attempts_exhausted",
    ]


async def test_an_accounts_reason_search_matches_only_what_it_can_read(rt: Runtime) -> None:
    ids = await failed_jobs(rt)
    async with api_client(rt) as client:
        acme = bearer(await make_token(rt, "acme"))
        admin = bearer(await make_token(rt, None, admin=True))

        async def found(token: dict[str, str], reason: str) -> set[str]:
            response = await client.get("/v1/jobs", params={"reason": reason}, headers=token)
            assert response.status_code == 200, response.text
            return {j["jobId"] for j in response.json()["jobs"]}

        # The attack of the issue: guess the hidden text one character at a time.
        guessed = "connecting to "
        for _ in range(len("127.0.0.1")):
            hits = [c for c in "0123456789." if await found(acme, guessed + c)]
            if not hits:
                break
            guessed += hits[0]
        assert guessed == "connecting to ", guessed  # not one character learnt
        assert await found(acme, "127.0.0.1") == set()
        assert await found(acme, "mailhub") == set()
        assert await found(admin, "127.0.0.1") == {ids["loopback"]}  # the text is there
        # What the account can read, it can search.
        assert await found(acme, "mail server is busy") == {ids["own-words"]}
        assert ids["loopback"] in await found(acme, "unexpected_error")


@pytest.fixture
def statements(rt: Runtime) -> Iterator[list[str]]:
    seen: list[str] = []

    def record(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        seen.append(statement)

    event.listen(rt.engine.sync_engine, "before_cursor_execute", record)
    yield seen
    event.remove(rt.engine.sync_engine, "before_cursor_execute", record)


async def test_another_accounts_job_and_no_job_are_404_by_the_same_statements(
    rt: Runtime, statements: list[str]
) -> None:
    async with rt.engine.begin() as conn:
        theirs = await leaky.enqueue(conn, Case(case="path"), account="globex")
    missing = "0190c9a0-0000-7000-8000-000000000000"
    async with api_client(rt) as client:
        acme = bearer(await make_token(rt, "acme"))
        await client.get(f"/v1/jobs/{missing}", headers=acme)  # warm: the token is cached
        paths: dict[str, list[str]] = {}
        for name, job_id in (("theirs", theirs), ("missing", missing)):
            for suffix in ("", "/events", "/explain", "/result"):
                statements.clear()
                response = await client.get(f"/v1/jobs/{job_id}{suffix}", headers=acme)
                assert response.status_code == 404, (name, suffix, response.text)
                paths[f"{name}{suffix}"] = list(statements)
                body = response.json()
                assert body["detail"] == "no job with this id is visible to this token", body
    for suffix in ("", "/events", "/explain", "/result"):
        assert paths[f"theirs{suffix}"] == paths[f"missing{suffix}"], suffix
        assert len(paths[f"missing{suffix}"]) >= 2  # the job, then its tombstone
