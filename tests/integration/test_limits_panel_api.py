"""``GET /v1/limits`` grouped per limit for the console's limits panel (issue 36): each limit's
totals over all its keys (running, waiting, the oldest wait and its age by the server's
clock, its declared values and the whole limit's override), and with ``?top=N`` only its N
keys with the most waiting (then running) listed, the rest counted: a limit with a
thousand keys is a bounded answer the page draws as it comes.

On SQLite and PostgreSQL (``database_url``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from jobrelay.runtime.wiring import Runtime
from jobrelay.storage.limit_overrides import set_override
from jobrelay.storage.store import Store
from tests.integration.api_fixtures import T0, Clock, api_client, bearer, build_runtime, make_token

from .test_limits import export, mail, submit

pytestmark = pytest.mark.timeout(90)


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
async def runtime(database_url: str, tmp_path: Path, clock: Clock) -> AsyncIterator[Runtime]:
    rt = build_runtime(database_url, tmp_path, clock=clock)
    yield rt
    await rt.engine.dispose()


@pytest.fixture
async def client(runtime: Runtime) -> AsyncIterator[httpx.AsyncClient]:
    async with api_client(runtime) as c:
        yield c


def keys_of(body: dict[str, Any], limit: str) -> list[tuple[str | None, int, int]]:
    return [(r["key"], r["running"], r["waiting"]) for r in body["limits"] if r["limit"] == limit]


async def test_limits_are_grouped_per_limit_with_its_top_keys_and_the_rest_counted(
    client: httpx.AsyncClient, runtime: Runtime, clock: Clock
) -> None:
    """Old code: no ``groups`` and no ``top``; a page had to add up every key's row itself."""
    s = runtime.store
    assert isinstance(s, Store)
    admin = bearer(await make_token(runtime, None, admin=True))
    # lab.export: 2 per account. acme 2 running + 3 waiting, globex 2 + 1, three keys 1 + 0.
    for account, n in [("acme", 5), ("globex", 3), ("k1", 1), ("k2", 1), ("k3", 1)]:
        [await submit(s, export, account, i) for i in range(n)]
    # smtp: one rate limit without a key, a burst of 2: 2 admitted, 4 waiting.
    [await submit(s, mail, f"acct-{i}", i) for i in range(6)]
    assert (await s.admit_waiting(100)).admitted == 2 + 2 + 3 + 2
    await set_override(s, "lab.export", max=3, actor="alice", reason="<b>sale</b>", now=T0)
    clock.advance(90)

    top = await client.get("/v1/limits", params={"top": 2}, headers=admin)
    assert top.status_code == 200, top.text
    body = top.json()
    export_group, smtp_group = body["groups"]
    assert {k: export_group[k] for k in ("limit", "kind", "keys", "running", "waiting")} == {
        "limit": "lab.export",
        "kind": "concurrency",
        "keys": 5,
        "running": 7,
        "waiting": 4,
    }
    assert (export_group["otherKeys"], export_group["otherRunning"]) == (3, 3)
    assert export_group["otherWaiting"] == 0
    assert export_group["declared"] == [{"max": 2, "perSecond": None, "burst": None}]
    assert export_group["override"]["reason"] == "<b>sale</b>"
    assert export_group["override"]["key"] is None and export_group["override"]["max"] == 3
    assert export_group["waitingSince"] is not None and export_group["waitingSeconds"] == 90.0
    assert {k: smtp_group[k] for k in ("limit", "kind", "keys", "running", "waiting")} == {
        "limit": "smtp",
        "kind": "rate",
        "keys": 0,
        "running": 2,
        "waiting": 4,
    }
    assert (smtp_group["otherKeys"], smtp_group["override"]) == (0, None)
    # Only the top keys are listed, the most waiting first; a keyless limit's row always.
    assert keys_of(body, "lab.export") == [("acme", 2, 3), ("globex", 2, 1)]
    assert keys_of(body, "smtp") == [(None, 2, 4)]
    [acme] = [r for r in body["limits"] if r["key"] == "acme"]
    assert acme["waitingSeconds"] == 90.0 and acme["current"]["max"] == 3

    every = await client.get("/v1/limits", headers=admin)
    assert every.status_code == 200, every.text
    whole = every.json()
    assert [g["otherKeys"] for g in whole["groups"]] == [0, 0]
    assert [g["running"] for g in whole["groups"]] == [7, 2]
    assert sorted(k for k, _, _ in keys_of(whole, "lab.export")) == [
        "acme",
        "globex",
        "k1",
        "k2",
        "k3",
    ]
    for bad in ("0", "101", "x"):
        refused = await client.get("/v1/limits", params={"top": bad}, headers=admin)
        assert refused.status_code == 422, refused.text


async def test_no_limit_in_use_is_an_empty_answer(
    client: httpx.AsyncClient, runtime: Runtime
) -> None:
    admin = bearer(await make_token(runtime, None, admin=True))
    response = await client.get("/v1/limits", params={"top": 10}, headers=admin)
    assert response.status_code == 200, response.text
    assert response.json() == {"limits": [], "groups": []}
