"""A live event stream (issue 37, item 5): ``GET /v1/jobs/{id}/events`` as server-sent events.

On both databases, through the relay, the broker and a real worker: a job that runs twice (a
retry) streams every event once, in the JSON route's order and redaction, then ``end``;
``Last-Event-ID`` resumes after an event; an idle stream sends a comment.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from typing import Any

import httpx
import pytest
from pydantic import BaseModel

import jobrelay
from jobrelay.api import create_app, event_stream
from jobrelay.domain.states import JobState

from .api_fixtures import bearer, make_token

pytestmark = pytest.mark.timeout(120)

ACCOUNT = "acct-stream"


class Ask(BaseModel):
    n: int


app = jobrelay.App()


@app.job("lab.twice", params=Ask, max_attempts=3, retry_delays=(1,))
async def twice(ctx: jobrelay.JobContext[Ask], p: Ask) -> Any:
    if ctx.attempt == 1:
        raise jobrelay.Retry("the first attempt fails")
    return {"n": p.n}


@pytest.fixture(autouse=True)
def quick(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(event_stream, "POLL_SECONDS", 0.1)
    monkeypatch.setattr(event_stream, "TAIL_SECONDS", 0.5)


def _frames(body: str) -> list[dict[str, str]]:
    frames = []
    for block in body.split("\n\n"):
        fields: dict[str, str] = {}
        for line in block.splitlines():
            name, _, value = line.partition(": ")
            fields[name] = value
        if "event" in fields:
            frames.append(fields)
    return frames


async def test_a_retried_job_streams_every_event_once_in_the_json_routes_order(
    make_pipeline: Any,
) -> None:
    async with make_pipeline() as p:
        p.rt = dataclasses.replace(p.rt, app=app)
        job_id, _ = await p.store.submit(twice.new_job(Ask(n=3), account=ACCOUNT), p.rt.clock())
        token = await make_token(p.rt, ACCOUNT)
        api = create_app(p.rt.settings, runtime=p.rt)
        transport = httpx.ASGITransport(app=api)
        async with httpx.AsyncClient(transport=transport, base_url="http://api") as client:
            headers = {**bearer(token), "Accept": "text/event-stream"}
            streamed = asyncio.create_task(client.get(f"/v1/jobs/{job_id}/events", headers=headers))
            p.start_relay()
            await p.start_worker()
            answer = await asyncio.wait_for(streamed, 60)
            assert answer.status_code == 200, answer.text
            assert answer.headers["content-type"].startswith("text/event-stream")
            frames = _frames(answer.text)
            assert frames[-1]["event"] == "end"
            events = frames[:-1]
            cursors = [f["id"] for f in events]
            assert len(cursors) == len(set(cursors))
            assert len(events) == len({f["data"] for f in events})  # each event once
            whole = await client.get(f"/v1/jobs/{job_id}/events", headers=bearer(token))
            # The JSON route's events, each once, as it shows them; in causal order, which
            # is the route's except between events written at once by different processes
            # (CI: the first attempt's batched ``ack_sent`` streamed before the retry's
            # ``published``, whose time is the relay's earlier claim): each message's
            # ``published`` before the ``claimed`` it led to, the retry before the success.
            streamed = [json.loads(f["data"]) for f in events]
            listed = whole.json()["events"]
            assert sorted(streamed, key=json.dumps) == sorted(listed, key=json.dumps)
            kinds = [f["event"] for f in events]
            assert kinds.count("claimed") == 2 and "retry_scheduled" in kinds
            assert kinds.index("retry_scheduled") < kinds.index("result_saved")
            published = [i for i, kind in enumerate(kinds) if kind == "published"]
            claimed = [i for i, kind in enumerate(kinds) if kind == "claimed"]
            assert kinds[0] == "accepted" and all(
                p < c for p, c in zip(published, claimed, strict=True)
            )

            # A client that reconnects after any event gets exactly the rest, and the end.
            for k in (0, 2, len(events) - 1):
                resumed = await client.get(
                    f"/v1/jobs/{job_id}/events",
                    headers={**headers, "Last-Event-ID": cursors[k]},
                )
                again = _frames(resumed.text)
                # The rest, exactly; events no cause orders may come in another order than
                # the live stream sent them (they are all committed by now).
                rest = sorted(f["data"] for f in events[k + 1 :])
                assert sorted(f["data"] for f in again[:-1]) == rest
                assert again[-1]["event"] == "end"
        job = await p.store.get_job(job_id)
        assert job is not None and job.state is JobState.SUCCEEDED


async def test_an_idle_stream_sends_a_comment_and_nothing_else(
    make_pipeline: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(event_stream, "KEEPALIVE_SECONDS", 0.3)
    async with make_pipeline() as p:
        p.rt = dataclasses.replace(p.rt, app=app)
        job_id, _ = await p.store.submit(twice.new_job(Ask(n=1)), p.rt.clock())
        frames = event_stream.stream_events(p.rt, job_id, admin=True, after=None)
        seen = [await anext(frames) for _ in range(3)]
        assert seen[0].startswith(b"retry: ")
        assert seen[1].startswith(b"id: ") and b"event: accepted" in seen[1]
        assert seen[2] == b": keep-alive\n\n"  # nobody runs it: the stream stays, quietly
        await frames.aclose()
