"""Limits per key, applied where jobrelay can apply them: before the broker (issue 36).

On both databases: the relay's admission (``Store.admit_waiting``) hands a key no more jobs
than its limit, takes keys in turns, spends a rate limit's tokens and honours an operator's
override; the outbox claim sends only admitted jobs; the transaction that ends a run gives
its slot back, exactly once (a success, a retry, the reconciler's takeover); a retry waits
in the outbox (not in a delay queue holding its slot); a copy of a job met while it waits
for admission is acked unrun.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections import Counter
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from pydantic import BaseModel
from sqlalchemy import func, insert, select

import jobrelay
from jobrelay.domain.policy import Action, decide, observe_delivery
from jobrelay.relay.publisher import ADMIT_AHEAD, Relay
from jobrelay.storage.admin import AdminQueries
from jobrelay.storage.admission import AdmissionStore
from jobrelay.storage.engine import create_engine
from jobrelay.storage.notify import OutboxListener
from jobrelay.storage.records import Claim, CompleteRequest, NewJob
from jobrelay.storage.repairs import RepairQueries
from jobrelay.storage.store import Store
from jobrelay.storage.tables import job_slots, jobs, limit_overrides, outbox

T0 = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
LEASE = timedelta(seconds=30)


class Export(BaseModel):
    account: str
    n: int = 0


app = jobrelay.App()


@app.job(
    "lab.export",
    params=Export,
    max_attempts=3,
    limits=[jobrelay.ConcurrencyLimit(2, key=lambda p: p.account)],
)
async def export(ctx: jobrelay.JobContext[Export], p: Export) -> None:
    return None


@app.job(
    "lab.mail",
    params=Export,
    limits=[jobrelay.RateLimit("2/second", burst=2, name="smtp")],
)
async def mail(ctx: jobrelay.JobContext[Export], p: Export) -> None:
    return None


@app.job("lab.free", params=Export)
async def free(ctx: jobrelay.JobContext[Export], p: Export) -> None:
    return None


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> datetime:
        return self.now


@pytest.fixture
async def store(database_url: str) -> AsyncIterator[tuple[Store, Clock]]:
    engine = create_engine(database_url)
    clock = Clock()
    yield Store(engine, clock=clock), clock
    await engine.dispose()


async def submit(store: Store, job: jobrelay.JobDefinition[Export], account: str, n: int) -> str:
    new: NewJob = job.new_job(Export(account=account, n=n), account=account)
    job_id, _ = await store.submit(new, T0)
    return job_id


async def slots(store: Store, key: str) -> int:
    async with store.reading() as conn:
        return int(
            await conn.scalar(
                select(func.count()).where(job_slots.c.limit_id == f"lab.export\x1f{key}")
            )
            or 0
        )


async def sent(store: Store) -> list[str]:
    """What a relay claims and (confirmed) marks published now."""
    rows = await store.claim_outbox("relay-1", 100, timedelta(seconds=30))
    await store.mark_published("relay-1", rows)
    return [row.job_id for row in rows]


async def test_a_key_is_admitted_no_more_jobs_than_its_limit(
    store: tuple[Store, Clock],
) -> None:
    """Old code: no limits at all (``limits=`` was refused by ``@app.job``); every job went
    to the broker at once."""
    s, _ = store
    acme = [await submit(s, export, "acme", i) for i in range(5)]
    globex = await submit(s, export, "globex", 0)
    unlimited = await submit(s, free, "acme", 0)
    answer = await s.admit_waiting(100)
    assert (answer.admitted, answer.held) == (3, 3)
    assert sorted(await sent(s)) == sorted([acme[0], acme[1], globex, unlimited])
    assert await slots(s, "acme") == 2
    held = [e for e in await s.events(acme[2]) if e.kind == "throttled"]
    assert len(held) == 1 and "acme has 2 of 2 running" in held[0].detail["reason"]
    # Held once: the next round writes no second ``throttled`` event.
    await s.admit_waiting(100)
    assert [e.kind for e in await s.events(acme[2])].count("throttled") == 1
    job = await s.get_job(acme[2])
    assert job is not None and job.awaiting_admission


async def test_a_success_gives_its_slot_back_and_the_next_job_is_admitted(
    store: tuple[Store, Clock],
) -> None:
    s, _ = store
    acme = [await submit(s, export, "acme", i) for i in range(3)]
    await s.admit_waiting(100)
    assert set(await sent(s)) == {acme[0], acme[1]}
    claim = await s.claim_job(acme[0], "w1", T0, LEASE)
    assert claim is not None
    assert (await s.complete(claim, None, {}, T0)).won
    assert await slots(s, "acme") == 1
    assert (await s.admit_waiting(100)).admitted == 1
    assert await sent(s) == [acme[2]]
    kinds = [e.kind for e in await s.events(acme[2])]
    assert kinds == ["accepted", "throttled", "admitted", "published"]


async def retried(s: Store) -> str:
    """A job admitted, sent, claimed and failed: its retry waits in the outbox for 60 s."""
    job_id = await submit(s, export, "acme", 0)
    await s.admit_waiting(100)
    assert await sent(s) == [job_id]
    claim = await s.claim_job(job_id, "w1", T0, LEASE)
    assert claim is not None
    assert (await s.schedule_retry(claim, "lab.export", "boom", 60, T0)).won
    return job_id


async def test_a_retry_gives_its_slot_back_and_waits_in_the_outbox_until_due(
    store: tuple[Store, Clock],
) -> None:
    s, clock = store
    job_id = await retried(s)
    assert await slots(s, "acme") == 0
    async with s.reading() as conn:
        waiting = (
            await conn.execute(
                select(outbox.c.destination, outbox.c.available_at).where(
                    outbox.c.job_id == job_id, outbox.c.published_at.is_(None)
                )
            )
        ).one()
    assert "delay" not in waiting.destination and waiting.available_at is not None
    assert (await s.admit_waiting(100)).admitted == 0  # not due: not even a candidate
    clock.now = T0 + timedelta(seconds=61)
    assert (await s.admit_waiting(100)).admitted == 1
    assert await sent(s) == [job_id]


class TickingClock(Clock):
    """Each reading a millisecond after the last, as a real clock read twice is."""

    def __call__(self) -> datetime:
        self.now += timedelta(milliseconds=1)
        return self.now - timedelta(milliseconds=1)


async def test_an_admitted_row_is_never_sent_stamped_before_it_fell_due(database_url: str) -> None:
    """Old code (CI, once in 2,147 tests): the admission read the clock for the row's
    ``taken_at`` and read it again for "is it due": a row due between the two readings was
    admitted and its ``published`` event stamped before its run time."""
    clock = TickingClock()
    s = Store(create_engine(database_url), clock=clock)
    try:
        job_id = await retried(s)
        async with s.reading() as conn:
            due = await conn.scalar(
                select(outbox.c.available_at).where(
                    outbox.c.job_id == job_id, outbox.c.published_at.is_(None)
                )
            )
        assert due is not None
        clock.now = due - timedelta(microseconds=500)  # the second reading is past it
        rows: list[Any] = []
        while not rows:
            rows = list((await s.admit_waiting(100, claim_for=("relay-1", LEASE))).rows)
        await s.mark_published("relay-1", rows)
        published = [e.at for e in await s.events(job_id) if e.kind == "published"]
        assert len(published) == 2 and published[-1] >= due
    finally:
        await s.engine.dispose()


async def test_the_reconcilers_takeover_gives_the_slot_back_once(
    store: tuple[Store, Clock],
) -> None:
    s, clock = store
    job_id = await submit(s, export, "acme", 0)
    await s.admit_waiting(100)
    claim = await s.claim_job(job_id, "w1", T0, LEASE)
    assert claim is not None and await slots(s, "acme") == 1
    clock.now = T0 + LEASE * 2
    repairs = RepairQueries(s)
    assert await repairs.requeue_expired_lease(job_id, "w1", clock.now, clock.now, "reconciler")
    assert await slots(s, "acme") == 0
    assert not await repairs.requeue_expired_lease(job_id, "w1", clock.now, clock.now, "r")
    assert await slots(s, "acme") == 0
    # A late outcome of the lost attempt is fenced out and releases nothing more.
    assert not (await s.complete(Claim(job_id, 1, "w1"), None, {}, clock.now)).won
    assert await slots(s, "acme") == 0


async def test_a_copy_met_while_its_job_waits_for_admission_is_acked_unrun(
    store: tuple[Store, Clock],
) -> None:
    s, _ = store
    first = await submit(s, export, "acme", 0)
    second = await submit(s, export, "acme", 1)
    third = await submit(s, export, "acme", 2)
    await s.admit_waiting(100)
    assert await s.claim_delivered(third, "lab.export", "w1", T0, LEASE) is None
    job = await s.get_job(third)
    assert job is not None
    decision = decide(observe_delivery(job.view(), T0))
    assert decision.action is Action.ACK and decision.reason == "waiting for its limits"
    assert await s.claim_delivered(first, "lab.export", "w1", T0, LEASE) is not None
    assert second  # admitted beside the first


async def test_keys_take_turns_so_a_backlog_does_not_delay_another_keys_job(
    store: tuple[Store, Clock],
) -> None:
    s, _ = store
    await s.engine.dispose()
    backlog = [await submit(s, export, "big", i) for i in range(6)]
    late = await submit(s, export, "small", 0)
    answer = await s.admit_waiting(2)
    assert answer.admitted == 2
    assert set(await sent(s)) == {backlog[0], late}


async def test_a_rate_limit_admits_its_burst_then_its_rate(store: tuple[Store, Clock]) -> None:
    s, clock = store
    mails = [await submit(s, mail, f"acct-{i}", i) for i in range(6)]
    assert (await s.admit_waiting(100)).admitted == 2
    clock.now = T0 + timedelta(seconds=1)
    assert (await s.admit_waiting(100)).admitted == 2
    assert (await s.admit_waiting(100)).admitted == 0
    assert len(await sent(s)) == 4
    assert mails


async def test_an_operators_override_raises_a_limit_at_once(store: tuple[Store, Clock]) -> None:
    s, _ = store
    [await submit(s, export, "acme", i) for i in range(5)]
    assert (await s.admit_waiting(100)).admitted == 2
    async with s.writing() as conn:
        await conn.execute(
            insert(limit_overrides).values(
                limit_id="lab.export", max=4, changed_at=T0, changed_by="ops", reason="sale"
            )
        )
    assert (await s.admit_waiting(100)).admitted == 2
    assert await slots(s, "acme") == 4


running: Counter[str] = Counter()
peak: Counter[str] = Counter()


@app.job(
    "lab.slow",
    params=Export,
    limits=[jobrelay.ConcurrencyLimit(2, key=lambda p: p.account)],
)
async def slow(ctx: jobrelay.JobContext[Export], p: Export) -> None:
    running[p.account] += 1
    peak[p.account] = max(peak[p.account], running[p.account])
    try:
        await asyncio.sleep(0.05)  # the work: long enough for the others to pile up
    finally:
        running[p.account] -= 1


async def test_running_jobs_per_key_never_exceed_the_limit_end_to_end(make_pipeline: Any) -> None:
    """Through the relay, the broker (RabbitMQ, or the local transport) and two workers of 8
    slots each: 8 jobs of one account and 2 of another, ``ConcurrencyLimit(2)`` per account.
    Each job counts the jobs of its account running beside it. Old code: no limit, all 8
    ran at once (peak 8)."""
    running.clear()
    peak.clear()
    async with make_pipeline(prefetch=8) as p:
        p.rt = dataclasses.replace(p.rt, app=app)
        now = p.rt.clock()
        ids = [
            (await p.store.submit(slow.new_job(Export(account=a, n=i), account=a), now))[0]
            for a, n in (("acme", 8), ("globex", 2))
            for i in range(n)
        ]
        p.start_relay()
        await p.start_worker()
        await p.start_worker()
        jobs = [await p.wait_for(job_id, lambda j: j.state.is_terminal) for job_id in ids]
        assert {j.state for j in jobs} == {jobrelay.JobState.SUCCEEDED}
        assert peak["acme"] == 2 and peak["globex"] <= 2
        async with p.store.reading() as conn:
            assert await conn.scalar(select(func.count()).select_from(job_slots)) == 0
        for job in jobs:
            kinds = await p.kinds(job.id)
            assert kinds.count("admitted") == 1 and kinds.count("claimed") == 1


@app.job(
    "lab.crashy",
    params=Export,
    limits=[jobrelay.ConcurrencyLimit(2, key=lambda p: p.account)],
)
async def crashy(ctx: jobrelay.JobContext[Export], p: Export) -> None:
    running[p.account] += 1
    peak[p.account] = max(peak[p.account], running[p.account])
    try:
        await ctx.fault_point("export.run")  # armed: the worker dies here, once
        await asyncio.sleep(0.02)
    finally:
        running[p.account] -= 1


async def test_a_worker_killed_mid_run_leaks_no_slot_and_never_overfills_a_key(
    make_pipeline: Any,
) -> None:
    """Issue 36 property 1, in process: the worker dies inside a run (its runs and acks cut
    off, leases held); the fresh worker takes the expired leases over with the slots the
    dead claims held, never more than 2 running per key (sampled from the database the whole
    time), and every slot is given back once all have succeeded. Old code: no limits."""
    running.clear()
    peak.clear()
    async with make_pipeline(faults="export.run:crash:1@n=2", prefetch=8, lease_seconds="3") as p:
        p.rt = dataclasses.replace(p.rt, app=app)
        now = p.rt.clock()
        ids = [
            (
                await p.store.submit(
                    crashy.new_job(Export(account="acme", n=i), account="acme"), now
                )
            )[0]
            for i in range(6)
        ]
        most = 0
        sampling = True

        async def sample() -> None:
            nonlocal most
            while sampling:
                async with p.store.reading() as conn:
                    held = await conn.scalar(select(func.count()).select_from(job_slots))
                    live = await conn.scalar(
                        select(func.count()).where(jobs.c.id.in_(ids), jobs.c.state == "running")
                    )
                most = max(most, int(held or 0), int(live or 0))
                await asyncio.sleep(0.02)

        sampler = asyncio.create_task(sample())
        p.start_relay()
        await p.start_worker()
        await p.kill_crashed_worker(timeout=30)
        await p.start_worker()
        jobs_ = [await p.wait_for(job_id, lambda j: j.state.is_terminal, 60) for job_id in ids]
        sampling = False
        await sampler
        assert {j.state for j in jobs_} == {jobrelay.JobState.SUCCEEDED}
        assert most <= 2 and peak["acme"] <= 2
        async with p.store.reading() as conn:
            assert await conn.scalar(select(func.count()).select_from(job_slots)) == 0
        assert sum(j.attempt for j in jobs_) > len(jobs_)  # a run was cut off and taken over


@app.job("lab.ping", params=Export, limits=[jobrelay.RateLimit("4/second", burst=2, name="pings")])
async def ping(ctx: jobrelay.JobContext[Export], p: Export) -> None:
    return None


async def test_no_window_holds_more_starts_than_the_rate_plus_the_burst(make_pipeline: Any) -> None:
    """Issue 36 property 2: two relays and two workers; 12 jobs under ``RateLimit("4/second",
    burst=2)``. Every second-long window of their ``claimed`` times holds at most 4 + 2
    starts (the times are the store's, from the events), and they took at least (12 - 2) / 4
    seconds in all. Old code: no limits (all 12 started at once)."""
    async with make_pipeline(prefetch=8) as p:
        p.rt = dataclasses.replace(p.rt, app=app)
        now = p.rt.clock()
        ids = [
            (await p.store.submit(ping.new_job(Export(account=f"a{i}", n=i)), now))[0]
            for i in range(12)
        ]
        p.start_relay()
        p.start_relay()
        await p.start_worker()
        await p.start_worker()
        for job_id in ids:
            await p.wait_for(job_id, lambda j: j.state is jobrelay.JobState.SUCCEEDED, 60)
        starts: list[datetime] = []
        for job_id in ids:
            starts += [e.at for e in await p.store.events(job_id) if e.kind == "admitted"]
        starts.sort()
        assert len(starts) == 12
        for i, first in enumerate(starts):
            in_window = [t for t in starts[i:] if t < first + timedelta(seconds=1)]
            assert len(in_window) <= 4 + 2, (first, in_window)
        assert starts[-1] - starts[0] >= timedelta(seconds=(12 - 2 - 4) / 4)


@app.job("lab.fair", params=Export, fair_by=lambda p: p.account)
async def fair(ctx: jobrelay.JobContext[Export], p: Export) -> None:
    return None


async def test_fair_by_key_lets_a_late_key_in_ahead_of_an_earlier_backlog(
    store: tuple[Store, Clock],
) -> None:
    """Issue 36 property 3: key A's backlog of 40 came first, key B's 3 jobs after it. With
    4 admitted ahead of their end, B's jobs are handed to the broker in A's turns: each
    round alternates the keys, so B waits at most one round behind A, not 40 jobs. Old
    code: no ``fair_by`` (the broker got A's 40 first, in arrival order)."""
    s, _ = store
    backlog = [await submit(s, fair, "a", i) for i in range(40)]
    late = [await submit(s, fair, "b", i) for i in range(3)]
    assert (await s.admit_waiting(100, fair_ahead=4)).admitted == 4
    first = await sent(s)
    assert sorted(first) == sorted([backlog[0], backlog[1], late[0], late[1]])
    for job_id in first[:2]:
        claim = await s.claim_job(job_id, "w1", T0, LEASE)
        assert claim is not None and (await s.complete(claim, None, {}, T0)).won
    assert (await s.admit_waiting(100, fair_ahead=4)).admitted == 2
    assert late[2] in await sent(s)


async def test_a_backlog_longer_than_a_round_does_not_hide_another_keys_job(
    store: tuple[Store, Clock],
) -> None:
    """A round reads the oldest waiting jobs of every key: 12 of acme waited before globex's
    one, and a round of 2 admits one of each. (Before: the round read the oldest 4 x 2 rows,
    all acme's, and globex's job was not even looked at until acme's backlog shrank.)"""
    s, _ = store
    acme = [await submit(s, export, "acme", i) for i in range(12)]
    globex = await submit(s, export, "globex", 0)
    assert (await s.admit_waiting(2)).admitted == 2
    assert sorted(await sent(s)) == sorted([acme[0], globex])


async def test_a_limit_lowered_at_runtime_admits_nothing_new_until_below_it(
    store: tuple[Store, Clock],
) -> None:
    """Issue 36 property 4: an override lowering the limit holds from the next round (the
    jobs already admitted keep their slots, none is cut off); raised back, the backlog
    drains."""
    s, _ = store
    ids = [await submit(s, export, "acme", i) for i in range(6)]
    assert (await s.admit_waiting(100)).admitted == 2
    async with s.writing() as conn:
        await conn.execute(
            insert(limit_overrides).values(
                limit_id="lab.export\x1facme", max=1, changed_at=T0, changed_by="ops", reason="x"
            )
        )
    first = await s.claim_job(ids[0], "w1", T0, LEASE)
    assert first is not None and (await s.complete(first, None, {}, T0)).won
    assert (await s.admit_waiting(100)).admitted == 0  # 1 held of the lowered 1
    second = await s.claim_job(ids[1], "w1", T0, LEASE)
    assert second is not None and (await s.complete(second, None, {}, T0)).won
    assert (await s.admit_waiting(100)).admitted == 1  # below it: one more
    async with s.writing() as conn:
        await conn.execute(
            limit_overrides.update()
            .where(limit_overrides.c.limit_id == "lab.export\x1facme")
            .values(max=10)
        )
    assert (await s.admit_waiting(100)).admitted == 3


async def test_a_job_held_for_its_limits_is_not_reported_as_a_stuck_outbox_row(
    store: tuple[Store, Clock],
) -> None:
    """The reconciler reports unpublished rows past the grace as stuck ("is a relay
    running?"); a row held for its job's limits is waiting its turn. Before: reported."""
    s, _ = store
    ids = [await submit(s, export, "acme", i) for i in range(3)]
    await s.admit_waiting(100)
    await sent(s)
    stale = await RepairQueries(s).stale_outbox(T0 + timedelta(hours=1), 10)
    assert [row.job_id for row in stale] == []
    assert ids


async def test_a_retry_held_again_gets_a_throttled_event_of_its_own(
    store: tuple[Store, Clock],
) -> None:
    """A ``throttled`` event per wait: a job held, admitted, retried and held again says so
    twice. (Before: ``throttled_at`` outlived the admission, and the second wait wrote none.)"""
    s, clock = store
    ids = [await submit(s, export, "acme", i) for i in range(4)]
    await s.admit_waiting(100)  # 0 and 1 admitted; 2 and 3 held
    await sent(s)
    first = await s.claim_job(ids[0], "w1", T0, LEASE)
    assert first is not None and (await s.complete(first, None, {}, T0)).won
    await s.admit_waiting(100)  # 2 admitted
    assert await sent(s) == [ids[2]]
    claim = await s.claim_job(ids[2], "w1", T0, LEASE)
    assert claim is not None
    assert (await s.schedule_retry(claim, "lab.export", "boom", 1, T0)).won
    clock.now = T0 + timedelta(seconds=2)
    await s.admit_waiting(100)  # 3 (waiting longer) takes the slot; 2's retry is held
    assert await sent(s) == [ids[3]]
    assert [e.kind for e in await s.events(ids[2])].count("throttled") == 2


async def test_a_completion_that_frees_a_slot_wakes_the_relays_while_a_job_is_held(
    store: tuple[Store, Clock], database_url: str
) -> None:
    """A freed slot is used at once, not at the relays' next poll: while a job is held back
    by its limits, the completion that gives slots back wakes the relays of this process
    and, on PostgreSQL, every listening relay (its ``NOTIFY`` rides in the completion's own
    statement). A completion of a job without limits, or one while no limit binds, wakes
    nobody (a wake-up would cost a relay a round for nothing). Old code: no wake-up at all
    (the key's next job waited for the poll, one freed slot per
    ``JOBRELAY_RELAY_POLL_SECONDS``)."""
    s, _ = store
    acme = [await submit(s, export, "acme", i) for i in range(3)]
    plain = await submit(s, free, "acme", 0)
    await s.admit_waiting(100)
    assert set(await sent(s)) == {acme[0], acme[1], plain}  # acme[2] is held
    here = asyncio.Event()
    s.outbox_listeners.append(here)
    elsewhere = asyncio.Event()
    other = create_engine(database_url)

    async def complete(job_id: str) -> None:
        claim = await s.claim_job(job_id, "w1", T0, LEASE)
        assert claim is not None
        assert await s.complete_many([CompleteRequest(claim, None, {})], T0) == {job_id}

    try:
        async with OutboxListener(other, elsewhere) as listener:
            if listener.enabled:  # it says so once it listens: what it may have missed
                await asyncio.wait_for(elsewhere.wait(), 10)
                elsewhere.clear()
            await complete(plain)
            assert not here.is_set()
            await complete(acme[0])
            assert here.is_set()
            if listener.enabled:
                await asyncio.wait_for(elsewhere.wait(), 10)
            assert (await s.admit_waiting(100)).admitted == 1  # acme[2]: nothing is held now
            here.clear()  # (the admission woke the relays itself, to send acme[2])
            await complete(acme[1])
            assert not here.is_set()
    finally:
        await other.dispose()


async def test_the_shipped_export_is_fair_by_account(store: tuple[Store, Clock]) -> None:
    """One account's burst of exports does not queue ahead of another account's first: the
    shipped ``report.export`` is fair by account, so the relay hands the broker the accounts'
    exports in turns (``fair_ahead`` ahead of the workers). Old code: no fairness; the
    relay's first batch was the burst's oldest rows."""
    from jobrelay.exports.report_export import ExportParams
    from jobrelay.exports.shipped import report_export

    s, _ = store

    async def export_of(account: str, month: int) -> str:
        params = ExportParams.model_validate({"accountId": account, "period": f"2024-{month:02d}"})
        job_id, _ = await s.submit(report_export.new_job(params, account=account), T0)
        return job_id

    burst = [await export_of("acme", 1 + i % 12) for i in range(24)]
    first = await export_of("globex", 1)
    await s.admit_waiting(4, fair_ahead=4)
    rows = await s.claim_outbox("relay-1", 4, timedelta(seconds=30))
    assert first in [row.job_id for row in rows]
    assert len(rows) == 4 and set(burst) & {row.job_id for row in rows}


@app.job(
    "lab.roomy",
    params=Export,
    limits=[jobrelay.ConcurrencyLimit(64, key=lambda p: p.account)],
)
async def roomy(ctx: jobrelay.JobContext[Export], p: Export) -> None:
    return None


async def test_one_admission_round_admits_and_claims_several_claims_worth(
    make_pipeline: Any,
) -> None:
    """A round admits up to ``ADMIT_AHEAD`` claims' worth and claims the admitted rows for its
    relay in the same write; nothing admitted waits for a claim of its own. Old code: a round
    before every claim, each paying its ranking of every waiting row, its lock and its commit,
    and each admitted row written twice (admitted, then claimed): the non-binding bench cell
    at 0.64 of no limits."""
    async with make_pipeline(relay_batch="5") as p:
        rt = dataclasses.replace(p.rt, app=app)
        ids = [
            (await p.store.submit(roomy.new_job(Export(account=f"k{i % 3}", n=i)), T0))[0]
            for i in range(2 * ADMIT_AHEAD * 5 + 3)
        ]
        rounds = 0
        admit = rt.store.admit_waiting

        async def counted(*args: Any, **kwargs: Any) -> Any:
            nonlocal rounds
            rounds += 1
            return await admit(*args, **kwargs)

        relay = Relay(rt)
        relay.rt.store.admit_waiting = counted  # type: ignore[method-assign]
        claimed = [await relay.relay_once() for _ in range(4)]
        assert claimed == [ADMIT_AHEAD * 5, ADMIT_AHEAD * 5, 3, 0]
        assert rounds == 3  # the last relay_once: nothing waits for admission, no round
        async with p.store.reading() as conn:
            published = await conn.execute(
                select(outbox.c.job_id, outbox.c.publish_attempts).where(
                    outbox.c.published_at.is_not(None)
                )
            )
            attempts = {r.job_id: r.publish_attempts for r in published}
        assert attempts == {job_id: 1 for job_id in ids}  # each sent once, claimed once


async def test_a_job_cancelled_during_an_admission_round_takes_no_slot(
    store: tuple[Store, Clock], monkeypatch: pytest.MonkeyPatch
) -> None:
    """PostgreSQL (SQLite's round holds the one write lock: no cancel commits inside it).
    The round has read the job as waiting; an operator's cancel commits before the round
    writes. Old code: the round still set ``admitted_at`` and took the job's slot, which no
    later transition gives back (the cancel had already run its release): the key's limit
    was one lower for good."""
    s, _ = store
    if s.engine.dialect.name != "postgresql":
        pytest.skip("SQLite's admission round holds the write lock: a cancel waits for it")
    job_id = await submit(s, export, "acme", 0)
    write = AdmissionStore._write

    async def cancelled_first(self: AdmissionStore, *args: Any, **kwargs: Any) -> Any:
        outcome = await AdminQueries(s).cancel(job_id, actor="ops", reason="t", now=T0)
        assert outcome.done
        return await write(self, *args, **kwargs)

    monkeypatch.setattr(AdmissionStore, "_write", cancelled_first)
    answer = await s.admit_waiting(10, claim_for=("relay-1", LEASE))
    assert answer.admitted == 0 and answer.rows == ()
    assert await slots(s, "acme") == 0
    job = await s.get_job(job_id)
    assert job is not None and job.state is jobrelay.JobState.CANCELLED
    assert job.admitted_at is None
