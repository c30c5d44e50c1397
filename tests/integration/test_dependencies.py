"""Jobs that run after others (issue 37, item 2): ``after=``, the ``waiting`` state, fan-in.

On both databases, through the relay, the broker (RabbitMQ, or the local transport) and real
workers: a total written ``after=`` its parts runs once, after the last part's success, and
reads their results; a part that fails cancels it (naming the part) or, with
``after_failure="run"``, lets it run; ids that do not exist or are another account's are
refused with nothing written; dependencies already ended count as ended.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
from typing import Any

import httpx
import pytest
from pydantic import BaseModel
from sqlalchemy import func, select

import jobrelay
from jobrelay.admin.explain import console, show_job
from jobrelay.api import create_app
from jobrelay.domain.states import JobState
from jobrelay.storage.tables import job_dependencies, job_events, jobs, outbox

from .api_fixtures import bearer, make_token

pytestmark = pytest.mark.timeout(120)


class Part(BaseModel):
    i: int
    fail: bool = False


class Total(BaseModel):
    pass


app = jobrelay.App()
total_runs: list[str] = []


@app.job("lab.part", params=Part, max_attempts=1)
async def part(ctx: jobrelay.JobContext[Part], p: Part) -> Any:
    if p.fail:
        raise jobrelay.Permanent("this part cannot succeed")
    return {"square": p.i * p.i}


@app.job("lab.total", params=Total, http=True)
async def total(ctx: jobrelay.JobContext[Total], p: Total) -> Any:
    total_runs.append(ctx.job_id)
    deps = await ctx.dependencies()
    return {
        "total": sum(d.result["square"] for d in deps if d.state is JobState.SUCCEEDED),
        "states": [d.state.value for d in deps],
    }


class Start(BaseModel):
    after: list[str]


@app.job("lab.start", params=Start)
async def start(ctx: jobrelay.JobContext[Start], p: Start) -> Any:
    return ctx.follow_up(total, Total(), after=p.after)


async def _event_ids(p: Any, job_id: str, kind: str) -> list[int]:
    async with p.rt.store.reading() as conn:
        rows = await conn.scalars(
            select(job_events.c.id)
            .where(job_events.c.job_id == job_id, job_events.c.kind == kind)
            .order_by(job_events.c.id)
        )
        return list(rows.all())


async def test_a_total_after_its_parts_runs_once_after_the_last_and_reads_their_results(
    make_pipeline: Any,
) -> None:
    total_runs.clear()
    async with make_pipeline() as p:
        p.rt = dataclasses.replace(p.rt, app=app)
        now = p.rt.clock()
        ids = [(await p.store.submit(part.new_job(Part(i=i)), now))[0] for i in range(30)]
        total_id, created = await p.store.submit(total.new_job(Total(), after=ids), now)
        assert created
        waiting = await p.store.get_job(total_id)
        assert waiting is not None and waiting.state is JobState.WAITING
        assert waiting.waiting_for == 30
        async with p.rt.store.reading() as conn:
            held = await conn.scalar(
                select(func.count()).select_from(outbox).where(outbox.c.job_id == total_id)
            )
        assert held == 0  # no message while it waits
        p.start_relay()
        await p.start_worker()
        await p.start_worker()
        done = await p.wait_for(total_id, lambda j: j.state.is_terminal, timeout=60)
        assert done.state is JobState.SUCCEEDED, done.last_error
        assert done.result == {
            "total": sum(i * i for i in range(30)),
            "states": ["succeeded"] * 30,
        }
        assert total_runs == [total_id]
        assert (
            await _event_ids(p, total_id, "result_saved")
            and len(await _event_ids(p, total_id, "dependencies_met")) == 1
        )
        # Never before the last part's success.
        [claimed] = await _event_ids(p, total_id, "claimed")
        last_part = max([(await _event_ids(p, i, "result_saved"))[0] for i in ids])
        assert claimed > last_part
        assert [d.id for d in await p.store.dependencies_of(total_id)] == ids


@pytest.mark.parametrize("after_failure", ["cancel", "run"])
async def test_a_part_that_fails_cancels_the_total_or_lets_it_run(
    make_pipeline: Any, after_failure: str
) -> None:
    total_runs.clear()
    async with make_pipeline() as p:
        p.rt = dataclasses.replace(p.rt, app=app)
        now = p.rt.clock()
        good = (await p.store.submit(part.new_job(Part(i=2)), now))[0]
        bad = (await p.store.submit(part.new_job(Part(i=3, fail=True)), now))[0]
        new = total.new_job(Total(), after=[good, bad], after_failure=after_failure)
        total_id, _ = await p.store.submit(new, now)
        p.start_relay()
        await p.start_worker()
        done = await p.wait_for(total_id, lambda j: j.state.is_terminal)
        if after_failure == "cancel":
            assert done.state is JobState.CANCELLED
            assert bad in (done.cancel_reason or ""), done.cancel_reason
            assert "quarantined" in (done.cancel_reason or "")
            assert total_runs == []
            waiter = jobrelay.App(settings=p.rt.settings)
            try:
                with pytest.raises(jobrelay.JobFailed) as failed:
                    await waiter.result(total_id, timeout=5)
            finally:
                await waiter.aclose()
            assert failed.value.state == "cancelled" and bad in (failed.value.reason or "")
        else:
            assert done.state is JobState.SUCCEEDED, done.last_error
            assert done.result == {"total": 4, "states": ["succeeded", "quarantined"]}
            assert total_runs == [total_id]


async def test_dependencies_already_ended_count_as_ended(make_pipeline: Any) -> None:
    total_runs.clear()
    async with make_pipeline() as p:
        p.rt = dataclasses.replace(p.rt, app=app)
        now = p.rt.clock()
        first = (await p.store.submit(part.new_job(Part(i=5)), now))[0]
        p.start_relay()
        await p.start_worker()
        await p.wait_for(first, lambda j: j.state is JobState.SUCCEEDED)
        total_id, _ = await p.store.submit(total.new_job(Total(), after=[first]), p.rt.clock())
        queued = await p.store.get_job(total_id)
        assert queued is not None and queued.state is not JobState.WAITING
        done = await p.wait_for(total_id, lambda j: j.state.is_terminal)
        assert done.state is JobState.SUCCEEDED and done.result["total"] == 25


async def test_unknown_or_foreign_dependencies_are_refused_with_nothing_written(
    make_pipeline: Any,
) -> None:
    async with make_pipeline() as p:
        p.rt = dataclasses.replace(p.rt, app=app)
        now = p.rt.clock()
        theirs = (await p.store.submit(part.new_job(Part(i=1), account="acct-b"), now))[0]
        mine = (await p.store.submit(part.new_job(Part(i=1), account="acct-a"), now))[0]
        async with p.rt.store.reading() as conn:
            before = await conn.scalar(select(func.count()).select_from(jobs))
        for after in (["no-such-job"], [mine, theirs]):
            with pytest.raises(jobrelay.InvalidDependencies) as refused:
                await p.store.submit(total.new_job(Total(), account="acct-a", after=after), now)
            assert refused.value.missing == (after[-1],)
        with pytest.raises(jobrelay.InvalidDependencies, match="after_failure"):
            total.new_job(Total(), after=[mine], after_failure="maybe")
        async with p.rt.store.reading() as conn:
            assert await conn.scalar(select(func.count()).select_from(jobs)) == before
            assert await conn.scalar(select(func.count()).select_from(job_dependencies)) == 0
        # The same account's, and (on no account's behalf) anyone's, are accepted.
        ok, _ = await p.store.submit(total.new_job(Total(), account="acct-a", after=[mine]), now)
        anyone, _ = await p.store.submit(total.new_job(Total(), after=[mine, theirs]), now)
        assert {(await p.store.get_job(i)).state for i in (ok, anyone)} == {JobState.WAITING}  # type: ignore[union-attr]


async def test_the_same_request_again_writes_nothing_and_other_dependencies_conflict(
    make_pipeline: Any,
) -> None:
    async with make_pipeline() as p:
        p.rt = dataclasses.replace(p.rt, app=app)
        now = p.rt.clock()
        a = (await p.store.submit(part.new_job(Part(i=1)), now))[0]
        b = (await p.store.submit(part.new_job(Part(i=2)), now))[0]
        first = total.new_job(Total(), job_id="fan-in-1", after=[a, b])
        assert (await p.store.submit(first, now)) == ("fan-in-1", True)
        assert (await p.store.submit(first, now)) == ("fan-in-1", False)
        async with p.rt.store.reading() as conn:
            edges = await conn.scalar(
                select(func.count())
                .select_from(job_dependencies)
                .where(job_dependencies.c.job_id == "fan-in-1")
            )
        assert edges == 2
        with pytest.raises(jobrelay.IdempotencyConflict):
            await p.store.submit(total.new_job(Total(), job_id="fan-in-1", after=[a]), now)


async def test_a_follow_up_may_run_after_other_jobs(make_pipeline: Any) -> None:
    total_runs.clear()
    async with make_pipeline() as p:
        p.rt = dataclasses.replace(p.rt, app=app)
        now = p.rt.clock()
        later = (await p.store.submit(part.new_job(Part(i=4)), now))[0]
        starter = (await p.store.submit(start.new_job(Start(after=[later])), now))[0]
        p.start_relay()
        await p.start_worker()
        began = await p.wait_for(starter, lambda j: j.state.is_terminal)
        follow_up = began.result
        assert isinstance(follow_up, str)
        done = await p.wait_for(follow_up, lambda j: j.state.is_terminal)
        assert done.state is JobState.SUCCEEDED and done.result["total"] == 16
        assert [d.id for d in await p.store.dependencies_of(follow_up)] == [later]


async def test_post_jobs_takes_after_and_explain_shows_the_wait(make_pipeline: Any) -> None:
    async with make_pipeline() as p:
        p.rt = dataclasses.replace(p.rt, app=app)
        now = p.rt.clock()
        a = (await p.store.submit(part.new_job(Part(i=1), account="acct-a"), now))[0]
        b = (await p.store.submit(part.new_job(Part(i=2), account="acct-a"), now))[0]
        theirs = (await p.store.submit(part.new_job(Part(i=3), account="acct-b"), now))[0]
        token = await make_token(p.rt, "acct-a")
        admin = await make_token(p.rt, None, admin=True)
        api = create_app(p.rt.settings, runtime=p.rt)
        transport = httpx.ASGITransport(app=api)
        async with httpx.AsyncClient(transport=transport, base_url="http://api") as client:
            body = {"type": "lab.total", "params": {}, "after": [a, b], "afterFailure": "run"}
            accepted = await client.post("/v1/jobs", json=body, headers=bearer(token))
            assert accepted.status_code == 202, accepted.text
            total_id = accepted.json()["jobId"]
            job = (await client.get(f"/v1/jobs/{total_id}", headers=bearer(token))).json()
            assert (job["state"], job["waitingFor"]) == ("waiting", 2)

            refused = await client.post(
                "/v1/jobs",
                json={"type": "lab.total", "params": {}, "after": [a, theirs]},
                headers=bearer(token),
            )
            assert refused.status_code == 422, refused.text
            problem = refused.json()
            assert problem["errors"][0]["field"] == "after" and theirs in problem["detail"]
            bad = await client.post(
                "/v1/jobs",
                json={"type": "lab.total", "params": {}, "after": [a], "afterFailure": "x"},
                headers=bearer(token),
            )
            assert bad.status_code == 422

            seen = (await client.get(f"/v1/jobs/{total_id}/explain", headers=bearer(admin))).json()
            assert seen["after"]["total"] == 2 and seen["after"]["waitingFor"] == 2
            assert seen["after"]["afterFailure"] == "run"
            assert [j["jobId"] for j in seen["after"]["jobs"]] == [a, b]
            assert "waiting for 2 job(s)" in seen["nextStep"]
            part_seen = (await client.get(f"/v1/jobs/{a}/explain", headers=bearer(admin))).json()
            assert part_seen["dependants"] == {
                "total": 1,
                "jobs": [{"jobId": total_id, "state": "waiting"}],
            }
            own = (await client.get(f"/v1/jobs/{total_id}/explain", headers=bearer(token))).json()
            assert own["after"]["total"] == 2 and "dependants" not in own
            assert "waiting for 2" in own["nextStep"]


async def test_the_same_request_again_is_the_same_job_after_its_dependency_is_pruned(
    make_pipeline: Any,
) -> None:
    """Found in review: the repeat read its dependencies before looking for itself, so once
    one was pruned (retention, after the job ended) the same request was refused."""
    async with make_pipeline() as p:
        now = p.rt.clock()
        a = (await p.store.submit(part.new_job(Part(i=1)), now))[0]
        first = total.new_job(Total(), job_id="fan-in-again", after=[a])
        assert await p.store.submit(first, now) == ("fan-in-again", True)
        async with p.rt.store.writing() as conn:
            await conn.execute(job_events.delete().where(job_events.c.job_id == a))
            await conn.execute(outbox.delete().where(outbox.c.job_id == a))
            await conn.execute(jobs.delete().where(jobs.c.id == a))
        assert await p.store.submit(first, now) == ("fan-in-again", False)


async def test_a_follow_up_after_jobs_that_do_not_exist_fails_only_its_own_job(
    make_pipeline: Any,
) -> None:
    """Found in review: the follow-up's refusal raised out of the whole completion batch, so
    every job of the batch stayed running, and the offending one was retried for ever. Now
    only its own outcome is refused (and the worker quarantines it with why), and a bad
    ``after=`` is refused at ``ctx.follow_up`` already."""
    async with make_pipeline() as p:
        p.rt = dataclasses.replace(p.rt, app=app)
        now = p.rt.clock()
        bad = (await p.store.submit(start.new_job(Start(after=["no-such-job"])), now))[0]
        good = (await p.store.submit(part.new_job(Part(i=2)), now))[0]
        p.start_relay()
        await p.start_worker()
        failed = await p.wait_for(bad, lambda j: j.state.is_terminal)
        assert failed.state is JobState.QUARANTINED and failed.attempt == 1
        assert "no-such-job" in (failed.quarantine_reason or ""), failed.quarantine_reason
        done = await p.wait_for(good, lambda j: j.state.is_terminal)
        assert done.state is JobState.SUCCEEDED
    with pytest.raises(jobrelay.InvalidDependencies, match="not a single string"):
        context_of(app).follow_up(total, Total(), after="0193-one-id")  # type: ignore[arg-type]


def context_of(application: jobrelay.App) -> jobrelay.JobContext[Total]:
    """A job's context as a body sees it, for what ``follow_up`` refuses before any write."""
    from jobrelay.library.context import JobContext

    return JobContext(
        job_id="j",
        job_type="lab.total",
        attempt=1,
        params=Total(),
        account=None,
        results=None,  # type: ignore[arg-type]
        engine=None,  # type: ignore[arg-type]
        lease_lost=None,  # type: ignore[arg-type]
        report_progress=None,  # type: ignore[arg-type]
        make_follow_up=lambda job, params: total.new_job(params),
    )


TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


async def test_a_released_job_carries_its_requests_trace_and_an_operators_cancel_cascades(
    make_pipeline: Any,
) -> None:
    """Found in review: a waiting job's message was written without the request's trace.
    And an operator's cancel of a waiting job ends it like any end: the job after it is
    cancelled (default) or, with ``after_failure="run"``, queued."""
    from jobrelay.storage.admin import AdminQueries

    async with make_pipeline() as p:
        p.rt = dataclasses.replace(p.rt, app=app)
        now = p.rt.clock()
        a = (await p.store.submit(part.new_job(Part(i=3)), now))[0]
        traced = total.new_job(Total(), after=[a], headers={"traceparent": TRACEPARENT})
        t = (await p.store.submit(traced, now))[0]
        p.start_relay()
        await p.start_worker()
        done = await p.wait_for(t, lambda j: j.state.is_terminal)
        assert done.state is JobState.SUCCEEDED
        assert await AdminQueries(p.rt.store).trace_id(t) == TRACEPARENT.split("-")[1]

        # Nothing runs until the cancel: else b may end and release w before it (CI, loaded).
        await p.stop_all()
        b = (await p.store.submit(part.new_job(Part(i=4)), now))[0]
        w = (await p.store.submit(total.new_job(Total(), after=[b, a]), now))[0]  # waits on b
        x = (await p.store.submit(total.new_job(Total(), after=[w]), now))[0]
        y = (await p.store.submit(total.new_job(Total(), after=[w], after_failure="run"), now))[0]
        outcome = await AdminQueries(p.rt.store).cancel(
            w, actor="test", reason="no longer needed", now=now
        )
        assert outcome.done, outcome
        p.start_relay()
        await p.start_worker()
        cancelled = await p.wait_for(x, lambda j: j.state is not JobState.WAITING)
        assert cancelled.state is JobState.CANCELLED and w in (cancelled.cancel_reason or "")
        ran = await p.wait_for(y, lambda j: j.state.is_terminal)
        assert ran.state is JobState.SUCCEEDED


async def test_job_show_says_waiting_for_how_many_of_how_many(make_pipeline: Any) -> None:
    async with make_pipeline() as p:
        now = p.rt.clock()
        a = (await p.store.submit(part.new_job(Part(i=1)), now))[0]
        b = (await p.store.submit(part.new_job(Part(i=2)), now))[0]
        t = (await p.store.submit(total.new_job(Total(), after=[a, b]), now))[0]
        with console.capture() as text:
            assert await show_job(p.rt.settings, t)
        shown = " ".join(text.get().split())
        assert f"runs after waiting for 2 of 2: {a} (queued), {b} (queued)" in shown, shown
        assert "next: waiting for 2 job(s) it runs after" in shown
        with console.capture() as text:
            assert await show_job(p.rt.settings, a)
        assert f"waited for by 1 job: {t} (waiting)" in " ".join(text.get().split())
        buffer = io.StringIO()
        with contextlib.redirect_stdout(buffer):
            assert await show_job(p.rt.settings, t, as_json=True)
        shown_json = json.loads(buffer.getvalue())
        assert shown_json["after"]["waitingFor"] == 2 and shown_json["dependants"] is None
