"""Return values (issue 37, item 1): a job returns any JSON value, kept with its success.

On both databases, through the relay, the broker (RabbitMQ, or the local transport) and a
real worker: a dict, a list, a str, an int, a bool, None and a ``jobrelay.Result`` with
``value=`` each come back as ``Job.result`` and in ``GET /v1/jobs/{id}``; a value that is not
JSON, or too large, fails the attempt permanently at the first attempt with a reason that
says so, its body run once (never retried into repeating its side effects).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any

import httpx
import pytest
from pydantic import BaseModel

import jobrelay
from jobrelay.api import create_app
from jobrelay.domain.states import JobState

from .api_fixtures import bearer, make_token

pytestmark = pytest.mark.timeout(120)

RETURNED: dict[str, Any] = {
    "dict": {"rows": 42, "nested": {"ok": True, "names": ["a", "é"]}},
    "list": [1, "two", None, 3.5],
    "str": "done",
    "int": 7,
    "bool": False,
    "none": None,
}


class Ask(BaseModel):
    kind: str


app = jobrelay.App()
runs: Counter[str] = Counter()


@app.job("lab.value", params=Ask, max_attempts=3, retry_delays=(1,))
async def value(ctx: jobrelay.JobContext[Ask], p: Ask) -> Any:
    runs[p.kind] += 1
    if p.kind == "result":
        return jobrelay.Result(key=None, meta={"source": "lab"}, value={"square": 9})
    if p.kind == "set":
        return {1, 2}  # not JSON
    if p.kind == "huge":
        return "x" * (app.settings.result_max_bytes + 1)
    return RETURNED[p.kind]


async def test_a_returned_json_value_is_the_jobs_result(make_pipeline: Any) -> None:
    """Old code: ``return {"rows": 42}`` ran the body, then failed the attempt with
    ``AttributeError: 'dict' object has no attribute 'key'``, retried it (repeating its side
    effects) and quarantined it."""
    runs.clear()
    async with make_pipeline() as p:
        p.rt = dataclasses.replace(p.rt, app=app)
        kinds = [*RETURNED, "result"]
        ids = {
            kind: (await p.store.submit(value.new_job(Ask(kind=kind)), p.rt.clock()))[0]
            for kind in kinds
        }
        p.start_relay()
        await p.start_worker()
        done = {k: await p.wait_for(i, lambda j: j.state.is_terminal) for k, i in ids.items()}
        for kind in RETURNED:
            job = done[kind]
            assert job.state is JobState.SUCCEEDED and job.attempt == 1, (kind, job.last_error)
            assert job.result == RETURNED[kind], kind
            assert job.result_meta == {}, kind  # nothing mixed into the application's value
        boxed = done["result"]
        assert boxed.result == {"square": 9} and boxed.result_meta == {"source": "lab"}
        assert all(runs[kind] == 1 for kind in kinds), runs

        token = await make_token(p.rt, None, admin=True)
        api = create_app(p.rt.settings, runtime=p.rt)
        transport = httpx.ASGITransport(app=api)
        async with httpx.AsyncClient(transport=transport, base_url="http://api") as client:
            for kind in ("dict", "none", "result"):
                answer = await client.get(f"/v1/jobs/{ids[kind]}", headers=bearer(token))
                assert answer.status_code == 200, answer.text
                body = answer.json()
                assert body["state"] == "succeeded"
                expected = {"square": 9} if kind == "result" else RETURNED[kind]
                assert body["result"] == expected, kind


@pytest.mark.parametrize(
    ("kind", "says"),
    [("set", "not JSON (set)"), ("huge", "over JOBRELAY_RESULT_MAX_BYTES")],
)
async def test_a_value_that_cannot_be_kept_fails_at_the_first_attempt_without_a_retry(
    make_pipeline: Any, kind: str, says: str
) -> None:
    runs.clear()
    async with make_pipeline() as p:
        p.rt = dataclasses.replace(p.rt, app=app)
        job_id, _ = await p.store.submit(value.new_job(Ask(kind=kind)), p.rt.clock())
        p.start_relay()
        await p.start_worker()
        job = await p.wait_for(job_id, lambda j: j.state.is_terminal)
        assert job.state is JobState.QUARANTINED and job.attempt == 1
        assert says in (job.quarantine_reason or ""), job.quarantine_reason
        assert job.result is None
        assert runs[kind] == 1  # the body ran once: no retry repeated its effects
        assert "retry_scheduled" not in await p.kinds(job_id)
