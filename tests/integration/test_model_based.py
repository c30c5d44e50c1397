"""Model-based test: random interleavings of submits, deliveries, duplicates, crashes, time,
operator replays and cancels, dead-lettered messages and reconciler passes.

Hypothesis drives the real store (SQLite), the real worker's ``handle`` with in-test
deliveries, the real operator actions (``Operator.replay``/``cancel``) and the real reconciler
(``Reconciler.run_once``), with a clock it controls and faults at the worker's named points.
After every step it checks the invariants the product promises:

- no accepted job is lost: each one is finished, or has a message still to be delivered, or
  is ``running`` on a dead worker's lease after the broker dead-lettered its message (the
  reconciler's case; the ``drain`` rule checks that the job then really finishes);
- at most one ``result_saved`` per job;
- every state change is an edge of the state machine: pipeline moves (one step may make
  several) never leave a terminal state; a step with an operator action makes exactly that
  action's ``by="operator"`` edge (so only a replay or a cancel takes a job out of
  ``quarantined``); ``succeeded`` and ``cancelled`` never change again, by anyone;
- a cancelled job does no more work: no claim, result, retry, quarantine or replay after it;
- limits per key (issue 36): a job submitted with a key is under a concurrency limit for that
  key (its max drawn per example, 1 to 3) and maybe one shared rate limit; the relay's
  admission (``Store.admit_waiting``) is a rule of its own, and the relay sends only admitted
  jobs. Per key, the slots in ``job_slots`` are exactly the jobs admitted and unfinished (no
  slot leaked, none given back twice or early), never more of them, nor of ``running`` jobs,
  than the limit; no terminal job is still admitted; at rest (every job finished) no slot is
  held; no stretch of the store's time holds more rate-limited admissions than the burst plus
  the rate over it.

The rules check their own step too: an operator action is done exactly when the table has
its edge, and otherwise refused without a write (a replay gives a fresh attempt budget and a
work message); a delivery for a finished job is settled without work; a redelivery after a
lease expired takes the job over; a reconciler pass re-queues exactly the leases expired past
the grace, each with a work message, and moves nothing else. A queued job or a due retry is
claimed by the delivery; a copy that arrives before its retry is due is acked without work.

A delivery may run on a worker whose host clock is 30 s behind or ahead of the store's: the
expectations do not change, because leases and due times are the store's to judge (a retry
due by the store runs on a worker 30 s behind; a live lease is deferred on one 30 s ahead).

``two_copies`` handles two copies of one message under ONE worker id (two handlers: one
handler runs a suspect copy only after its other runs end, ``worker.isolation``), the second
while the first waits inside the operation (a ``Gate``), with the
store's clock moved past the first's lease in between or not. Every claim ends in exactly
one outcome or in ``lease_lost``; the outcome recorded (and the result's attempt) is the
latest claim's; a superseded claim records ``lease_lost`` naming the holder and is acked;
each delivery is settled exactly once.

``test_fixed_run`` plays a few fixed runs of the same machine (replay, cancel from each state
(a running one: requested, then ended once its dead worker's lease expired),
lease take-over, reconciler repair, two copies in one process, skewed worker clocks, a key
under a limit of 1 through crashes, takeovers and the reconciler, a rate limit), so that
every run of the suite reaches those cases even when the random search misses one.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import shutil
import tempfile
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, NoReturn

import pytest
from hypothesis import HealthCheck, currently_in_test_context, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)
from sqlalchemy import select

from jobrelay.domain.ids import request_hash
from jobrelay.domain.limits import CONCURRENCY, RATE, JobLimit, limit_id, split_id
from jobrelay.domain.policy import RETRY_SLACK
from jobrelay.domain.queues import retry_seconds
from jobrelay.domain.states import JobState, can_transition
from jobrelay.exports.seed import seed
from jobrelay.library.loader import default_registry
from jobrelay.library.operations import Operation, OperationContext, OperationResult, Registry
from jobrelay.library.operator import Operator
from jobrelay.maintenance.reconcile import LEASE_EXPIRED, Reconciler
from jobrelay.observe.faults import Faults
from jobrelay.results.files import FileResults
from jobrelay.runtime.wiring import Runtime, topology_for
from jobrelay.settings import Settings
from jobrelay.storage.engine import create_engine, upgrade
from jobrelay.storage.repairs import RECONCILED_LEASE, RECONCILED_QUEUED, RECONCILED_RETRY
from jobrelay.storage.store import WORK_DESTINATION, EventRecord, JobRecord, NewJob, Store
from jobrelay.storage.tables import job_events, job_slots, outbox
from jobrelay.worker.consumer import Worker
from tests.id_keys import request_id

ACCOUNTS = ("acme", "globex", "initech")  # seeded, like every month of 2020
PERIODS = ("2020-01", "2020-02")
FAULTS = (
    None,
    "export.run:crash",
    "worker.before_ack:crash",
    "export.run:transient",  # -> retry_wait, or quarantined on the last attempt
    "export.run:invalid",  # a permanent error: -> quarantined, so replay has work to do
)
# Faults for two copies run side by side in one process: every outcome a run can write (a
# crash would end both copies at once, which ``deliver`` already covers).
COPY_FAULTS = (None, "export.run:transient", "export.run:invalid")
# How far a worker host's clock may be off; the store's clock is the one that judges.
SKEWS = (0, -30, 30)
# Final for everyone, operators included (quarantined is final only for the pipeline).
FINAL = frozenset({JobState.SUCCEEDED, JobState.CANCELLED})
# Events that mean the pipeline, an operator or the reconciler did something with the job.
WORK_EVENTS = frozenset(
    {
        "claimed",
        "result_saved",
        "retry_scheduled",
        "quarantined",
        "replayed",
        RECONCILED_LEASE,
        RECONCILED_QUEUED,
        RECONCILED_RETRY,
    }
)
GRACE_SECONDS = 60
# Limits per key (issue 36): a limited job is a ``report.export`` under a concurrency limit
# per key (its max drawn per example, 1 to 3), and maybe under one rate limit shared by all:
# 1 start per 5 s of the store's clock, a burst of 2.
LIMITED = "report.export"
LIMIT_KEYS = ("k1", "k2")
RATE_ID = "model.rate"
RATE_PER_SECOND, RATE_BURST = 0.2, 2.0


class Crash(BaseException):
    pass


class Clock:
    def __init__(self) -> None:
        self.now = datetime(2026, 1, 1, tzinfo=UTC)

    def __call__(self) -> datetime:
        return self.now


@dataclass(eq=False)  # identity: two copies of one body are two messages
class Message:
    """Published and not yet settled."""

    body: bytes
    due: datetime  # when the broker makes it deliverable (a retry tier holds it back)
    unsettled: int = 0  # deliveries a crash left unsettled (the broker counts them)

    @property
    def job_id(self) -> str:
        return str(json.loads(self.body)["jobId"])


class Delivery:
    """A broker delivery the model settles by hand; an unsettled one is redelivered."""

    def __init__(self, body: bytes, redelivered: bool, count: int) -> None:
        self.body = body
        self.headers: dict[str, object] = {}
        self.redelivered = redelivered
        self.delivery_count = count
        self.settles: list[str] = []  # every ack, reject or release, in order

    @property
    def outcome(self) -> str | None:
        return self.settles[-1] if self.settles else None

    async def ack(self) -> bool:
        self.settles.append("ack")
        return True

    async def reject(self) -> bool:
        self.settles.append("reject")
        return True

    def outcome_committed(self) -> None:
        return None  # no prefetch window of its own to free

    async def release(self) -> None:
        self.settles.append("release")


class Gate:
    """Wraps an operation so each run waits at its start until the rule opens it.

    The run has been claimed by then (its lease taken, its attempt spent), so a rule can let
    another copy of the job be handled while this one is inside the operation, and decide
    which of the two writes its outcome first.
    """

    def __init__(self, inner: Operation) -> None:
        self.inner = inner
        self.type = inner.type
        self.runs: list[asyncio.Event] = []  # one opener per run that reached the gate
        self._arrived = asyncio.Event()

    def registry(self, settings: Settings) -> Registry:
        """The shipped operations, with this one in its place."""
        shipped = default_registry(settings)
        operations: list[Operation] = []
        for job_type in sorted(shipped.types):
            operation = self if job_type == self.type else shipped.get(job_type)
            assert operation is not None
            operations.append(operation)
        return Registry(operations)

    def validate(self, params: Mapping[str, Any]) -> None:
        self.inner.validate(params)

    async def run(self, ctx: OperationContext) -> OperationResult:
        opener = asyncio.Event()
        self.runs.append(opener)
        self._arrived.set()
        await opener.wait()
        return await self.inner.run(ctx)

    async def parked(self, task: asyncio.Task[None]) -> asyncio.Event | None:
        """Call right after starting ``task``: wait until it parks a run here (return that
        run's opener) or ends without one (None)."""
        start = len(self.runs)
        while True:
            self._arrived.clear()
            if len(self.runs) > start:
                return self.runs[start]
            if task.done():
                return None
            arrived = asyncio.ensure_future(self._arrived.wait())
            await asyncio.wait({task, arrived}, return_when=asyncio.FIRST_COMPLETED)
            arrived.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await arrived


class WorkQueue:
    """The one transport call made here (by the reconciler; ``handle()`` makes none): how
    many work messages wait for a consumer, read from the model's messages in flight."""

    def __init__(self, ready: Callable[[], int]) -> None:
        self.ready = ready

    async def work_ready(self) -> int:
        return self.ready()


@pytest.fixture(scope="module", autouse=True)
def template(tmp_path_factory: pytest.TempPathFactory) -> None:
    """One migrated and seeded database; every example starts from a copy of it."""
    path = tmp_path_factory.mktemp("model") / "template.db"
    upgrade(f"sqlite:///{path}")

    async def seeded() -> None:
        engine = create_engine(f"sqlite:///{path}")
        await seed(engine, 5)
        await engine.dispose()

    asyncio.run(seeded())
    PipelineModel.template = path


class PipelineModel(RuleBasedStateMachine):
    template: Path

    @initialize(limit=st.integers(min_value=1, max_value=3), rate=st.booleans())
    def boot(self, limit: int = 2, rate: bool = False) -> None:
        """A fresh database; the limited jobs of this example are under a concurrency limit
        of ``limit`` per key and, with ``rate``, share one rate limit."""
        self.limit = limit
        self.rate = rate
        self.dir = Path(tempfile.mkdtemp(prefix="jobrelay-model-"))
        shutil.copy(self.template, self.dir / "db.sqlite")
        self.loop = asyncio.new_event_loop()
        self.clock = Clock()
        self.settings = Settings(
            database_url=f"sqlite:///{self.dir}/db.sqlite",
            results_url=f"file://{self.dir}/exports",
            retry_delays="5",
            lease_seconds=30,
            max_attempts=3,
            reconcile_grace_seconds=GRACE_SECONDS,
        )
        self.engine = create_engine(self.settings.database_url)
        self.store = Store(self.engine, clock=self.clock)
        self.rt = Runtime(
            settings=self.settings,
            engine=self.engine,
            store=self.store,
            transport=WorkQueue(lambda: len(self._deliverable())),  # type: ignore[arg-type]
            results=FileResults(self.settings.results_url),
            faults=Faults(),
            topology=topology_for(self.settings),
            clock=self.clock,
        )
        self.operator = Operator(self.rt)
        self.accepted: set[str] = set()
        self.in_flight: list[Message] = []
        self.seen: dict[str, JobState] = {}
        # Every job as the last invariant check read it: what the preconditions look at.
        self.jobs: dict[str, JobRecord] = {}
        # Operator moves made in this step, checked (and consumed) by the invariant.
        self.operator_moves: dict[str, tuple[JobState, JobState]] = {}
        # Jobs with a message the broker gave up on: running ones may be left with no message.
        self.dead_lettered: set[str] = set()
        self.worker_n = 0
        self.covered: set[str] = set()  # the labelled cases this run reached

    def run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(coro)

    def case(self, label: str, skew: int = 0) -> None:
        """Label a case worth reaching (``--hypothesis-show-statistics`` counts them); with a
        ``skew``, the case is also labelled with how far the worker's clock was off."""
        labels = [label] + ([f"{label}, worker clock {skew:+d} s"] if skew else [])
        for one in labels:
            self.covered.add(one)
            if currently_in_test_context():
                event(one)

    def worker_runtime(self, skew: int) -> Runtime:
        """The runtime a worker runs with: its host's clock is ``skew`` seconds off the model
        clock, which stays the store's (and the reconciler's and operator's) clock."""
        if not skew:
            return self.rt
        offset = timedelta(seconds=skew)
        return dataclasses.replace(self.rt, clock=lambda: self.clock() + offset)

    def teardown(self) -> None:
        if hasattr(self, "loop"):
            self.run(self.engine.dispose())
            self.loop.close()
            shutil.rmtree(self.dir, ignore_errors=True)

    def job(self, job_id: str) -> JobRecord:
        job: JobRecord | None = self.run(self.store.get_job(job_id))
        assert job is not None, f"{job_id} vanished"
        return job

    def kinds(self, job_id: str) -> list[str]:
        return [e.kind for e in self.written(job_id)]

    def written(self, job_id: str) -> list[EventRecord]:
        """The job's events in the order they were written (by id). The timeline the API
        serves is ordered by time, and a worker whose host clock is behind stamps its
        settle events earlier than what came before them; "what this step wrote" is the
        tail in write order."""

        async def read() -> list[EventRecord]:
            async with self.engine.connect() as conn:
                rows = await conn.execute(
                    select(job_events.c.at, job_events.c.kind, job_events.c.detail)
                    .where(job_events.c.job_id == job_id)
                    .order_by(job_events.c.id)
                )
                return [EventRecord(r.at, r.kind, r.detail or {}) for r in rows]

        return self.run(read())

    # --- pipeline rules ------------------------------------------------------------------

    @rule(
        account=st.sampled_from(ACCOUNTS),
        period=st.sampled_from(PERIODS),
        duplicate=st.booleans(),
        key=st.sampled_from((None, *LIMIT_KEYS)),
    )
    def submit(self, account: str, period: str, duplicate: bool, key: str | None = None) -> None:
        """A job, under limits when ``key`` is given: the example's concurrency limit for
        that key (and its rate limit, if it drew one), as ``@app.job(limits=…)`` writes them.
        A limited request has an idempotency key of its own, so it is a job of its own."""
        params = {"accountId": account, "period": period}
        idempotency = None if key is None else f"limited-{key}-{period}"
        limits: tuple[JobLimit, ...] = ()
        if key is not None:
            limits = (JobLimit(limit_id(LIMITED, key), CONCURRENCY, max=self.limit),)
            if self.rate:
                limits += (JobLimit(RATE_ID, RATE, per_second=RATE_PER_SECOND, burst=RATE_BURST),)
        job = NewJob(
            self.run(request_id(self.store, account, params, key=idempotency)),
            "report.export",
            account,
            params,
            request_hash(account, "report.export", params),
            max_attempts=3,
            idempotency_key=idempotency,
            limits=limits,
        )
        for _ in range(2 if duplicate else 1):
            job_id, _ = self.run(self.store.submit(job, self.clock()))
        self.accepted.add(job_id)

    @precondition(
        lambda self: any(
            j.unpublished_since and not j.awaiting_admission for j in self.jobs.values()
        )
    )
    @rule()
    def relay(self) -> None:
        now = self.clock()
        rows = self.run(self.store.claim_outbox("relay", 50, timedelta(seconds=30)))
        for row in rows:
            delay = retry_seconds(row.destination) or 0
            self.in_flight.append(Message(row.body, now + timedelta(seconds=delay)))
        self.run(self.store.mark_published("relay", rows))

    @precondition(lambda self: any(j.awaiting_admission for j in self.jobs.values()))
    @rule(budget=st.sampled_from([1, 2, 50]))
    def admit(self, budget: int) -> None:
        """A relay's admission round (``Store.admit_waiting``), run before it claims outbox
        rows: at most ``budget`` jobs admitted, each taking a slot of its key. With no rate
        limit and room for every waiting job in the round, a key is left with a due job
        waiting only when its slots are all taken (a leaked slot would show here)."""
        answer = self.run(self.store.admit_waiting(budget))
        assert answer.admitted <= budget, answer
        if answer.admitted:
            self.case("admit: jobs admitted")
        if answer.held:
            self.case("admit: jobs held at their limits")
        if self.rate or budget < 50:
            return
        held = Counter(limit for limit, _ in self.run(self._slots()))
        for limit, waiting in self.run(self._due_and_waiting()).items():
            assert held[limit] == self.limit, f"{limit}: {waiting} due, {held[limit]} held"
            self.case("admit: a key at its limit keeps its due jobs waiting")

    async def _slots(self) -> list[tuple[str, str]]:
        """Every slot held: (limit id, job id)."""
        async with self.engine.connect() as conn:
            rows = await conn.execute(select(job_slots.c.limit_id, job_slots.c.job_id))
            return [(limit, job_id) for limit, job_id in rows]

    async def _due_and_waiting(self) -> Counter[str]:
        """Per concurrency limit id, the jobs awaiting admission whose message waiting for it
        is due. Not an older copy written while the job held its admission (a deferral of
        the attempt a retry then ended): no admission sends it, and a worker that meets it
        acks it unrun while its job waits (``test_limits``)."""
        now = self.clock()
        async with self.engine.connect() as conn:
            rows = await conn.execute(
                select(outbox.c.job_id, outbox.c.available_at).where(
                    outbox.c.published_at.is_(None), outbox.c.awaiting_admission.is_(True)
                )
            )
            due = {job_id for job_id, at in rows if at is None or at <= now}
        found: Counter[str] = Counter()
        for job in await self.store.list_jobs(limit=1000):
            if job.awaiting_admission and job.id in due:
                for limit in job.limits:
                    if limit.kind == CONCURRENCY:
                        found[limit.limit_id] += 1
        return found

    def _in_states(self, *states: JobState) -> list[JobRecord]:
        return sorted((j for j in self.jobs.values() if j.state in states), key=lambda j: j.id)

    def _orphans(self) -> bool:
        """A running job with no message at all (it was dead-lettered): reconciler's work."""
        pending = {m.job_id for m in self.in_flight}
        return any(
            j.unpublished_since is None and j.id not in pending
            for j in self._in_states(JobState.RUNNING)
        )

    def _deliverable(self) -> list[Message]:
        return [m for m in self.in_flight if m.due <= self.clock()]

    @precondition(lambda self: bool(self._deliverable()))
    @rule(
        pick=st.integers(min_value=0, max_value=50),
        fault=st.sampled_from(FAULTS),
        duplicate=st.booleans(),
        skew=st.sampled_from(SKEWS),
    )
    def deliver(self, pick: int, fault: str | None, duplicate: bool, skew: int = 0) -> None:
        """One delivery to a fresh worker, whose host clock is ``skew`` seconds off."""
        ready = self._deliverable()
        self._deliver(ready[pick % len(ready)], fault, duplicate, skew)

    def _deliver(self, message: Message, fault: str | None, duplicate: bool, skew: int = 0) -> None:
        # The model clock is the store's: every expectation below judges time by it, whatever
        # the worker's host clock says.
        now = self.clock()
        before = self.job(message.job_id)
        seen_events = len(self.kinds(before.id))
        self.worker_n += 1
        worker_id = f"w{self.worker_n}"
        self.rt.faults = Faults(fault, crash_handler=_crash) if fault else Faults()
        delivery = Delivery(
            message.body, redelivered=duplicate or message.unsettled > 0, count=message.unsettled
        )
        # A Crash is the process dying unsettled: the broker delivers the message again.
        with contextlib.suppress(Crash):
            self.run(Worker(self.worker_runtime(skew), worker_id=worker_id).handle(delivery))
        assert len(delivery.settles) <= 1, delivery.settles
        if delivery.outcome in ("ack", "reject"):
            if not duplicate:
                self.in_flight.remove(message)
        elif not duplicate:
            message.unsettled += 1
        # With duplicate=True this was a second copy (a relay republish): the original stays.

        new = self.written(before.id)[seen_events:]
        crashed_before_settling = fault == "worker.before_ack:crash"
        if before.state.is_terminal:
            # Later deliveries for a finished job are settled without work and without a new
            # message: acked for succeeded and cancelled, rejected (to the quarantine queue)
            # for quarantined.
            expected: str | None
            if before.state is JobState.QUARANTINED:
                expected, recorded = "reject", ["duplicate_rejected", "rejected"]
            else:
                expected, recorded = "ack", ["duplicate_acked", "ack_sent"]
            if crashed_before_settling:
                expected, recorded = None, recorded[:1]
            assert [e.kind for e in new] == recorded, f"{before.state}: {new}"
            assert delivery.outcome == expected, (before.state, delivery.outcome)
            self.case(f"deliver: {before.state} job settled without work")
            return
        claims = [e for e in new if e.kind == "claimed"]
        if before.state is JobState.RUNNING:
            assert before.lease_expires_at is not None
            if before.lease_expires_at > now:
                # A crashed worker's lease still runs: re-check later, never run twice. The
                # deferral says whose lease it is (not a claim that kept losing races).
                deferred = [e for e in new if e.kind == "deferred"]
                assert not claims and deferred, new
                assert deferred[0].detail.get("reason") == f"lease held by {before.lease_owner}"
                self.case("deliver: live lease deferred", skew)
            elif before.cancel_requested_at is not None:
                # An operator cancelled it and its worker died: ended, never run again.
                assert not claims and "cancelled" in {e.kind for e in new}, new
                self.case("deliver: cancel requested, expired lease ended cancelled", skew)
            elif before.attempt < before.max_attempts:
                # The lease expired: this redelivery takes the job over with a new attempt.
                self._claimed_by(worker_id, before, claims, new)
                self.case("deliver: expired lease taken over by a redelivery", skew)
            else:
                assert not claims and "quarantined" in {e.kind for e in new}, new
                self.case("deliver: expired lease with no attempt left quarantined", skew)
        elif (
            before.state is JobState.RETRY_WAIT
            and before.next_attempt_at is not None
            and before.next_attempt_at - RETRY_SLACK > now
        ):
            # A copy that arrives before the retry is due: redundant, the retry has its own.
            recorded = ["duplicate_acked", "ack_sent"]
            if crashed_before_settling:
                recorded = recorded[:1]
            assert [e.kind for e in new] == recorded, new
            assert delivery.outcome == (None if crashed_before_settling else "ack")
            self.case("deliver: early retry copy acked", skew)
        elif before.awaiting_admission:
            # A copy from before its admission ended (a retry, a replay): not its turn; its
            # own message waits in the outbox for its limits.
            recorded = ["duplicate_acked", "ack_sent"]
            if crashed_before_settling:
                recorded = recorded[:1]
            assert [e.kind for e in new] == recorded, new
            assert new[0].detail.get("reason") == "waiting for its limits", new
            assert delivery.outcome == (None if crashed_before_settling else "ack")
            self.case("deliver: copy met while awaiting admission acked", skew)
        elif before.attempt < before.max_attempts:
            # Queued, or a retry that is due: this delivery runs it.
            self._claimed_by(worker_id, before, claims, new)
            self.case(f"deliver: {before.state} job claimed", skew)
        else:
            # A retry the reconciler re-queued after the last attempt's lease ran out.
            assert not claims and "quarantined" in {e.kind for e in new}, new
            self.case(f"deliver: {before.state} job with no attempt left quarantined", skew)

    def _claimed_by(
        self, worker_id: str, before: JobRecord, claims: list[EventRecord], new: object
    ) -> None:
        assert [c.detail.get("worker") for c in claims] == [worker_id], new
        assert claims[0].detail.get("attempt") == before.attempt + 1, new

    @precondition(lambda self: bool(self._deliverable()))
    @rule(
        pick=st.integers(min_value=0, max_value=50),
        fault=st.sampled_from(COPY_FAULTS),
        takeover=st.booleans(),
        stale_first=st.booleans(),
    )
    def two_copies(self, pick: int, fault: str | None, takeover: bool, stale_first: bool) -> None:
        """Two copies of one message under ONE worker id (two handlers, see ``_two_copies``):
        the second is handled while the first is inside the operation.

        With ``takeover`` the store's clock passes the first copy's lease before the second
        is handled, so the second claims the job again (or, with no attempt left, quarantines
        it). ``stale_first`` lets the superseded copy write its outcome first. The fence is
        the attempt: the later claim's outcome is the one recorded, every superseded claim
        records ``lease_lost`` and is acked, and each delivery is settled exactly once.
        """
        ready = self._deliverable()
        message = ready[pick % len(ready)]
        before = self.job(message.job_id)
        seen_events = len(self.kinds(before.id))
        self.worker_n += 1
        worker_id = f"w{self.worker_n}"
        self.rt.faults = Faults(fault) if fault else Faults()
        export = default_registry(self.settings).get("report.export")
        assert export is not None
        gate = Gate(export)
        # Two handlers under one worker id: in ONE handler the second copy, a suspect once
        # the first's lease lapsed, would wait for the first's run to end (worker.isolation).
        # The fence is the attempt, not only the owner, so one id is the hard case.
        workers = tuple(
            Worker(self.rt, registry=gate.registry(self.settings), worker_id=worker_id)
            for _ in range(2)
        )
        count = message.unsettled
        first = Delivery(message.body, redelivered=count > 0, count=count)
        second = Delivery(message.body, redelivered=True, count=count)
        first_ran, second_ran = self.run(
            self._two_copies(workers, gate, first, second, takeover, stale_first)
        )
        self.in_flight.remove(message)  # both copies were settled (checked below)

        after = self.job(before.id)
        new = self.written(before.id)[seen_events:]
        assert first.settles in (["ack"], ["reject"]), first.settles
        assert second.settles in (["ack"], ["reject"]), second.settles
        claims = [e.detail["attempt"] for e in new if e.kind == "claimed"]
        assert {e.detail["worker"] for e in new if e.kind == "claimed"} <= {worker_id}, new
        assert claims == sorted(claims), new
        # The outcome a run writes carries its claim's attempt (a delivery-time quarantine,
        # of a job with no attempt left, carries none).
        outcomes = [
            (e.kind, e.detail["attempt"])
            for e in new
            if e.kind in ("result_saved", "retry_scheduled", "quarantined")
            and "attempt" in e.detail
        ]
        lost = [
            (e.detail["attempt"], e.detail["currentAttempt"]) for e in new if e.kind == "lease_lost"
        ]
        # Every claim ends in exactly one thing: its outcome, or lease_lost; at most one wins.
        assert sorted([a for _, a in outcomes] + [a for a, _ in lost]) == claims, new
        assert len(outcomes) <= 1 and [e.kind for e in new].count("result_saved") <= 1, new
        if outcomes:
            # The winner is the latest claim, and what the job shows is the winner's.
            kind, attempt = outcomes[0]
            assert attempt == claims[-1] == after.attempt, new
            if kind == "result_saved":
                assert after.state is JobState.SUCCEEDED, after.state
                assert after.result_meta is not None and "attempt" not in after.result_meta
        for _, current in lost:
            assert current == after.attempt, new  # the loser names the claim that holds it
        if not first_ran:
            # The first copy did no work (a finished job, a retry not due, another worker's
            # live lease): nothing overlapped, nobody lost a lease.
            assert not lost, new
            return
        assert claims[0] == before.attempt + 1, new
        if second_ran:
            # Both claimed, the second over the first's expired lease: the second wins
            # whichever writes first, the first records lease_lost and is acked.
            assert takeover and claims == [claims[0], claims[0] + 1], new
            assert [a for _, a in outcomes] == [claims[1]], new
            assert lost == [(claims[0], claims[1])], new
            assert first.settles == ["ack"], first.settles
            order = "the stale copy wrote first" if stale_first else "the winner wrote first"
            self.case(f"two copies: the later claim won, the stale copy lost its lease ({order})")
        elif takeover:
            # The first's lease ran out on the last attempt: the second quarantines the job
            # (worker lost), and the first, when it finishes, has lost it.
            assert claims[0] >= before.max_attempts, new
            assert after.state is JobState.QUARANTINED and second.settles == ["reject"], new
            assert not outcomes and lost == [(claims[0], claims[0])], new
            assert first.settles == ["ack"], first.settles
            self.case("two copies: a take-over with no attempt left quarantined, first lost")
        else:
            # The first's lease is live: the second copy is deferred, and the first runs on.
            deferred = [e for e in new if e.kind == "deferred"]
            assert claims == [claims[0]] and not lost and deferred, new
            assert deferred[0].detail.get("reason") == f"lease held by {worker_id}", new
            assert second.settles == ["ack"], second.settles
            assert [a for _, a in outcomes] == claims, new
            self.case("two copies: the second deferred by the first's live lease")

    async def _two_copies(
        self,
        workers: tuple[Worker, Worker],
        gate: Gate,
        first: Delivery,
        second: Delivery,
        takeover: bool,
        stale_first: bool,
    ) -> tuple[bool, bool]:
        """Handle ``first`` until it is inside the operation (or done), maybe let its lease
        run out, handle ``second`` the same way, then let them finish in the chosen order.
        Returns which of the two ran the operation."""
        tasks: list[asyncio.Task[None]] = []
        try:
            tasks.append(asyncio.create_task(workers[0].handle(first)))
            first_run = await gate.parked(tasks[0])
            if takeover:
                self.clock.now += timedelta(seconds=self.settings.lease_seconds + 1)
            tasks.append(asyncio.create_task(workers[1].handle(second)))
            second_run = await gate.parked(tasks[1])
            order = [(tasks[0], first_run), (tasks[1], second_run)]
            if not stale_first:
                order.reverse()
            for task, run in order:
                if run is not None:
                    run.set()
                await task
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        return first_run is not None, second_run is not None

    @precondition(lambda self: any(m.unsettled for m in self.in_flight))
    @rule(pick=st.integers(min_value=0, max_value=50))
    def dead_letter(self, pick: int) -> None:
        """The broker gives up on a message that crashes keep leaving unsettled (the quorum
        queue's delivery limit) and dead-letters it: its job may be left ``running`` with no
        message at all, which only the reconciler repairs."""
        candidates = [m for m in self.in_flight if m.unsettled]
        message = candidates[pick % len(candidates)]
        self.in_flight.remove(message)
        self.dead_lettered.add(message.job_id)

    @precondition(
        lambda self: self.in_flight or self._in_states(JobState.RUNNING, JobState.RETRY_WAIT)
    )
    @rule(seconds=st.sampled_from([1, 5, 31, 120]))
    def advance(self, seconds: int) -> None:
        """Time matters to a message in a delay tier, a lease or a retry's due time."""
        self.clock.now += timedelta(seconds=seconds)

    @precondition(lambda self: self._in_states(JobState.RUNNING, JobState.RETRY_WAIT))
    @rule()
    def reconcile(self) -> None:
        """A reconciler pass: exactly the running jobs whose lease expired more than the grace
        ago go to ``retry_wait`` (due now) with a work message; nothing else changes state."""
        now = self.clock()
        overdue = now - timedelta(seconds=GRACE_SECONDS)
        before = {j.id: j for j in self.run(self.store.list_jobs(limit=1000))}
        waiting = self.run(self._work_rows_waiting())
        report = self.run(
            Reconciler(self.rt, actor="reconciler:model").run_once(scan_quarantine=False)
        )
        expired = {
            j.id
            for j in before.values()
            if j.state is JobState.RUNNING
            and j.lease_expires_at is not None
            and j.lease_expires_at < overdue
        }
        found = [f for f in report.findings if f.kind == LEASE_EXPIRED]
        assert sorted(f.job_id or "" for f in found) == sorted(expired), report.as_dict()
        assert all(f.repaired for f in found), report.as_dict()
        waiting_after = self.run(self._work_rows_waiting())
        for job in self.run(self.store.list_jobs(limit=1000)):
            if job.id in expired and before[job.id].cancel_requested_at is not None:
                # An operator asked to cancel it and its worker is gone: the pass ends it
                # cancelled (storage/cancels.py), with no work message.
                assert job.state is JobState.CANCELLED and job.lease_owner is None, job
                assert waiting_after[job.id] == waiting[job.id], "a message for a cancel"
                self.case("reconcile: abandoned cancel ended")
            elif job.id in expired:
                assert job.state is JobState.RETRY_WAIT
                assert job.next_attempt_at == now and job.lease_owner is None
                assert waiting_after[job.id] == waiting[job.id] + 1, "repaired without a message"
                assert self.kinds(job.id)[-1] == RECONCILED_LEASE
                self.case("reconcile: expired lease re-queued")
            else:
                assert job.state is before[job.id].state, f"reconciler moved {job.id}"

    # --- operator rules ------------------------------------------------------------------

    def _operable(self, target: JobState, allowed: bool = True) -> list[JobRecord]:
        """Jobs from whose state an operator may (or, ``allowed=False``, may not) move them
        to ``target``, by the state machine's table."""
        return [
            j
            for j in self._in_states(*JobState)
            if can_transition(j.state, target, by="operator") is allowed
        ]

    @precondition(lambda self: self.jobs)
    @rule(
        action=st.sampled_from(["replay", "cancel"]),
        allowed=st.booleans(),
        pick=st.integers(min_value=0, max_value=50),
    )
    def operator_action(self, action: str, allowed: bool, pick: int) -> None:
        """Replay or cancel a job from a state the table allows it from, or (``allowed=False``)
        from one it does not."""
        target = JobState.QUEUED if action == "replay" else JobState.CANCELLED
        jobs = self._operable(target, allowed)
        if jobs:
            self._operator(action, jobs[pick % len(jobs)])

    def _operator(self, action: str, before: JobRecord) -> None:
        """The real operator action: done exactly when the state machine has that
        ``by="operator"`` edge from the job's state, refused without a write otherwise."""
        job_id = before.id
        waiting = self.run(self._work_rows_waiting())[job_id]
        if action == "replay":
            target = JobState.QUEUED
            outcome = self.run(self.operator.replay(job_id, actor="model", reason="model"))
        else:
            target = JobState.CANCELLED
            outcome = self.run(self.operator.cancel(job_id, actor="model", reason="model"))
        after = self.job(job_id)
        if action == "cancel" and before.state is JobState.RUNNING:
            # A running job's cancel is a request: recorded, the job still running; its
            # worker (dead or alive), the next delivery or the reconciler ends it.
            assert outcome.done and outcome.requested, outcome
            assert after.state is JobState.RUNNING and after.cancel_requested_at is not None
            assert "cancel_requested" in self.kinds(job_id)
            self.case("operator: cancel requested while running")
            return
        allowed = can_transition(before.state, target, by="operator")
        assert outcome.done is allowed, (action, before.state, outcome)
        if not outcome.done:
            assert outcome.state is before.state and after.state is before.state
            assert after.updated_at == before.updated_at, f"a refused {action} wrote the row"
            self.case(f"operator: {action} refused from {before.state}")
            return
        self.case(f"operator: {action} from {before.state}")
        assert after.state is target and outcome.previous_state is before.state
        assert after.lease_owner is None and after.next_attempt_at is None
        assert self.kinds(job_id)[-1] == ("replayed" if action == "replay" else "cancelled")
        if action == "replay":
            # A fresh budget on top of the attempts already used; attempts keep counting.
            assert after.attempt == before.attempt
            assert after.max_attempts == before.attempt + self.settings.max_attempts
            assert after.quarantine_reason is None
            assert self.run(self._work_rows_waiting())[job_id] == waiting + 1, "no work message"
        self.operator_moves[job_id] = (before.state, after.state)

    # --- liveness ------------------------------------------------------------------------

    @precondition(lambda self: self._orphans())
    @rule()
    def drain(self) -> None:
        """A job is running on a dead worker's lease and the broker dead-lettered its message:
        only the reconciler can save it. With no more faults and time moving on (reconciler,
        relay and workers running), every accepted job, that one included, finishes."""
        # Rounds enough for every limited job to get its turn: a key's jobs run ``limit`` at
        # a time, and under the rate limit 2 are admitted per round (its burst).
        for _ in range(40):
            self.clock.now += timedelta(seconds=121)  # past every lease, retry tier and grace
            self.reconcile()
            while True:  # each run that ends gives its slot to the next job of its key
                self.admit(budget=50)
                self.relay()
                ready = self._deliverable()
                if not ready:
                    break
                for message in ready:
                    self._deliver(message, None, duplicate=False)
            states = {job_id: self.job(job_id).state for job_id in self.accepted}
            unfinished = {job_id: s for job_id, s in states.items() if not s.is_terminal}
            if not unfinished and not self.in_flight and not self.run(self.store.outbox_backlog()):
                return
        pytest.fail(f"not finished after draining: {unfinished}, in flight: {self.in_flight}")

    # --- invariants ----------------------------------------------------------------------

    @invariant()
    def promises_hold(self) -> None:
        if not hasattr(self, "store"):
            return
        jobs = {job.id: job for job in self.run(self.store.list_jobs(limit=1000))}
        self.jobs = jobs
        kinds = self.run(self._all_event_kinds())
        self._moves_are_legal_and_final_states_stay(jobs)
        self._at_most_one_result_and_cancelled_is_final(kinds)
        self._no_accepted_job_is_lost(jobs)
        self._limits_hold(jobs)

    async def _work_rows_waiting(self) -> Counter[str]:
        """Per job, how many work messages wait in the outbox for the relay."""
        async with self.engine.connect() as conn:
            rows = await conn.execute(
                select(outbox.c.job_id).where(
                    outbox.c.published_at.is_(None), outbox.c.destination == WORK_DESTINATION
                )
            )
            return Counter(job_id for (job_id,) in rows)

    async def _all_event_kinds(self) -> dict[str, list[str]]:
        """Every job's event kinds in order: one query per step, not one per job."""
        async with self.engine.connect() as conn:
            rows = await conn.execute(
                select(job_events.c.job_id, job_events.c.kind).order_by(job_events.c.id)
            )
            out: dict[str, list[str]] = {}
            for job_id, kind in rows:
                out.setdefault(job_id, []).append(kind)
        return out

    def _moves_are_legal_and_final_states_stay(self, jobs: dict[str, JobRecord]) -> None:
        for job in jobs.values():
            before = self.seen.get(job.id)
            moved_by_operator = self.operator_moves.pop(job.id, None)
            if before is None:
                assert job.state is JobState.QUEUED, f"{job.id} first seen {job.state}"
            elif moved_by_operator is not None:
                # The step was one operator action: exactly its edge, nothing else on top.
                source, target = moved_by_operator
                assert source is before and job.state is target, (before, moved_by_operator)
                assert can_transition(source, target, by="operator"), moved_by_operator
                assert source not in FINAL, f"operator moved a final job: {moved_by_operator}"
            elif before is not job.state:
                assert before not in FINAL, f"{job.id}: {before} -> {job.state}"
                # The pipeline never moves a terminal job: quarantined waits for an operator.
                assert not before.is_terminal, f"{job.id}: {before} -> {job.state}"
                assert _reachable(before, job.state), f"{before} -> {job.state}"
            self.seen[job.id] = job.state
        assert not self.operator_moves, f"operator moved unknown jobs: {self.operator_moves}"

    def _at_most_one_result_and_cancelled_is_final(self, kinds: dict[str, list[str]]) -> None:
        for job_id in self.accepted:
            events = kinds[job_id]
            assert events.count("result_saved") <= 1, events
            if "cancelled" in events:
                # Cancelled is final: once, never after a result, and no work after it.
                assert events.count("cancelled") == 1, events
                assert "result_saved" not in events, events
                after = events[events.index("cancelled") + 1 :]
                assert not WORK_EVENTS & set(after), f"work after cancel: {after}"

    def _no_accepted_job_is_lost(self, jobs: dict[str, JobRecord]) -> None:
        pending = {m.job_id for m in self.in_flight}
        for job_id in self.accepted:
            job = jobs[job_id]
            if job.state.is_terminal:
                continue
            if job.unpublished_since is not None or job_id in pending:
                continue
            # The one accepted gap: its message was dead-lettered while a (dead) worker held
            # the job. The lease says when the reconciler may take it back (drain checks it).
            assert job.state is JobState.RUNNING and job.lease_expires_at is not None, (
                f"{job_id} is {job.state} with no message left to deliver it"
            )
            assert job_id in self.dead_lettered, f"{job_id} is running with no message"

    def _limits_hold(self, jobs: dict[str, JobRecord]) -> None:
        """Per key: a slot for exactly each job admitted and not finished (none leaked, none
        given back twice or early), never more slots nor running jobs than the limit; at
        rest (every job finished) no slot at all. Under the rate limit: no stretch of the
        store's time holds more admissions than the burst plus the rate over it."""
        slots = self.run(self._slots())
        held: dict[str, set[str]] = {}
        for limit, job_id in slots:
            held.setdefault(limit, set()).add(job_id)
        assert len(slots) == sum(len(ids) for ids in held.values()), slots
        admitted: dict[str, set[str]] = {}
        running: Counter[str] = Counter()
        for job in jobs.values():
            if not job.limits:
                continue
            if job.state.is_terminal:
                assert job.admitted_at is None, f"{job.id} is {job.state} and still admitted"
            if job.state is JobState.RUNNING:
                assert job.admitted_at is not None, f"{job.id} runs unadmitted"
            for limit in job.limits:
                if limit.kind != CONCURRENCY:
                    continue
                assert limit.max == self.limit, limit
                if job.admitted_at is not None:
                    admitted.setdefault(limit.limit_id, set()).add(job.id)
                running[limit.limit_id] += job.state is JobState.RUNNING
        for limit in held.keys() | admitted.keys():
            holders, owed = held.get(limit, set()), admitted.get(limit, set())
            shown = " ".join(filter(None, split_id(limit)))
            assert holders == owed, (
                f"{shown}: slots held by {sorted(holders)}, admitted and unfinished:"
                f" {sorted(owed)} (leaked: {sorted(holders - owed)},"
                f" missing: {sorted(owed - holders)})"
            )
            assert len(holders) <= self.limit, f"{shown}: {len(holders)} slots > {self.limit}"
            if len(holders) == self.limit:
                self.case("limits: a key holds every slot of its limit")
        for limit, n in running.items():
            assert n <= self.limit, f"{split_id(limit)}: {n} running > {self.limit}"
        if all(jobs[job_id].state.is_terminal for job_id in self.accepted):
            assert not slots, f"at rest, slots still held: {slots}"
        if self.rate:
            self._rate_holds()

    def _rate_holds(self) -> None:
        async def read() -> list[datetime]:
            async with self.engine.connect() as conn:
                rows = await conn.execute(
                    select(job_events.c.at, job_events.c.detail).where(
                        job_events.c.kind == "admitted"
                    )
                )
                return sorted(at for at, detail in rows if (detail or {}).get("rate"))

        starts = self.run(read())
        for i, first in enumerate(starts):
            for j in range(i + 1, len(starts)):
                span = (starts[j] - first).total_seconds()
                assert j - i + 1 <= RATE_BURST + RATE_PER_SECOND * span + 1e-9, starts[i : j + 1]


def _reachable(source: JobState, target: JobState) -> bool:
    """One step of the model may make several pipeline moves (queued -> running -> done)."""
    seen, frontier = {source}, [source]
    while frontier:
        state = frontier.pop()
        for nxt in JobState:
            if nxt not in seen and can_transition(state, nxt):
                seen.add(nxt)
                frontier.append(nxt)
    return target in seen


def _crash(point: str) -> NoReturn:
    raise Crash(point)


# ``--hypothesis-show-statistics`` shows how often each new case (the ``event`` labels) ran.
TestPipelineModel = pytest.mark.long(pytest.mark.timeout(600)(PipelineModel.TestCase))
TestPipelineModel.settings = settings(
    max_examples=100,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


# --- fixed runs ------------------------------------------------------------------------------
# The random search above may miss a rare case in one run. These runs of the same machine (its
# rules with fixed arguments, every invariant after every step, written like the runs
# Hypothesis prints for a failure) reach each new case on every run of the suite.


class Steps:
    """``steps.rule(**arguments)`` runs that rule of the machine, then its invariants."""

    def __init__(self, machine: PipelineModel) -> None:
        self.machine = machine

    def __getattr__(self, name: str) -> Callable[..., None]:
        method = getattr(self.machine, name)

        def step(**arguments: Any) -> None:
            method(**arguments)
            self.machine.promises_hold()

        return step

    def expect(self, cases: set[str], **states: int) -> None:
        """These labelled cases were reached, and this many jobs end in each named state."""
        assert cases <= self.machine.covered, sorted(self.machine.covered)
        ended = [job.state.value for job in self.machine.jobs.values()]
        assert {s: ended.count(s) for s in states} == states, ended


def replay_after_a_permanent_failure(s: Steps) -> None:
    s.submit(account="acme", period="2020-01", duplicate=False)
    s.relay()
    s.deliver(pick=0, fault="export.run:invalid", duplicate=False)
    s.operator_action(action="replay", allowed=True, pick=0)
    s.relay()
    s.deliver(pick=0, fault=None, duplicate=False)
    s.expect({"operator: replay from quarantined"}, succeeded=1)


def crashes_take_over_expired_leases_until_quarantined_then_replay(s: Steps) -> None:
    s.submit(account="acme", period="2020-01", duplicate=False)
    s.relay()
    s.deliver(pick=0, fault="export.run:crash", duplicate=False)  # attempt 1 dies
    s.deliver(pick=0, fault=None, duplicate=False)  # the lease still runs: deferred
    s.relay()  # the re-check, through the delay tier
    s.advance(seconds=31)
    s.deliver(pick=0, fault="export.run:crash", duplicate=False)  # attempt 2 takes over, dies
    s.advance(seconds=31)
    s.deliver(pick=0, fault="export.run:crash", duplicate=False)  # attempt 3 takes over, dies
    s.advance(seconds=31)
    s.deliver(pick=0, fault=None, duplicate=False)  # no attempt left: quarantined
    s.operator_action(action="replay", allowed=True, pick=0)  # 3 more attempts
    s.relay()
    s.deliver(pick=0, fault=None, duplicate=False)
    s.operator_action(action="replay", allowed=False, pick=0)  # succeeded: refused
    s.expect(
        {
            "deliver: expired lease taken over by a redelivery",
            "deliver: expired lease with no attempt left quarantined",
            "operator: replay from quarantined",
            "operator: replay refused from succeeded",
        },
        succeeded=1,
    )


def cancel_from_each_state_then_deliveries_are_acked(s: Steps) -> None:
    for period in ("2020-01", "2020-02", "2020-03"):
        s.submit(account="acme", period=period, duplicate=False)
    s.relay()
    s.deliver(pick=0, fault="export.run:transient", duplicate=False)  # -> retry_wait
    s.deliver(pick=0, fault="export.run:invalid", duplicate=False)  # -> quarantined
    s.relay()  # the retry message, due in 5 s
    for _ in range(3):  # one job each: retry_wait, quarantined, queued
        s.operator_action(action="cancel", allowed=True, pick=0)
    s.operator_action(action="replay", allowed=False, pick=0)  # cancelled: refused
    s.advance(seconds=5)
    s.deliver(pick=0, fault=None, duplicate=False)
    s.deliver(pick=0, fault=None, duplicate=False)
    s.expect(
        {
            "operator: cancel from queued",
            "operator: cancel from retry_wait",
            "operator: cancel from quarantined",
            "operator: replay refused from cancelled",
            "deliver: cancelled job settled without work",
        },
        cancelled=3,
    )


def cancel_a_running_job_whose_worker_died(s: Steps) -> None:
    s.submit(account="acme", period="2020-01", duplicate=False)
    s.relay()
    s.deliver(pick=0, fault="export.run:crash", duplicate=False)  # attempt 1 dies, running
    s.operator_action(action="cancel", allowed=False, pick=0)  # running: requested
    s.deliver(pick=0, fault=None, duplicate=False)  # the lease still runs: deferred
    s.relay()  # the re-check, through the delay tier
    s.advance(seconds=31)
    s.deliver(pick=0, fault=None, duplicate=False)  # lease expired: ended, not run again
    s.expect(
        {
            "operator: cancel requested while running",
            "deliver: cancel requested, expired lease ended cancelled",
        },
        cancelled=1,
    )


def the_reconciler_repairs_a_lease_whose_message_was_dead_lettered(s: Steps) -> None:
    s.submit(account="acme", period="2020-01", duplicate=False)
    s.relay()
    s.deliver(pick=0, fault="export.run:crash", duplicate=False)
    s.dead_letter(pick=0)  # the broker gives up on it: the job has no message at all
    s.advance(seconds=31)
    s.reconcile()  # expired, but not yet past the grace: left alone
    s.advance(seconds=120)
    s.reconcile()
    s.relay()
    s.deliver(pick=0, fault=None, duplicate=False)
    s.expect({"reconcile: expired lease re-queued"}, succeeded=1)


def drain_finishes_every_job_after_a_dead_letter(s: Steps) -> None:
    s.submit(account="acme", period="2020-01", duplicate=False)
    s.submit(account="globex", period="2020-01", duplicate=False)
    s.relay()
    s.deliver(pick=0, fault="export.run:crash", duplicate=False)
    s.dead_letter(pick=0)
    s.drain()
    s.expect({"reconcile: expired lease re-queued"}, succeeded=2)


def two_copies_in_one_worker_the_later_claim_wins(s: Steps) -> None:
    for account in ACCOUNTS:
        s.submit(account=account, period="2020-01", duplicate=False)
    s.relay()
    # acme: copy 1 is inside the export when its lease runs out; copy 2 (same worker id)
    # takes the job over. Copy 1 writes first, and loses on the attempt.
    s.two_copies(pick=0, fault=None, takeover=True, stale_first=True)
    # globex: the same, and the winner writes first (a retry: attempt 2 of 3).
    s.two_copies(pick=0, fault="export.run:transient", takeover=True, stale_first=False)
    # initech: copy 1's lease is live, so copy 2 is deferred and copy 1 finishes the job.
    s.two_copies(pick=0, fault=None, takeover=False, stale_first=True)
    s.expect(
        {
            "two copies: the later claim won, the stale copy lost its lease"
            " (the stale copy wrote first)",
            "two copies: the later claim won, the stale copy lost its lease"
            " (the winner wrote first)",
            "two copies: the second deferred by the first's live lease",
        },
        succeeded=2,
        retry_wait=1,
    )


def two_copies_take_over_the_last_attempt(s: Steps) -> None:
    s.submit(account="acme", period="2020-01", duplicate=False)
    s.relay()
    s.deliver(pick=0, fault="export.run:crash", duplicate=False)  # attempt 1 dies
    s.advance(seconds=31)
    s.deliver(pick=0, fault="export.run:crash", duplicate=False)  # attempt 2 takes over, dies
    s.advance(seconds=31)
    # Copy 1 claims attempt 3 of 3; its lease runs out and copy 2 finds no attempt left.
    s.two_copies(pick=0, fault=None, takeover=True, stale_first=True)
    s.expect(
        {"two copies: a take-over with no attempt left quarantined, first lost"},
        quarantined=1,
    )


def skewed_worker_clocks_do_not_judge_leases_or_due_times(s: Steps) -> None:
    for account in ACCOUNTS:
        s.submit(account=account, period="2020-01", duplicate=False)
    s.relay()  # in flight: acme, globex, initech
    s.deliver(pick=0, fault="export.run:transient", duplicate=False, skew=30)  # acme: retry
    # initech: a copy fails (retry due in 5 s); the original arrives before that, on a worker
    # whose clock is 30 s ahead: still early by the store's clock, so acked without work.
    s.deliver(pick=1, fault="export.run:transient", duplicate=True)
    s.deliver(pick=1, fault=None, duplicate=False, skew=30)
    # globex: its worker dies; a worker 30 s ahead still finds the lease live.
    s.deliver(pick=0, fault="export.run:crash", duplicate=False)
    s.deliver(pick=0, fault=None, duplicate=False, skew=30)
    s.relay()  # acme's and initech's retries, globex's re-check: all due in 5 s
    s.advance(seconds=5)
    # Due by the store's clock, 25 s early by the worker's: the retries run.
    s.deliver(pick=0, fault=None, duplicate=False, skew=-30)
    s.deliver(pick=0, fault=None, duplicate=False, skew=-30)
    s.advance(seconds=31)
    # The dead worker's lease has run out by the store's clock, not yet by the worker's.
    s.deliver(pick=0, fault=None, duplicate=False, skew=-30)
    s.expect(
        {
            "deliver: early retry copy acked, worker clock +30 s",
            "deliver: live lease deferred, worker clock +30 s",
            "deliver: retry_wait job claimed, worker clock -30 s",
            "deliver: expired lease taken over by a redelivery, worker clock -30 s",
        },
        succeeded=3,
    )


def limited(**boot: Any) -> Callable[[Callable[[Steps], None]], Callable[[Steps], None]]:
    """A fixed run whose machine boots with these limits (``PipelineModel.boot``)."""

    def mark(run: Callable[[Steps], None]) -> Callable[[Steps], None]:
        run.boot = boot  # type: ignore[attr-defined]
        return run

    return mark


@limited(limit=1)
def a_key_runs_one_at_a_time_through_crashes_takeovers_and_the_reconciler(s: Steps) -> None:
    for account, period in (("acme", "2020-01"), ("acme", "2020-02"), ("globex", "2020-01")):
        s.submit(account=account, period=period, duplicate=False, key="k1")
    s.submit(account="acme", period="2020-01", duplicate=False, key="k2")
    s.admit(budget=50)  # k1: its first job, the other two held; k2: its one
    s.relay()  # in flight: k1's first, k2's
    s.deliver(pick=0, fault="export.run:crash", duplicate=False)  # k1's runner dies
    s.admit(budget=50)  # its slot is still held: nothing more for k1
    s.advance(seconds=31)
    # The redelivery takes the expired lease over with the slot, and quarantines the job.
    s.deliver(pick=0, fault="export.run:invalid", duplicate=False)
    s.admit(budget=50)  # the slot is back: k1's second job
    s.relay()  # in flight: k2's, k1's second
    s.deliver(pick=1, fault="export.run:crash", duplicate=False)  # k1's second runner dies
    s.dead_letter(pick=0)  # and the broker gives its message up: the reconciler's case
    s.advance(seconds=120)
    s.reconcile()  # re-queued, its slot given back
    s.admit(budget=1)  # k1's third job (waiting longest) takes it; the re-queued one waits
    s.relay()
    # k2's job runs a copy first (a retry due in 5 s, its slot given back); the original
    # arrives once the retry is due, while it waits for admission: acked without work.
    s.deliver(pick=0, fault="export.run:transient", duplicate=True)
    s.advance(seconds=5)
    s.deliver(pick=0, fault=None, duplicate=False)
    s.operator_action(action="replay", allowed=True, pick=0)  # k1's first, queued again
    s.drain()
    s.expect(
        {
            "admit: jobs held at their limits",
            "admit: a key at its limit keeps its due jobs waiting",
            "limits: a key holds every slot of its limit",
            "deliver: expired lease taken over by a redelivery",
            "reconcile: expired lease re-queued",
            "deliver: copy met while awaiting admission acked",
            "operator: replay from quarantined",
        },
        succeeded=4,
    )


@limited(limit=3, rate=True)
def the_rate_limit_admits_its_burst_then_one_per_five_seconds(s: Steps) -> None:
    for key in ("k1", "k2"):
        for period in ("2020-01", "2020-02"):
            s.submit(account="acme", period=period, duplicate=False, key=key)
    s.admit(budget=50)  # the burst: 2 of 4
    s.admit(budget=50)  # no token left
    s.advance(seconds=5)
    s.admit(budget=50)  # one more
    s.operator_action(action="cancel", allowed=True, pick=0)  # a held or an admitted job
    s.relay()
    s.deliver(pick=0, fault=None, duplicate=False)
    s.advance(seconds=31)
    s.admit(budget=50)
    s.relay()
    s.deliver(pick=0, fault="export.run:crash", duplicate=False)
    s.drain()
    s.expect({"admit: jobs held at their limits", "operator: cancel from queued"}, cancelled=1)


@pytest.mark.parametrize(
    "run",
    [
        replay_after_a_permanent_failure,
        crashes_take_over_expired_leases_until_quarantined_then_replay,
        cancel_from_each_state_then_deliveries_are_acked,
        cancel_a_running_job_whose_worker_died,
        the_reconciler_repairs_a_lease_whose_message_was_dead_lettered,
        drain_finishes_every_job_after_a_dead_letter,
        two_copies_in_one_worker_the_later_claim_wins,
        two_copies_take_over_the_last_attempt,
        skewed_worker_clocks_do_not_judge_leases_or_due_times,
        a_key_runs_one_at_a_time_through_crashes_takeovers_and_the_reconciler,
        the_rate_limit_admits_its_burst_then_one_per_five_seconds,
    ],
    ids=lambda run: run.__name__,
)
def test_fixed_run(run: Callable[[Steps], None]) -> None:
    machine = PipelineModel()
    machine.boot(**getattr(run, "boot", {}))
    try:
        machine.promises_hold()
        run(Steps(machine))
    finally:
        machine.teardown()
