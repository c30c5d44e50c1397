"""The batcher under the worker's claims and completions: what shares a statement."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence

import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from jobrelay.batching import Batcher, Gate
from jobrelay.observe import logs, tracing


class Recorder:
    def __init__(self) -> None:
        self.batches: list[list[str]] = []
        self.release = asyncio.Event()
        self.release.set()
        self.started = asyncio.Event()

    async def run(self, requests: Sequence[str]) -> list[str]:
        self.batches.append(list(requests))
        self.started.set()
        await self.release.wait()
        return [f"done:{r}" for r in requests]


async def test_requests_made_while_a_batch_runs_leave_together_in_the_next() -> None:
    recorder = Recorder()
    batcher: Batcher[str, str] = Batcher(recorder.run, key=lambda r: r)
    recorder.release.clear()
    first = asyncio.create_task(batcher.submit("a"))
    await recorder.started.wait()  # the first batch is in flight, holding "a" alone
    later = [asyncio.create_task(batcher.submit(r)) for r in ("b", "c", "d")]
    await asyncio.sleep(0)  # a yield, not a wait: the three submit and queue up
    recorder.release.set()
    assert await first == "done:a"
    assert [await t for t in later] == ["done:b", "done:c", "done:d"]
    assert recorder.batches == [["a"], ["b", "c", "d"]]


async def test_two_requests_for_one_key_never_share_a_batch() -> None:
    recorder = Recorder()
    batcher: Batcher[str, str] = Batcher(recorder.run, key=lambda r: r.split("#")[0])
    answers = await asyncio.gather(*(batcher.submit(r) for r in ("j1#1", "j2", "j1#2")))
    assert answers == ["done:j1#1", "done:j2", "done:j1#2"]
    assert recorder.batches == [["j1#1", "j2"], ["j1#2"]]


async def test_a_batch_is_at_most_max_size() -> None:
    recorder = Recorder()
    batcher: Batcher[str, str] = Batcher(recorder.run, key=lambda r: r, max_size=2)
    await asyncio.gather(*(batcher.submit(str(n)) for n in range(5)))
    assert [len(b) for b in recorder.batches] == [2, 2, 1]


async def test_a_turn_holds_up_to_max_size_of_each_kind() -> None:
    """Issue 41 item 1: a worker's turn holds claims and completions, at most ``max_size``
    of each, and a job's claim and its completion (one key) never share it."""
    recorder = Recorder()
    batcher: Batcher[str, str] = Batcher(
        recorder.run, key=lambda r: r.split(":")[1], max_size=2, kind=lambda r: r[0]
    )
    asked = ["c:1", "c:2", "c:3", "d:4", "d:5", "c:4"]
    assert await asyncio.gather(*(batcher.submit(r) for r in asked)) == [f"done:{r}" for r in asked]
    assert recorder.batches == [["c:1", "c:2", "d:4", "d:5"], ["c:3", "c:4"]]


async def test_a_request_made_while_a_mixed_batch_runs_is_sent_by_its_kinds_lane() -> None:
    """Review of stop 54: the claims' lane took a batch that ended with a completion and then
    looked for the wrong kind, so a claim made while that batch ran was never sent (its
    waiter hung) once the completions' lane had found nothing of its own and ended."""
    recorder = Recorder()
    batcher: Batcher[str, str] = Batcher(
        recorder.run, key=lambda r: r.split(":")[1], kind=lambda r: r[0]
    )
    recorder.release.clear()
    first = [asyncio.create_task(batcher.submit(r)) for r in ("c:1", "d:2")]
    await recorder.started.wait()  # the claims' lane holds both; the completions' has ended
    later = asyncio.create_task(batcher.submit("c:3"))
    await asyncio.sleep(0)
    recorder.release.set()
    assert [await t for t in first] == ["done:c:1", "done:d:2"]
    async with asyncio.timeout(5):
        assert await later == "done:c:3"
    assert recorder.batches == [["c:1", "d:2"], ["c:3"]]


async def test_a_held_request_goes_only_beside_its_gates_request() -> None:
    """Issue 41: a claim made in a lent slot goes in the statement of the completion that
    frees it, never alone before it."""
    recorder = Recorder()
    batcher: Batcher[str, str] = Batcher(
        recorder.run, key=lambda r: r.split(":")[1], kind=lambda r: r[0]
    )
    gate = Gate()
    gate.request = lender = "d:1"
    claim = asyncio.create_task(batcher.submit("c:2", after=gate))
    for _ in range(5):
        await asyncio.sleep(0)
    assert recorder.batches == []  # held: its lender is not pending yet
    assert await asyncio.gather(batcher.submit(lender), claim) == ["done:d:1", "done:c:2"]
    assert recorder.batches == [["d:1", "c:2"]]
    assert (batcher.beside, batcher.after) == (1, 0)  # the worker's log says how many


