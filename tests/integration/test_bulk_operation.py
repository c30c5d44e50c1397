"""One bulk operation acts on the set of jobs it started with (issue 21, item 6).

The console counts (a dry run), then repeats the call until nothing of what it counted is
left. Every round used to re-run the filter, so a job replayed in round 1 that failed again
at once (``Permanent``) matched again in round 2: 100 such jobs took 21 rounds and 491
replays. Now each answer carries ``before``, the console passes it on every round, and a job
that entered its state after it does not match. Here the fast-failing worker is played by the
test between rounds (claim, then quarantine: what the worker does for ``Permanent``), so every
replayed job is quarantined again before the next round, deterministically.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest

from jobrelay.domain.states import JobState
from jobrelay.runtime.wiring import Runtime
from tests.integration.api_fixtures import api_client, bearer, build_runtime, make_token

from .ops_fixtures import WORKER, new_job

pytestmark = pytest.mark.timeout(120)
JOBS = 100
ROUND = 10  # the console's batch is 50; smaller rounds make more chances to match twice
MAX_ROUNDS = 3 * JOBS // ROUND  # the console's loop has a cap too (10000)


@pytest.fixture
async def runtime(database_url: str, tmp_path: Path) -> AsyncIterator[Runtime]:
    rt = build_runtime(database_url, tmp_path, local_transport=True)
    await rt.transport.connect()
    yield rt
    await rt.transport.close()
    await rt.engine.dispose()


async def fail_permanently(runtime: Runtime, job_id: str) -> None:
    """What the worker does with a job whose function raises ``Permanent``."""
    store, now = runtime.store, runtime.clock()
    claim = await store.claim_job(job_id, WORKER, now, timedelta(seconds=30))
    assert claim is not None, job_id
    assert await store.quarantine(job_id, "Permanent: the upstream says no", now, claim=claim)


async def drive_like_the_console(
    client: httpx.AsyncClient, runtime: Runtime, headers: dict[str, str], body: dict[str, Any]
) -> tuple[int, list[dict[str, Any]]]:
    """jobs.js: count (dry run), then rounds passing the count's ``before`` until nothing
    remains or a round did nothing; after each round the replayed jobs fail again."""
    dry = await client.post("/v1/bulk/replay", json={**body, "dryRun": True}, headers=headers)
    assert dry.status_code == 200, dry.text
    before = dry.json().get("before")
    rounds: list[dict[str, Any]] = []
    while len(rounds) < MAX_ROUNDS:
        call = {**body, "limit": ROUND} | ({} if before is None else {"before": before})
        answer = await client.post("/v1/bulk/replay", json=call, headers=headers)
        assert answer.status_code == 200, answer.text
        batch = answer.json()
        rounds.append(batch)
        for job_id in batch["jobIds"]:
            await fail_permanently(runtime, job_id)
        if batch["remaining"] == 0 or batch["done"] + batch["refused"] == 0:
            break
    return dry.json()["matched"], rounds


@pytest.mark.long
async def test_one_bulk_replay_replays_each_fast_failing_job_once(runtime: Runtime) -> None:
    store = runtime.store
    job_ids = []
    for i in range(JOBS):
        period = f"{2000 + i // 12}-{i % 12 + 1:02d}"
        job_id, _ = await store.submit(await new_job(store, period), runtime.clock())
        await fail_permanently(runtime, job_id)
        job_ids.append(job_id)
    used = {j: (await store.get_job(j)).attempt for j in job_ids}  # 1 each
    admin = bearer(await make_token(runtime, None, admin=True))
    body = {"filter": {"reason": "permanent"}, "reason": "upstream fixed"}

    async with api_client(runtime) as client:
        matched, rounds = await drive_like_the_console(client, runtime, admin, body)

    assert matched == JOBS
    replayed = [j for batch in rounds for j in batch["jobIds"]]
    assert sorted(replayed) == sorted(job_ids)  # each job once, none twice
    assert len(rounds) == JOBS // ROUND and rounds[-1]["remaining"] == 0
    assert {batch["before"] for batch in rounds} == {rounds[0]["before"]}
    grant = runtime.settings.max_attempts
    for job_id in job_ids:
        job = await store.get_job(job_id)
        assert job.state is JobState.QUARANTINED  # it failed again, and stays for an operator
        assert job.max_attempts == used[job_id] + grant  # one grant only (attempt + budget)
        assert job.attempt == used[job_id] + 1
        kinds = [e.kind for e in await store.events(job_id)]
        assert kinds.count("replayed") == 1

    # A new operation (no ``before``) sees them all again: they are quarantined anew.
    async with api_client(runtime) as client:
        again = await client.post("/v1/bulk/replay", json={**body, "dryRun": True}, headers=admin)
    assert again.json()["matched"] == JOBS and again.json()["before"] > rounds[0]["before"]


async def test_a_job_quarantined_after_the_operation_began_is_not_in_it(runtime: Runtime) -> None:
    store = runtime.store
    first, _ = await store.submit(await new_job(store, "2020-01"), runtime.clock())
    await fail_permanently(runtime, first)
    admin = bearer(await make_token(runtime, None, admin=True))
    body = {"filter": {"state": "quarantined"}, "reason": "retry them"}
    async with api_client(runtime) as client:
        dry = await client.post("/v1/bulk/replay", json={**body, "dryRun": True}, headers=admin)
        before = dry.json()["before"]
        late, _ = await store.submit(await new_job(store, "2020-02"), runtime.clock())
        await fail_permanently(runtime, late)
        run = await client.post("/v1/bulk/replay", json={**body, "before": before}, headers=admin)
        assert run.json()["jobIds"] == [first] and run.json()["remaining"] == 0
        for bad in (-1, "7", True, 2**63, 1.5):
            refused = await client.post(
                "/v1/bulk/replay", json={**body, "before": bad}, headers=admin
            )
            assert refused.status_code == 422, bad
            assert "before" in [e["field"] for e in refused.json()["errors"]], refused.text
    assert (await store.get_job(late)).state is JobState.QUARANTINED
