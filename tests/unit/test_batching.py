"""The batcher under the worker's claims and completions: what shares a statement."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from jobrelay.batching import Batcher


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


async def test_a_batch_refused_for_one_request_is_sent_again_one_by_one() -> None:
    calls: list[list[str]] = []

    async def picky(requests: Sequence[str]) -> list[str]:
        calls.append(list(requests))
        if "bad" in requests:
            raise Refused("bad row")
        return [f"done:{r}" for r in requests]

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