async def test_a_held_request_that_missed_its_gates_statement_waits_for_the_gate() -> None:
    """Its lender already in flight (or answered): the claim may commit only after the
    lender's outcome, so it waits for the gate to open, not for the next statement."""
    recorder = Recorder()
    batcher: Batcher[str, str] = Batcher(
        recorder.run, key=lambda r: r.split(":")[1], kind=lambda r: r[0]
    )
    gate = Gate()
    gate.request = lender = "d:1"
    recorder.release.clear()
    sent = asyncio.create_task(batcher.submit(lender))
    await recorder.started.wait()
    claim = asyncio.create_task(batcher.submit("c:2", after=gate))
    other = asyncio.create_task(batcher.submit("c:3"))
    recorder.release.set()
    assert await sent == "done:d:1"
    assert await other == "done:c:3"
    for _ in range(5):
        await asyncio.sleep(0)
    assert not claim.done() and recorder.batches == [["d:1"], ["c:3"]]
    gate.open()
    async with asyncio.timeout(5):
        assert await claim == "done:c:2"
    assert recorder.batches == [["d:1"], ["c:3"], ["c:2"]]
    assert (batcher.beside, batcher.after) == (0, 1)


async def test_a_statement_waits_a_moment_for_the_claim_on_its_way_into_a_lent_slot() -> None:
    """Issue 41: the completion of a lent slot, with a delivery taken into that slot, waits a
    few loop turns for that delivery's claim, which then shares its statement. Without the
    wait, the claim (made three turns later) went alone after the completion's commit."""
    recorder = Recorder()
    batcher: Batcher[str, str] = Batcher(
        recorder.run, key=lambda r: r.split(":")[1], kind=lambda r: r[0]
    )
    gate = Gate()
    gate.request = lender = "d:1"
    gate.taken = True  # the slot's next delivery is on its way to its claim
    completion = asyncio.create_task(batcher.submit(lender, lends=gate))
    for _ in range(3):
        await asyncio.sleep(0)
    claim = asyncio.create_task(batcher.submit("c:2", after=gate))
    async with asyncio.timeout(5):  # missed, the claim would wait for the gate to open
        assert await asyncio.gather(completion, claim) == ["done:d:1", "done:c:2"]
    assert recorder.batches == [["d:1", "c:2"]]


async def test_a_held_request_whose_lender_was_refused_alone_is_not_sent_after_it() -> None:
    """A batch refused for one request's data goes again one by one; a claim held by a
    completion that then fails alone (nothing committed) waits for its gate again."""
    calls: list[list[str]] = []
    picky = _refusing("d:bad", calls)
    batcher: Batcher[str, str] = Batcher(
        picky,
        key=lambda r: r.split(":")[1],
        kind=lambda r: r[0],
        alone_on=lambda exc: isinstance(exc, Refused),
    )
    gate = Gate()
    gate.request = lender = "d:bad"
    claim = asyncio.create_task(batcher.submit("c:2", after=gate))
    with pytest.raises(Refused):
        await batcher.submit(lender)
    for _ in range(5):
        await asyncio.sleep(0)
    assert not claim.done() and calls == [["d:bad", "c:2"], ["d:bad"]]
    gate.open()
    async with asyncio.timeout(5):
        assert await claim == "done:c:2"
    assert calls[-1] == ["c:2"]


async def test_a_failed_batch_fails_each_of_its_waiters_and_the_next_batch_still_runs() -> None:
    calls: list[list[str]] = []

    async def flaky(requests: Sequence[str]) -> list[str]:
        calls.append(list(requests))
        if len(calls) == 1:
            raise RuntimeError("database went away")
        return list(requests)

    batcher: Batcher[str, str] = Batcher(flaky, key=lambda r: r)
    results = await asyncio.gather(batcher.submit("a"), batcher.submit("b"), return_exceptions=True)
    assert [type(r) for r in results] == [RuntimeError, RuntimeError]
    assert await batcher.submit("c") == "c"


async def test_a_cancelled_waiter_does_not_cancel_the_batch_of_the_others() -> None:
    recorder = Recorder()
    recorder.release.clear()
    batcher: Batcher[str, str] = Batcher(recorder.run, key=lambda r: r)
    leaving = asyncio.create_task(batcher.submit("a"))
    staying = asyncio.create_task(batcher.submit("b"))
    await recorder.started.wait()
    leaving.cancel()
    with pytest.raises(asyncio.CancelledError):
        await leaving
    recorder.release.set()
    assert await staying == "done:b"
    assert recorder.batches == [["a", "b"]]


class Refused(Exception):
    """Stands in for a refusal of one request's data (not an outage)."""


def _refusing(bad: str, calls: list[list[str]]) -> Callable[[Sequence[str]], Awaitable[list[str]]]:
    """A statement that records its requests and is refused whenever ``bad`` is among them."""

    async def picky(requests: Sequence[str]) -> list[str]:
        calls.append(list(requests))
        if bad in requests:
            raise Refused("bad row")
        return [f"done:{r}" for r in requests]

    return picky


async def test_a_batch_refused_for_one_request_is_sent_again_one_by_one() -> None:
    calls: list[list[str]] = []
    picky = _refusing("bad", calls)
    batcher: Batcher[str, str] = Batcher(
        picky, key=lambda r: r, alone_on=lambda exc: isinstance(exc, Refused)
    )
    results = await asyncio.gather(
        batcher.submit("a"), batcher.submit("bad"), batcher.submit("c"), return_exceptions=True
    )
    assert results[0] == "done:a" and results[2] == "done:c"
    assert isinstance(results[1], Refused)
    assert calls == [["a", "bad", "c"], ["a"], ["bad"], ["c"]]


async def test_an_outage_is_not_retried_one_by_one() -> None:
    calls: list[list[str]] = []

    async def down(requests: Sequence[str]) -> list[str]:
        calls.append(list(requests))
        raise RuntimeError("database went away")

    batcher: Batcher[str, str] = Batcher(
        down, key=lambda r: r, alone_on=lambda exc: isinstance(exc, Refused)
    )
    results = await asyncio.gather(batcher.submit("a"), batcher.submit("b"), return_exceptions=True)
    assert [type(r) for r in results] == [RuntimeError, RuntimeError]
    assert calls == [["a", "b"]]


async def test_a_batch_runs_in_no_requests_context() -> None:
    """Its statement serves every request: a line it logs is no one job's (its task used to
    inherit the first request's bound ``jobId``)."""
    seen: list[dict[str, object]] = []

    async def run(requests: Sequence[int]) -> list[int]:
        seen.append(dict(logs.context()))
        return list(requests)

    batcher: Batcher[int, int] = Batcher(run, key=lambda r: r)
    with logs.bound(jobId="first"):
        assert await batcher.submit(1) == 1
    assert seen == [{}]


async def test_each_request_gets_a_span_of_its_batch_statement() -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.use(provider)
    try:

        async def run(requests: Sequence[str]) -> list[str]:
            await asyncio.sleep(0.01)
            return list(requests)

        batcher: Batcher[str, str] = Batcher(run, key=lambda r: r, span="claim")
        tracer = provider.get_tracer("t")

        async def one(job: str) -> str:
            with tracer.start_as_current_span(f"run {job}"):
                return await batcher.submit(job)

        assert await asyncio.gather(one("a"), one("b")) == ["a", "b"]
    finally:
        tracing.use(None)
    spans = {s.name: s for s in exporter.get_finished_spans()}
    claims = [s for s in exporter.get_finished_spans() if s.name == "claim"]
    assert len(claims) == 2
    for claim in claims:
        assert claim.attributes is not None and claim.attributes["jobrelay.batch.size"] == 2
        job = claim.attributes["messaging.message.id"]
        parent = spans[f"run {job}"].context
        assert claim.parent is not None and claim.parent.span_id == parent.span_id
    # One statement, one measured time, shared.
    assert len({(c.start_time, c.end_time) for c in claims}) == 1


async def test_each_kind_of_a_turn_gets_its_own_span_name_and_batch_size() -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.use(provider)
    try:
        recorder = Recorder()
        batcher: Batcher[str, str] = Batcher(
            recorder.run,
            key=lambda r: r,
            kind=lambda r: r[0],
            span=lambda r: "claim" if r[0] == "c" else "commit",
        )
        tracer = provider.get_tracer("t")

        async def one(request: str) -> str:
            with tracer.start_as_current_span(f"run {request}"):
                return await batcher.submit(request)

        await asyncio.gather(one("c1"), one("c2"), one("d3"))
    finally:
        tracing.use(None)
    assert recorder.batches == [["c1", "c2", "d3"]]
    named = {
        (s.name, s.attributes["messaging.message.id"], s.attributes["jobrelay.batch.size"])
        for s in exporter.get_finished_spans()
        if s.attributes is not None and "jobrelay.batch.size" in s.attributes
    }
    assert named == {("claim", "c1", 2), ("claim", "c2", 2), ("commit", "d3", 1)}


async def test_a_span_processor_that_fails_does_not_hold_the_batchs_answers() -> None:
    class Broken(SimpleSpanProcessor):
        def on_end(self, span: ReadableSpan) -> None:
            if span.name == "commit":
                raise RuntimeError("exporter bug")

    provider = TracerProvider()
    provider.add_span_processor(Broken(InMemorySpanExporter()))
    tracing.use(provider)
    try:

        async def run(requests: Sequence[str]) -> list[str]:
            return list(requests)

        batcher: Batcher[str, str] = Batcher(run, key=lambda r: r, span="commit")
        with provider.get_tracer("t").start_as_current_span("run"):
            assert await asyncio.wait_for(batcher.submit("a"), 5) == "a"
    finally:
        tracing.use(None)
